"""A worker's two DP strategies (raypar.core.dp.strategy): one for the dense parameters, one for the experts'.

`WorkerStrategies` is the part of an `actors.worker.Worker` (`Worker.strategies`) that builds them for the
groups of each membership and carries the optimizer state over from the ones before: from the stash of a
planned dp change, read locally where nothing is sharded, or each rank's owned pieces where the shard group
stays as it was (HSDP's survivors). The worker hands it what it builds on: the config, model and parameter
dtype (`set_up`), the groups (`rebuild`). Iterating over it gives both strategies, dense first.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from actors.worker_state import WorkerState
from raypar.core.config.schema import Config
from raypar.core.dp import compress
from raypar.core.dp.precision import DTYPES
from raypar.core.dp.strategies import STRATEGIES
from raypar.core.dp.strategy import DPStrategy, StrategySpec
from raypar.core.model.moe import is_expert_param
from raypar.core.model.stage import Stage
from raypar.core.parallel.mesh import BoundGroups, Coord


class WorkerStrategies:
    """The dense and expert strategies of the worker at `coord`. Tests override the seams `_make_dense`,
    `_make_experts` and `_expert_class` (the worker's `strategies_class` picks the class)."""

    def __init__(self, coord: Coord):
        self.coord = coord
        self.dense: DPStrategy | None = None  # dense parameters
        self.experts: DPStrategy | None = None  # expert parameters (an empty one without MoE)
        self._shard_members: tuple[Coord, ...] | None = None  # whom the dense ZeRO state is sharded over
        self.cfg: Config | None = None
        self.model: Stage | None = None
        self.param_dtype: Any = None

    def __iter__(self) -> Iterator[DPStrategy]:
        return iter((self.dense, self.experts))

    @property
    def step_count(self) -> int:
        """Updates applied (both strategies count the same)."""
        return self.dense.step_count

    def set_up(self, cfg: Config, model: Stage, param_dtype: Any) -> None:
        """A model built afresh from the seed: no strategies yet (its state comes from the seed or a load).
        `param_dtype`: the parameters' (the strategies keep fp32 masters for 16-bit ones)."""
        self.cfg, self.model, self.param_dtype = cfg, model, param_dtype
        self.dense, self.experts, self._shard_members = None, None, None

    def rebuild(
        self, groups: BoundGroups[Any], shard_members: tuple[Coord, ...], dp: int, state: WorkerState
    ) -> None:
        """New strategies over `groups` (HSDP: ZeRO shards over the shard group, copies meet in the replicate
        group), the old ones' hooks going with them. `shard_members`: whom the dense state is sharded over;
        `dp`: the replicas; `state`: the worker's state keeper (the stash of a dp change, the whole state)."""
        kept = shard_members == self._shard_members  # this replica keeps its shard (HSDP: survivors)
        self._shard_members = shard_members
        stash = state.stashed()
        full, step_count = stash if stash is not None else (None, 0)
        owned = None
        old = self.dense
        if full is None and old is not None and old.sharded and kept:
            owned = [s.owned_state() for s in self]
            step_count = old.step_count
        elif full is None and old is not None:
            if old.sharded:
                raise RuntimeError(
                    f"parallel.zero={self.cfg.parallel.zero}: this replica's optimizer slices were sharded "
                    "over a group that changed without a stash; restore from a checkpoint"
                )
            full, step_count = state.full_state(), old.step_count
        if old is not None:
            for strategy in self:
                strategy.close()
        self.dense = self._make_dense(groups.dps or groups.dp, groups.dpr)
        self.experts = self._make_experts(groups.edp, groups.edpr, dp)
        state.use_strategies(self.dense, self.experts)
        tied = self.model.tied_weight()
        if tied is not None:  # its bucket waits for the tied gradients' sum (actors.worker_step)
            self.dense.hold({n for n, p in self.model.named_parameters() if p is tied})
        if full is not None:
            for strategy in self:
                strategy.load_full_state(full, step_count)
        if owned is not None:  # gathers the parameters in the shard group
            for strategy, mine in zip(self, owned, strict=True):
                strategy.load_owned_state(mine, step_count)

    def _spec(self, **kwargs: Any) -> StrategySpec:
        par, train = self.cfg.parallel, self.cfg.train
        return StrategySpec(
            train, int(par.bucket_mb * 2**20), self.coord.tp, dtype=self.param_dtype,
            reduce_dtype=DTYPES[train.reduce_dtype], **kwargs,
        )

    def _make_dense(self, dp_group: Any, replicate: Any) -> DPStrategy:
        """Every non-expert parameter: averaged over the data-parallel group, ZeRO as configured."""
        par = self.cfg.parallel
        spec = self._spec(select=lambda name: not is_expert_param(name), host_threads=par.threads_per_actor)
        # dense gradients only: expert gradients are reduced over their own, smaller groups
        return STRATEGIES[par.zero](
            self.model, spec=spec, group=dp_group, compressor=compress.build(par, self.cfg.train.seed),
            replicate=replicate,
        )

    def _make_experts(self, edp_group: Any, replicate: Any, dp: int) -> DPStrategy:
        """Expert parameters: summed over the expert-dp group, divided by dp x cp (raypar.core.parallel.ep
        says why); sharded over that group under ZeRO, at stage 3 the experts themselves too (gathered
        around their block). Under HSDP the expert-dp group is the holders within the shard group, their
        copies meet in `replicate` (raypar.core.parallel.mesh)."""
        spec = self._spec(select=is_expert_param, divisor=dp * self.cfg.parallel.cp)
        return self._expert_class()(self.model, spec=spec, group=edp_group, replicate=replicate)

    def _expert_class(self) -> type[DPStrategy]:
        """The experts' strategy class (a seam: a test swaps in a broken ZeRO-3 one)."""
        return STRATEGIES[self.cfg.parallel.zero]
