"""Process groups over Ray actors: the Group API with gloo and nccl (CuPy) backends and a run rendezvous.

Imports nothing from `raypar` or `actors`, and importing it does not import Ray: the model code uses
`Group` in plain processes too. The Ray side is `collectives.host` (`GroupHost`, `create_groups`) and
`collectives.ray_store` (the run's store, `RendezvousServer`).
CuPy is optional: only asking for backend "nccl" needs it.
"""

from collectives.group import Group, GroupError, GroupInfo, GroupTimeout, Work
from collectives.nccl import BackendUnavailable
from collectives.rendezvous import GroupSpec, LocalStoreRef, StoreRef, connect_store, create_group

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
