"""Process groups over Ray actors: the Group API with gloo and nccl (CuPy) backends and a run rendezvous.

Imports nothing from `raypar` or `raypar.actors`, and importing it does not import Ray: the model code uses
`Group` in plain processes too. The Ray side is `raypar.collectives.host` (`GroupHost`, `create_groups`) and
`raypar.collectives.ray_store` (the run's store, `RendezvousServer`).
CuPy is optional: only asking for backend "nccl" needs it.
"""

from raypar.collectives.group import Group, GroupError, GroupInfo, GroupTimeout, Work
from raypar.collectives.nccl import BackendUnavailable
from raypar.collectives.rendezvous import GroupSpec, LocalStoreRef, StoreRef, connect_store, create_group

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
