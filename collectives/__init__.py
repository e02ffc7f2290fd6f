"""Process groups over Ray actors: the Group API with gloo and nccl (CuPy) backends and a run rendezvous.

Imports nothing from `raypar` or `actors`, and importing it does not import Ray: the model code uses
`Group` in plain processes too. The Ray side is `collectives.host` (`GroupHost`, `create_groups`) and
`collectives.ray_store` (the run's store, `RendezvousServer`).
CuPy is optional: only asking for backend "nccl" needs it.

The names below load on first use (PEP 562), not with the package: a run's service actors import
`collectives.store_actor` alone, and a process that imports torch spends ~2 s of CPU on it (every actor is a
process of its own, so the store and the control actor would pay it at every run's start for nothing).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collectives.group import Group, GroupError, GroupInfo, GroupTimeout, Work
    from collectives.nccl import BackendUnavailable
    from collectives.rendezvous import GroupSpec, LocalStoreRef, StoreRef, connect_store, create_group

_HOMES = {
    "BackendUnavailable": "collectives.nccl",
    "Group": "collectives.group",
    "GroupError": "collectives.group",
    "GroupInfo": "collectives.group",
    "GroupSpec": "collectives.rendezvous",
    "GroupTimeout": "collectives.group",
    "LocalStoreRef": "collectives.rendezvous",
    "StoreRef": "collectives.rendezvous",
    "Work": "collectives.group",
    "connect_store": "collectives.rendezvous",
    "create_group": "collectives.rendezvous",
}
__all__ = [
    "BackendUnavailable",
    "Group",
    "GroupError",
    "GroupInfo",
    "GroupSpec",
    "GroupTimeout",
    "LocalStoreRef",
    "StoreRef",
    "Work",
    "connect_store",
    "create_group",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'collectives' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
