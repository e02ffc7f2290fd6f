"""The run's rendezvous store, the actor's side (`collectives.ray_store` has the members' and the driver's).

Without torch: the actor is a process of its own, started at every run's start and at every restart of its
process, and importing torch would cost it ~2 s of CPU for a dict of bytes.
"""

from __future__ import annotations

import asyncio

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


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
