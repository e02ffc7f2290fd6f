"""Groups inside Ray actors: a mixin for actor classes and one driver call that wires a whole mesh.

Joining a gloo/nccl group blocks until all its members join. Every member therefore joins its groups in
one global order (the order of the `groups` mapping given to `create_groups`): the earliest group not yet
complete always has all its members working on it, so overlapping groups never deadlock.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import ray

from collectives.group import Group, GroupError
from collectives.inflight import GroupState
from collectives.rendezvous import GroupSpec, StoreRef, create_group


class GroupHost:
    """Mix into a Ray actor class to let the driver form groups in it (`create_groups`)."""

    def join_groups(self, specs: Sequence[GroupSpec]) -> list[str]:
        """Join `specs` (one epoch), replacing held groups of the same names. Joining a newer epoch than a
        held group's means the membership changed and the driver lists every group of this actor anew: a
        held older group left out is destroyed (its communicator, on a GPU its memory, is released). Joins
        at the same epoch add to the held groups."""
        groups: dict[str, Group] = self.__dict__.setdefault("_raypar_groups", {})
        joined: dict[str, GroupSpec] = self.__dict__.setdefault("_raypar_specs", {})
        epoch = max((spec.epoch for spec in specs), default=-1)
        listed = {spec.name for spec in specs}
        stale = [name for name, g in groups.items() if name in listed or g.info.epoch < epoch]
        for name in stale:  # before the new ones are formed, so both never hold a GPU's memory at once
            joined.pop(name, None)
            groups.pop(name).destroy()
        host = ray.util.get_node_ip_address()  # gloo listens where Ray does, never on more
        for spec in specs:
            groups[spec.name] = create_group(spec, host=host)
            joined[spec.name] = spec
        return [spec.name for spec in specs]

    def abort_groups(self, reason: str, backend: str | None = None, epoch: int | None = None) -> None:
        """Abort the held groups (those of `backend`, of membership `epoch` or older, where given): their
        pending and later ops fail, naming `reason`. They stay held until the next join replaces them."""
        for group in list(self.__dict__.get("_raypar_groups", {}).values()):
            info = group.info
            if (backend is None or info.backend == backend) and (epoch is None or info.epoch <= epoch):
                abort = getattr(group, "abort", None)
                if abort is not None:
                    abort(reason)
                else:
                    group.destroy()

    def check_groups(self) -> None:
        """Raise GroupError if any held group's communicator failed since it was formed: NCCL ops return
        before they run, and an aborted communicator's kernels end as if they had succeeded."""
        for group in self.__dict__.get("_raypar_groups", {}).values():
            group.check()

    def collective_state(self) -> list[GroupState]:
        """Every held group's record of its ops (collectives.inflight): what a hang report merges."""
        return [group.state() for group in list(self.__dict__.get("_raypar_groups", {}).values())]

    def group_devices(self) -> dict[str, int]:
        """The device index each group of this member was formed on (NCCL: its communicator's GPU)."""
        return {name: spec.device for name, spec in self.__dict__.get("_raypar_specs", {}).items()}

    def leave_groups(self, names: Sequence[str]) -> None:
        groups: dict[str, Group] = self.__dict__.get("_raypar_groups", {})
        for name in names:
            self.__dict__.get("_raypar_specs", {}).pop(name, None)
            group = groups.pop(name, None)
            if group is not None:
                group.destroy()

    def group(self, name: str) -> Group:
        try:
            return self.__dict__["_raypar_groups"][name]
        except KeyError:
            raise GroupError(f"this actor is not a member of group {name!r}") from None


def group_specs(
    groups: Mapping[str, Sequence[str]],
    store: StoreRef,
    epoch: int = 0,
    backend: str = "gloo",
    timeout_s: float = 300.0,
    devices: Mapping[str, int] | None = None,
    duplex: Collection[str] = (),
) -> dict[str, list[GroupSpec]]:
    """member label -> the specs of its groups, in the global join order (the order of `groups`). Groups
    named in `duplex` get one NCCL communicator per direction (pipeline links)."""
    per_member: dict[str, list[GroupSpec]] = {}
    for name, members in groups.items():
        if len(set(members)) != len(members):
            raise ValueError(f"group {name!r} lists a member twice: {list(members)}")
        for rank, label in enumerate(members):
            device = (devices or {}).get(label, 0)
            spec = GroupSpec(
                name, tuple(members), rank, store, epoch, backend, timeout_s, device, name in duplex
            )
            per_member.setdefault(label, []).append(spec)
    return per_member


def create_groups(
    actors: Mapping[str, Any],
    groups: Mapping[str, Sequence[str]],
    store: StoreRef,
    epoch: int = 0,
    backend: str = "gloo",
    timeout_s: float = 300.0,
    devices: Mapping[str, int] | None = None,
    duplex: Collection[str] = (),
) -> None:
    """From the driver: form every group of `groups` (name -> member labels) in the `actors` (label ->
    handle,
    each a GroupHost), all at once. Raises GroupError naming the members that did not join in time."""
    per_member = group_specs(groups, store, epoch, backend, timeout_s, devices, duplex)
    missing = sorted(set(per_member) - set(actors))
    if missing:
        raise ValueError(f"groups name members without an actor: {missing}")
    refs = {actors[label].join_groups.remote(specs): label for label, specs in per_member.items()}
    ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s + 10)
    if pending:
        late = sorted(refs[r] for r in pending)
        raise GroupError(f"forming groups (epoch {epoch}) timed out after {timeout_s:g}s waiting for {late}")
    ray.get(ready)
