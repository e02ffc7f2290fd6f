"""The device mesh: rank <-> (dp, pp, tp, cp) coordinates and every communication group derived from it.

Ranks are laid out tp-fastest, then cp (rank = ((dp * pp + pp_idx) * cp + cp_idx) * tp + tp_idx), so a
tensor-parallel group is a run of consecutive ranks, and the cp x tp ranks of one stage are one run; the
placement plan packs each such run on one node, where the traffic of tensor parallelism (an all-reduce per
layer) and of context parallelism (key/value blocks or all-to-alls per layer) belongs. The cp axis is
optional everywhere: a coordinate without it is cp rank 0, and its name has no cp part. Groups are named
by what they connect so that logs, timeouts and re-formed epochs read naturally: `tp.dp0.pp1`,
`dp.pp0.tp1`, `mp.dp0`, `pp.dp0.tp0.s1-2`, `cp.dp0.pp0.tp0`.

Expert parallelism (`ep`) is not a further axis of actors: its groups are carved out of the data-parallel
ranks (see raypar.core.parallel.ep), so it changes which groups exist, not where actors are.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

G = TypeVar("G")  # a formed group (collectives.group.Group; a test's stand-in)


class Coord(NamedTuple):
    dp: int
    pp: int
    tp: int
    cp: int = 0

    @property
    def key(self) -> str:
        return f"dp{self.dp}.pp{self.pp}.tp{self.tp}" + _cp(self.cp)


def _cp(c: int) -> str:
    """The cp part of a name: none for cp rank 0, so meshes without context parallelism keep their names."""
    return f".cp{c}" if c else ""


def actor_name(run: str, coord: Coord) -> str:
    """The Ray actor name: what the dashboard, `ray list actors` and error messages show."""
    return f"raypar:{run}:{coord.key}"

AXES = ("tp", "cp", "dp", "dps", "dpr", "edp", "edpr", "ep", "mp", "emb", "pp_prev", "pp_next")


@dataclass(frozen=True)
class StageGroups:
    """One actor's groups under one membership, by axis (AXES): each group's name and members, as
    `Mesh.stage_groups` computes them. The driver forms the union of every actor's (`Mesh.groups`) and hands
    each actor its own; the actor binds them (`bind`) without deciding again which exist."""

    coord: Coord
    replicas: tuple[int, ...]  # the live replica ids in data-parallel rank order
    named: Mapping[str, tuple[str, tuple[Coord, ...]]]  # axis -> (group name, members in group-rank order)

    @property
    def dp(self) -> int:
        return len(self.replicas)

    @property
    def dp_rank(self) -> int:
        return self.replicas.index(self.coord.dp)

    def name(self, axis: str) -> str | None:
        """The group of `axis`, or None where there is none or it is this rank alone: a group of one has
        nothing to communicate, and every layer and strategy reads None as "not split on this axis"."""
        entry = self.named.get(axis)
        return entry[0] if entry is not None and len(entry[1]) > 1 else None

    def bind(self, lookup: Callable[[str], G]) -> BoundGroups[G]:
        """The formed groups by axis, `lookup` giving the group of a name (None per `name`)."""
        return BoundGroups(**{axis: None if (n := self.name(axis)) is None else lookup(n) for axis in AXES})


@dataclass(frozen=True)
class BoundGroups(Generic[G]):
    """An actor's formed groups by axis (see `Mesh.stage_groups`); None: not split on that axis here."""

    tp: G | None = None
    cp: G | None = None
    dp: G | None = None
    dps: G | None = None
    dpr: G | None = None
    edp: G | None = None
    edpr: G | None = None
    ep: G | None = None
    mp: G | None = None
    emb: G | None = None
    pp_prev: G | None = None
    pp_next: G | None = None


@dataclass(frozen=True)
class Mesh:
    dp: int
    pp: int
    tp: int
    ep: int = 1
    ring: bool = False  # interleaved pipelines: a pair group from the last stage back to the first
    cp: int = 1
    tied_embeddings: bool = False  # adds the emb groups (first and last stage) when pp > 1
    dp_shard: int = 0  # HSDP: replicas per shard group (0: all of them, no dps/dpr groups)
    experts: bool = False  # an MoE model: under HSDP the experts' copies get a group of their own (edpr)

    def __post_init__(self) -> None:
        for axis in ("dp", "pp", "tp", "ep", "cp"):
            if getattr(self, axis) < 1:
                raise ValueError(f"mesh {axis} must be >= 1, got {getattr(self, axis)}")
        if self.dp % self.ep:
            raise ValueError(f"mesh ep={self.ep} must divide dp={self.dp}")

    @property
    def replica_size(self) -> int:
        """Actors in one data-parallel replica: every (stage, cp rank, tp rank)."""
        return self.pp * self.cp * self.tp

    @property
    def world_size(self) -> int:
        return self.dp * self.replica_size

    def rank(self, coord: Coord) -> int:
        d, p, t, c = coord
        if not (0 <= d < self.dp and 0 <= p < self.pp and 0 <= t < self.tp and 0 <= c < self.cp):
            raise ValueError(f"{coord} is outside mesh dp={self.dp} pp={self.pp} tp={self.tp} cp={self.cp}")
        return ((d * self.pp + p) * self.cp + c) * self.tp + t

    def coord(self, rank: int) -> Coord:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")
        t, rest = rank % self.tp, rank // self.tp
        c, rest = rest % self.cp, rest // self.cp
        return Coord(rest // self.pp, rest % self.pp, t, c)

    def coords(self) -> list[Coord]:
        return [self.coord(r) for r in range(self.world_size)]

    def groups(self, replicas: Sequence[int] | None = None) -> dict[str, list[Coord]]:
        """Every group of the mesh, name -> members in group-rank order: the union of every actor's
        `stage_groups`, in one global order (each actor joins its groups in it, so forming them cannot
        deadlock). `replicas` as in `stage_groups`."""
        replicas = tuple(range(self.dp)) if replicas is None else tuple(replicas)
        out: dict[str, list[Coord]] = {}
        for d in replicas:
            for rank in range(self.replica_size):
                mine = self.stage_groups(self.coord(rank)._replace(dp=d), replicas)
                for name, members in mine.named.values():
                    out.setdefault(name, list(members))
        return out

    def stage_groups(self, coord: Coord, replicas: Sequence[int] | None = None) -> StageGroups:
        """The groups of the actor at `coord`, by axis: the one place that says which groups exist.

        `replicas` are the live replica ids in data-parallel rank order (default 0..dp-1): after failures
        and scaling they need not be contiguous, while names and coordinates of actors never change.
        tp: the tensor-parallel ranks of one stage of one replica (and cp rank).
        cp: (cp > 1) the cp ranks of one (replica, stage, tp rank): they split every sequence.
        dp: the same (stage, tp rank) across replicas and cp ranks; gradients are averaged here (every
            parameter is replicated across cp, and each cp rank's loss is its equal share's mean).
        edp: the dp ranks holding the same experts, with their cp ranks (which hold the same experts too):
            expert gradients are summed here. Without expert parallelism the dp group itself; with it, only
            where dp x cp > ep (else no other rank holds these experts). Under HSDP only those of the shard
            group (the experts' ZeRO state is sharded over it).
        edpr: (HSDP with experts) dpr's members again, where the experts' shards are all-reduced across the
            shard groups: the dense and the expert strategy each start theirs from a thread of their own
            during backward, and two threads' collectives on one group could interleave differently on
            each member.
        ep: (ep > 1) `ep` consecutive dp ranks at one (stage, tp rank, cp rank): tokens travel to their
            experts here; each cp rank's tokens among the same cp rank of the other replicas.
        dps, dpr: (HSDP, 1 < dp_shard < dp) the dp group split in two directions: dps the `dp_shard`
            consecutive dp ranks of one shard group with their cp ranks, over which ZeRO state is sharded
            (reduce-scatter, all-gather); dpr the ranks of equal shard index (dp rank in the group, cp rank)
            in every shard group, which hold the same shard and all-reduce it (raypar.core.dp.hsdp). Every
            replica keeps its shard index while whole shard groups come and go, so a surviving group's dps
            group never changes.
        mp: all ranks of one replica (model parallel); the global gradient norm is summed here.
        emb: the first and last stage at the same (tp, cp) rank, when embeddings are tied and pp > 1: the
            gradients of the two copies of the embedding are summed here (Megatron's embedding group).
        pp_prev, pp_next: the pair groups with the neighbouring stages at the same (tp, cp) rank (the
            `direct` activation transport); with `ring`, the last stage and the first are neighbours too
            (members in that order).
        """
        replicas = tuple(range(self.dp)) if replicas is None else tuple(replicas)
        d, p, t, c = coord
        dp_rank = replicas.index(d)
        cps = range(self.cp)
        named: dict[str, tuple[str, tuple[Coord, ...]]] = {
            "tp": (self.tp_group(coord), tuple(Coord(d, p, r, c) for r in range(self.tp)))
        }
        if self.cp > 1:
            named["cp"] = (self.cp_group(coord), tuple(Coord(d, p, t, r) for r in cps))
        named["dp"] = (self.dp_group(coord), tuple(Coord(r, p, t, k) for r in replicas for k in cps))
        s = self.dp_shard
        hsdp = bool(s and s < len(replicas))
        shard, shard_group = replicas, None  # where ZeRO shards: the dp group, or (HSDP) a shard group
        if hsdp:
            if len(replicas) % s:
                raise ValueError(f"{len(replicas)} replicas do not split into shard groups of dp_shard={s}")
            shard_group, index = divmod(dp_rank, s)
            shard = replicas[shard_group * s : shard_group * s + s]
            # with cp, a shard group's cp ranks shard with it (they reduce the same gradients, as in dp)
            members = tuple(Coord(r, p, t, k) for r in shard for k in cps)
            named["dps"] = (self.dps_group(coord, shard_group), members)
            copies = tuple(Coord(r, p, t, c) for r in replicas[index::s])  # equal place in their shard groups
            named["dpr"] = (self.dpr_group(coord, index), copies)
            if self.experts:  # the experts' chains run beside the dense ones: one group each, no interleaving
                named["edpr"] = (self.edpr_group(coord, index), copies)
        if self.ep == 1:
            named["edp"] = named["dps"] if hsdp else named["dp"]
        else:
            group = dp_rank // self.ep * self.ep
            members = tuple(Coord(r, p, t, c) for r in replicas[group : group + self.ep])
            named["ep"] = (self.ep_group(coord, dp_rank, self.ep), members)
            # Under HSDP (ep divides dp_shard: EP groups lie inside shard groups) only the holders in this
            # shard group: the experts' state is sharded there too, and its copies are at this rank's place
            # in the other shard groups (edpr: the same experts, the same piece of them).
            if len(shard) * self.cp > self.ep:
                holders = shard[shard.index(d) % self.ep :: self.ep]
                members = tuple(Coord(r, p, t, k) for r in holders for k in cps)
                named["edp"] = (self.edp_group(coord, dp_rank, self.ep, shard_group), members)
        replica = tuple(Coord(d, s, r, k) for s in range(self.pp) for k in cps for r in range(self.tp))
        named["mp"] = (self.mp_group(coord), replica)
        if self.pp > 1:
            last = self.pp - 1
            if self.tied_embeddings and p in (0, last):
                named["emb"] = (self.emb_group(d, t, c), (Coord(d, 0, t, c), Coord(d, last, t, c)))
            ring = self.pp if self.ring else 0
            if p > 0 or self.ring:
                prev = (p - 1) % self.pp
                pair = (Coord(d, prev, t, c), coord)
                named["pp_prev"] = (self.pipe_group(d, t, prev, ring, c), pair)
            if p < last or self.ring:
                pair = (coord, Coord(d, (p + 1) % self.pp, t, c))
                named["pp_next"] = (self.pipe_group(d, t, p, ring, c), pair)
        return StageGroups(coord, replicas, named)

    # Group names: the only place they are spelled. An actor finds its groups by these, the driver forms them.
    @staticmethod
    def tp_group(coord: Coord) -> str:
        """The tensor-parallel ranks of `coord`'s stage (and cp rank) in its replica."""
        return f"tp.dp{coord.dp}.pp{coord.pp}" + _cp(coord.cp)

    @staticmethod
    def cp_group(coord: Coord) -> str:
        """The context-parallel ranks of `coord`'s (stage, tp rank) in its replica."""
        return f"cp.dp{coord.dp}.pp{coord.pp}.tp{coord.tp}"

    @staticmethod
    def dp_group(coord: Coord) -> str:
        """The replicas and cp ranks of `coord`'s (stage, tp rank): gradients are reduced here."""
        return f"dp.pp{coord.pp}.tp{coord.tp}"

    @staticmethod
    def dps_group(coord: Coord, group: int) -> str:
        """Shard group `group` (HSDP) at `coord`'s (stage, tp rank): ZeRO state is sharded over it."""
        return f"dps.pp{coord.pp}.tp{coord.tp}.g{group}"

    @staticmethod
    def dpr_group(coord: Coord, index: int) -> str:
        """The replicas of shard index `index` (HSDP) at `coord`'s (stage, tp rank, cp rank): they hold one
        shard."""
        return f"dpr.pp{coord.pp}.tp{coord.tp}.s{index}" + _cp(coord.cp)

    @staticmethod
    def edpr_group(coord: Coord, index: int) -> str:
        """The dpr group's members (HSDP) as the group the experts' shards meet in across shard groups."""
        return f"edpr.pp{coord.pp}.tp{coord.tp}.s{index}" + _cp(coord.cp)

    @staticmethod
    def mp_group(coord: Coord) -> str:
        """Every rank of `coord`'s replica: the global gradient norm is summed here."""
        return f"mp.dp{coord.dp}"

    @staticmethod
    def ep_group(coord: Coord, dp_rank: int, ep: int) -> str:
        """The expert-parallel group of the actor at `coord` with data-parallel rank `dp_rank`."""
        return f"ep.pp{coord.pp}.tp{coord.tp}.g{dp_rank // ep}" + _cp(coord.cp)

    @staticmethod
    def edp_group(coord: Coord, dp_rank: int, ep: int, shard_group: int | None = None) -> str:
        """The dp ranks holding the same experts as `coord` (dp rank `dp_rank`), under HSDP those of its
        shard group `shard_group`: expert grads meet here."""
        within = "" if shard_group is None else f".g{shard_group}"
        return f"edp.pp{coord.pp}.tp{coord.tp}.e{dp_rank % ep}{within}"

    @staticmethod
    def pipe_group(dp: int, tp: int, stage: int, n_stages: int = 0, cp: int = 0) -> str:
        """The pair group between `stage` and the next stage at one (dp, tp, cp). Given `n_stages`, stages
        count around the ring: stage n_stages - 1 (or -1) names the link from the last stage to stage 0."""
        nxt = stage + 1
        if n_stages:
            stage %= n_stages
            nxt = (stage + 1) % n_stages
        return f"pp.dp{dp}.tp{tp}{_cp(cp)}.s{stage}-{nxt}"

    @staticmethod
    def is_pipe_link(name: str) -> bool:
        """Whether group `name` is a pipeline link: messages go both ways on it independently (NCCL gives it
        a communicator per direction, collectives.nccl)."""
        return name.startswith("pp.")

    @staticmethod
    def emb_group(dp: int, tp: int, cp: int = 0) -> str:
        """The first and last stage at one (dp, tp, cp): the two copies of a tied embedding (pp > 1)."""
        return f"emb.dp{dp}.tp{tp}{_cp(cp)}"

    def groups_of(self, coord: Coord) -> dict[str, list[Coord]]:
        return {name: list(members) for name, members in self.stage_groups(coord).named.values()}


def stage_layers(n_layers: int, pp: int, explicit: list[int] | None = None) -> list[range]:
    """Layer index ranges per pipeline stage: explicit counts, or an even split (earlier stages get the
    remainder, since the last stage also carries the output head and loss)."""
    counts = (
        list(explicit) if explicit else [n_layers // pp + (1 if s < n_layers % pp else 0) for s in range(pp)]
    )
    if sum(counts) != n_layers or len(counts) != pp or min(counts) < 1:
        raise ValueError(f"stage layer counts {counts} do not split {n_layers} layers into {pp} stages")
    starts = [sum(counts[:s]) for s in range(pp)]
    return [range(a, a + n) for a, n in zip(starts, counts, strict=True)]
