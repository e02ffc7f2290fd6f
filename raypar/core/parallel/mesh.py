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

import itertools
from dataclasses import dataclass
from typing import NamedTuple


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


@dataclass(frozen=True)
class Mesh:
    dp: int
    pp: int
    tp: int
    ep: int = 1
    ring: bool = False  # interleaved pipelines: a pair group from the last stage back to the first
    cp: int = 1
    tied_embeddings: bool = False  # adds the emb groups (first and last stage) when pp > 1

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

    def groups(self, replicas: list[int] | None = None) -> dict[str, list[Coord]]:
        """Every group of the mesh, name -> members in group-rank order.

        `replicas` are the live replica ids in data-parallel rank order (default 0..dp-1): after failures
        and scaling they need not be contiguous, while names and coordinates of actors never change.
        tp: the tensor-parallel ranks of one stage of one replica.
        dp: the same (stage, tp rank) across replicas and cp ranks; gradients are averaged here (every
            parameter is replicated across cp, and each cp rank's loss is its equal share's mean).
        cp: the cp ranks of one (replica, stage, tp rank): they split every sequence.
        mp: all ranks of one replica (model parallel); the global gradient norm is summed here.
        pp: two neighbouring stages at the same tp rank (the `direct` activation transport); with `ring`,
            also the last stage and the first (members in that order).
        emb: the first and last stage at the same (tp, cp) rank, when embeddings are tied and pp > 1: the
            gradients of the two copies of the embedding are summed here (Megatron's embedding group).
        ep: (ep > 1) `ep` consecutive dp ranks at one (stage, tp rank, cp rank): tokens travel to their
            experts here; each cp rank's tokens among the same cp rank of the other replicas.
        edp: (ep > 1 and dp x cp > ep) the dp ranks holding the same experts, with their cp ranks (which
            hold the same experts too): expert gradients are summed here.
        """
        replicas = list(range(self.dp)) if replicas is None else list(replicas)
        out: dict[str, list[Coord]] = {}
        cps = range(self.cp)
        for d in replicas:
            for p in range(self.pp):
                for c in cps:
                    out[self.tp_group(Coord(d, p, 0, c))] = [Coord(d, p, t, c) for t in range(self.tp)]
                if self.cp > 1:
                    for t in range(self.tp):
                        out[self.cp_group(Coord(d, p, t))] = [Coord(d, p, t, c) for c in cps]
            replica = [Coord(d, p, t, c) for p in range(self.pp) for c in cps for t in range(self.tp)]
            out[self.mp_group(Coord(d, 0, 0))] = replica
            for t in range(self.tp):
                for c in cps:
                    for p in range(self.pp - 1):
                        out[self.pipe_group(d, t, p, cp=c)] = [Coord(d, p, t, c), Coord(d, p + 1, t, c)]
                    if self.ring and self.pp > 1:
                        last = self.pp - 1
                        pair = [Coord(d, last, t, c), Coord(d, 0, t, c)]
                        out[self.pipe_group(d, t, last, self.pp, c)] = pair
                    if self.tied_embeddings and self.pp > 1:
                        out[self.emb_group(d, t, c)] = [Coord(d, 0, t, c), Coord(d, self.pp - 1, t, c)]
        for p in range(self.pp):
            for t in range(self.tp):
                out[self.dp_group(Coord(0, p, t))] = [Coord(d, p, t, c) for d in replicas for c in cps]
                if self.ep > 1:
                    for rank, c in itertools.product(range(0, len(replicas), self.ep), cps):
                        members = [Coord(d, p, t, c) for d in replicas[rank : rank + self.ep]]
                        out[self.ep_group(members[0], rank, self.ep)] = members
                if self.ep > 1 and len(replicas) * self.cp > self.ep:
                    for j in range(self.ep):
                        members = [Coord(d, p, t, c) for d in replicas[j :: self.ep] for c in cps]
                        out[self.edp_group(members[0], j, self.ep)] = members
        return out

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
    def mp_group(coord: Coord) -> str:
        """Every rank of `coord`'s replica: the global gradient norm is summed here."""
        return f"mp.dp{coord.dp}"

    @staticmethod
    def ep_group(coord: Coord, dp_rank: int, ep: int) -> str:
        """The expert-parallel group of the actor at `coord` with data-parallel rank `dp_rank`."""
        return f"ep.pp{coord.pp}.tp{coord.tp}.g{dp_rank // ep}" + _cp(coord.cp)

    @staticmethod
    def edp_group(coord: Coord, dp_rank: int, ep: int) -> str:
        """The dp ranks holding the same experts as `coord` (dp rank `dp_rank`): expert grads meet here."""
        return f"edp.pp{coord.pp}.tp{coord.tp}.e{dp_rank % ep}"

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
        return {name: members for name, members in self.groups().items() if coord in members}


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
