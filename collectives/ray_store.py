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

import asyncio
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import ray
import torch.distributed as dist
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

# Members wait in the actor, so a `get` of a key not yet set costs one call, not a polling loop. A member
# gives up on the actor itself after the store's timeout (as a TCPStore client gives up connecting: the
# actor may still be starting, its process importing torch, on a busy node) plus this much.
_CALL_SLACK_S = 10.0


class _Keys:
    """The store's state: bytes by key, and one condition that every write notifies."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.changed = asyncio.Condition()

    async def until(self, keys: list[str], timeout_s: float) -> None:
        async with self.changed:
            try:
                await asyncio.wait_for(
                    self.changed.wait_for(lambda: all(k in self.data for k in keys)), timeout_s
                )
            except TimeoutError:
                missing = [k for k in keys if k not in self.data]
                raise TimeoutError(f"store wait timed out after {timeout_s:g}s for keys {missing}") from None

    async def put(self, items: dict[str, bytes]) -> None:
        async with self.changed:
            self.data.update(items)
            self.changed.notify_all()


# Restarted by Ray when its process dies, empty: every key is under a group's (name, epoch) prefix and used
# only while that group forms, so the driver's next re-formation (a new epoch) finds all it needs. A join
# that was waiting in the dead process is retried on the new one and times out there, like any join whose
# peers never came; the driver then re-forms under a new epoch.
@ray.remote(num_cpus=0, max_concurrency=10_000, max_restarts=-1, max_task_retries=-1)
class StoreActor:
    """c10d store semantics (set, get-with-wait, add, compare_set, ...) over one dict."""

    def __init__(self) -> None:
        self._keys = _Keys()

    async def set(self, key: str, value: bytes) -> None:
        await self._keys.put({key: value})

    async def multi_set(self, keys: list[str], values: list[bytes]) -> None:
        await self._keys.put(dict(zip(keys, values, strict=True)))

    async def get(self, key: str, timeout_s: float) -> bytes:
        await self._keys.until([key], timeout_s)
        return self._keys.data[key]

    async def multi_get(self, keys: list[str], timeout_s: float) -> list[bytes]:
        await self._keys.until(keys, timeout_s)
        return [self._keys.data[k] for k in keys]

    async def wait(self, keys: list[str], timeout_s: float) -> None:
        await self._keys.until(keys, timeout_s)

    async def add(self, key: str, amount: int) -> int:
        value = int(self._keys.data.get(key, b"0")) + amount
        await self._keys.put({key: str(value).encode()})
        return value

    async def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        # c10d semantics: set `desired` if the key holds `expected` (or is absent and `expected` is empty);
        # return the value the key holds afterwards.
        current = self._keys.data.get(key)
        if (current is None and not expected) or current == expected:
            await self._keys.put({key: desired})
            return desired
        return current if current is not None else expected

    async def check(self, keys: list[str]) -> bool:
        return all(k in self._keys.data for k in keys)

    async def delete_key(self, key: str) -> bool:
        return self._keys.data.pop(key, None) is not None

    async def num_keys(self) -> int:
        return len(self._keys.data)


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


def home_node_strategy() -> NodeAffinitySchedulingStrategy:
    """Where a run's own service actors go (this store, the control actor): the head node, which lives as long
    as the cluster, where any worker node may be lost with the training actors it holds (and the survivors
    then re-form groups through the store). A driver that shares a machine with several nodes
    (`ray.cluster_utils.Cluster`) may be attached to a worker node's raylet, so the driver's node is only
    the fallback, and a soft one."""
    for node in ray.nodes():
        if node.get("Alive") and "node:__internal_head__" in node.get("Resources", {}):
            return NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)


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
