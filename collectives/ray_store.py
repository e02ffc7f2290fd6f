"""The run's rendezvous store as a Ray actor: joining a run's groups takes the run's Ray credentials.

A `torch.distributed.TCPStore` accepts any client that reaches its port (no credentials, and on torch
2.13 `list_keys` shows every key, so secret key names would not help either). Here the keys live in an
async actor instead, and members reach it only through Ray: every call is an actor task on Ray's gRPC
channels, which check the cluster's token (token auth, the default of a local `ray.init()` and of the
documented cluster), and a member needs the actor's handle, which only travels inside the group specs the
driver sends. `RayStore` is the member side: a `torch.distributed.Store` that ProcessGroupGloo (through a
`PrefixStore`) and the NCCL unique-id exchange use like any c10d store.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import ray
import torch.distributed as dist

from collectives.store_actor import StoreActor, home_node_strategy

# Members wait in the actor, so a `get` of a key not yet set costs one call, not a polling loop. A member
# gives up on the actor itself after the store's timeout (as a TCPStore client gives up connecting: the
# actor may still be starting, its process importing torch, on a busy node) plus this much.
_CALL_SLACK_S = 10.0


class RayStore(dist.Store):
    """A member's client of the run's StoreActor. Keep a reference for as long as a group uses it: the C++
    side of a PrefixStore does not keep this Python object alive."""

    def __init__(self, actor: Any, timeout_s: float):
        super().__init__()
        self._actor, self._timeout_s = actor, timeout_s

    def _call(self, method: str, *args: Any, wait_s: float = 0.0) -> Any:
        ref = getattr(self._actor, method).remote(*args)
        try:
            return ray.get(ref, timeout=max(wait_s, self._timeout_s) + _CALL_SLACK_S)
        except ray.exceptions.RayTaskError as err:
            raise (err.cause or err) from None  # the store's own error (a TimeoutError), not Ray's wrapper

    def _wait_s(self, timeout: timedelta | None) -> float:
        return timeout.total_seconds() if timeout is not None else self._timeout_s

    def set(self, key: str, value: bytes | str) -> None:
        self._call("set", key, value.encode() if isinstance(value, str) else bytes(value))

    def multi_set(self, keys: list[str], values: list[bytes]) -> None:
        self._call("multi_set", list(keys), [bytes(v) for v in values])

    def get(self, key: str) -> bytes:
        return self._call("get", key, self._timeout_s, wait_s=self._timeout_s)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._call("multi_get", list(keys), self._timeout_s, wait_s=self._timeout_s)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        wait_s = self._wait_s(timeout)
        self._call("wait", list(keys), wait_s, wait_s=wait_s)

    def add(self, key: str, amount: int) -> int:
        return self._call("add", key, int(amount))

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        enc = [v.encode() if isinstance(v, str) else bytes(v) for v in (expected, desired)]
        return self._call("compare_set", key, *enc)

    def check(self, keys: list[str]) -> bool:
        return self._call("check", list(keys))

    def delete_key(self, key: str) -> bool:
        return self._call("delete_key", key)

    def num_keys(self) -> int:
        return self._call("num_keys")


@dataclass(frozen=True)
class RayStoreRef:
    """What a GroupSpec carries to find the run's store: the actor's handle (it travels only through Ray)."""

    actor: Any

    @property
    def key(self) -> str:
        return self.actor._actor_id.hex()

    def connect(self, timeout_s: float) -> dist.Store:
        return RayStore(self.actor, timeout_s)


class RendezvousServer:
    """The run's store: a StoreActor on the head node (else the driver's), alive while this object is."""

    def __init__(self, timeout_s: float = 300.0):
        self._actor = StoreActor.options(scheduling_strategy=home_node_strategy()).remote()
        self.address = RayStoreRef(self._actor)
        self.timeout_s = timeout_s

    @property
    def store(self) -> dist.Store:
        return self.address.connect(self.timeout_s)

    def close(self) -> None:
        ray.kill(self._actor)
