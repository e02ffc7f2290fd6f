"""Rendezvous: one key-value store per run, hosted on the controller side, and group construction on it.

The store is a `torch.distributed.TCPStore` served from the driver process. Members connect as clients;
each group and epoch uses its own key prefix, so re-forming a group after a failure is just creating it
again under a new epoch.
"""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from collectives.gloo import GlooBackend
from collectives.group import Group, GroupError, GroupInfo
from collectives.nccl import BackendUnavailable, NcclBackend


@dataclass(frozen=True)
class StoreAddress:
    host: str
    port: int


class RendezvousServer:
    """The run's store, served from this process (the controller) for as long as this object lives."""

    def __init__(self, host: str | None = None, timeout_s: float = 300.0):
        self.host = host or _node_ip()
        self._store = dist.TCPStore(
            self.host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
        )
        self.address = StoreAddress(self.host, self._store.port)

    @property
    def store(self) -> dist.Store:
        return self._store


def _node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return socket.gethostbyname(socket.gethostname())


_clients: dict[StoreAddress, dist.Store] = {}
_clients_lock = threading.Lock()


def connect_store(address: StoreAddress, timeout_s: float = 300.0) -> dist.Store:
    """A client of the run's store, shared by every group of this process."""
    with _clients_lock:
        if address not in _clients:
            _clients[address] = dist.TCPStore(
                address.host, address.port, is_master=False, timeout=timedelta(seconds=timeout_s)
            )
        return _clients[address]


@dataclass(frozen=True)
class GroupSpec:
    """Everything a member needs to join one group: built by the driver, shipped to the member."""

    name: str
    members: tuple[str, ...]
    rank: int
    store: StoreAddress
    epoch: int = 0
    backend: str = "gloo"
    timeout_s: float = 300.0
    device: int = 0


def create_group(spec: GroupSpec, store: dist.Store | None = None) -> Group:
    """Join the group described by `spec`; blocks until every member has joined (or the timeout passes)."""
    info = GroupInfo(spec.name, spec.epoch, spec.rank, tuple(spec.members), spec.backend, spec.timeout_s)
    if spec.backend not in ("gloo", "nccl"):
        raise ValueError(f"group {spec.name!r}: backend must be 'gloo' or 'nccl', got {spec.backend!r}")
    store = store if store is not None else connect_store(spec.store, spec.timeout_s)
    prefix = f"{spec.name}/{spec.epoch}"
    try:
        if spec.backend == "nccl":
            backend = NcclBackend(store, prefix, spec.rank, info.size, spec.timeout_s, spec.device)
        else:
            backend = GlooBackend(store, prefix, spec.rank, info.size, spec.timeout_s)
    except BackendUnavailable:
        raise
    except Exception as err:
        raise GroupError(f"{info.describe('join')} failed: {' '.join(str(err).split())[:300]}") from None
    return Group(info, backend)
