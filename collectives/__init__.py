"""Process groups over Ray actors: the Group API with gloo and nccl (CuPy) backends and a run rendezvous.

Imports nothing from `raypar` or `actors`. CuPy is optional: only asking for backend "nccl" needs it.
"""

from collectives.group import Group, GroupError, GroupInfo, GroupTimeout, Work
from collectives.host import GroupHost, create_groups, group_specs
from collectives.nccl import BackendUnavailable
from collectives.ray_store import RendezvousServer
from collectives.rendezvous import GroupSpec, StoreRef, connect_store, create_group

__all__ = [
    "BackendUnavailable",
    "Group",
    "GroupError",
    "GroupHost",
    "GroupInfo",
    "GroupSpec",
    "GroupTimeout",
    "RendezvousServer",
    "StoreRef",
    "Work",
    "connect_store",
    "create_group",
    "create_groups",
    "group_specs",
]
