"""Rendezvous: one key-value store per run, hosted on the controller side, and group construction on it.

Members reach the store through a `StoreRef` carried in their GroupSpec (for Ray actors: the run's store
actor, collectives/ray_store.py, reachable only with the run's Ray credentials). Each group and epoch
uses
its own key prefix, so re-forming a group after a failure is just creating it again under a new epoch.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass, field
from typing import Protocol

import torch.distributed as dist

from collectives.gloo import GlooBackend
from collectives.group import Group, GroupError, GroupInfo, NoPeers
from collectives.nccl import BackendUnavailable, NcclBackend, cupy_nccl


class StoreRef(Protocol):
    """How a member finds the run's store; picklable, shipped inside GroupSpecs."""

    @property
    def key(self) -> str: ...

    def connect(self, timeout_s: float) -> dist.Store: ...


@dataclass(frozen=True)
class LocalStoreRef:
    """A store inside this process (a HashStore): for groups whose members are all here (threads, or a
    single member). No network and no Ray."""

    store: dist.Store = field(default_factory=dist.HashStore)
    key: str = field(default_factory=lambda: f"local-{uuid.uuid4().hex}")

    def connect(self, timeout_s: float) -> dist.Store:
        return self.store


# One client per store and process, shared by every group of the process. The dict also keeps Python store
# objects alive: a PrefixStore holds only the C++ side of its base store.
_clients: dict[str, dist.Store] = {}
_clients_lock = threading.Lock()


def connect_store(ref: StoreRef, timeout_s: float = 300.0) -> dist.Store:
    """A client of the run's store, shared by every group of this process."""
    with _clients_lock:
        if ref.key not in _clients:
            _clients[ref.key] = ref.connect(timeout_s)
        return _clients[ref.key]


@dataclass(frozen=True)
class GroupSpec:
    """Everything a member needs to join one group: built by the driver, shipped to the member."""

    name: str
    members: tuple[str, ...]
    rank: int
    store: StoreRef
    epoch: int = 0
    backend: str = "gloo"
    timeout_s: float = 300.0
    device: int = 0
    # NCCL: one communicator per direction (two members; the pipeline links): collectives.nccl says why
    duplex: bool = False


def create_group(spec: GroupSpec, store: dist.Store | None = None, host: str | None = None) -> Group:
    """Join the group described by `spec`; blocks until every member has joined (or the timeout passes).
    `host`: the address gloo listens on (default: what the hostname resolves to)."""
    info = GroupInfo(spec.name, spec.epoch, spec.rank, tuple(spec.members), spec.backend, spec.timeout_s)
    if spec.backend not in ("gloo", "nccl"):
        raise ValueError(f"group {spec.name!r}: backend must be 'gloo' or 'nccl', got {spec.backend!r}")
    store = store if store is not None else connect_store(spec.store, spec.timeout_s)
    prefix = f"{spec.name}/{spec.epoch}"
    try:
        if spec.backend == "nccl" and info.size == 1:  # Group answers every op of a group of one itself
            cupy_nccl()  # but a run asking for NCCL where it cannot run hears so at once
            backend = NoPeers()
        elif spec.backend == "nccl":
            backend = NcclBackend(
                store, prefix, spec.rank, info.size, spec.timeout_s, spec.device, duplex=spec.duplex
            )
        else:
            backend = GlooBackend(store, prefix, spec.rank, info.size, spec.timeout_s, host)
    except BackendUnavailable:
        raise
    except Exception as err:
        raise GroupError(f"{info.describe('join')} failed: {' '.join(str(err).split())[:300]}") from None
    return Group(info, backend)
