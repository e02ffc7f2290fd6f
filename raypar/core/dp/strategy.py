"""The data-parallel strategy: one object owns gradients, their reduction, optimizer state and the update.

`STRATEGIES[zero](model, spec=StrategySpec(train_cfg, ...), group=dp_group, compressor=...)` (the class of a
ZeRO stage, `raypar.core.dp.strategies`) takes over a stage shard's parameters:

- **Flat buffers.** Parameters and gradients live as views into per-bucket flat buffers
  (`raypar.core.dp.flat`), so reducing a bucket reads and writes the gradients themselves: no copy in or out.
- **Reduction** starts bucket by bucket during the last op that accumulates each parameter's gradient
  (`arm(params)` right before it: a model chunk's last backward or backward_weight; `disarm()` at the start
  of a step; `finish()` after the last): a post-accumulate-grad hook collects each bucket's final gradients,
  and a bucket spanning chunks launches once all of them are in. `hold(names)` keeps the buckets of some
  parameters for `finish` (a tied embedding's copies are summed across stages first).
- **ZeRO stage** (the class's `stage`, a `raypar.core.config.options.ZeroStage`; the code reads its flags,
  never its number): 0 (`DPStrategy`) all-reduces gradients and updates everything on every replica; 1
  (`Zero1`) shards the fp32 master weights and Adam moments over the DP group (each rank updates its piece
  of every bucket, then the buckets' parameters are all-gathered); 2 (`Zero2`) also reduce-scatters
  gradients straight into the owned piece, freeing the full gradient buffers as soon as they are reduced;
  3 (`raypar.core.dp.zero3`) also shards the parameters themselves. With context parallelism the DP group
  is the cp x dp ranks of a (stage, tp rank) (raypar.core.parallel.mesh): parameters are replicated there
  too, so every stage shards over it.
- **Master weights.** Parameters in fp32 below stage 3 are their own master (the owned piece is a view of
  the parameter buffer); otherwise a separate fp32 master holds the owned piece and the update is cast
  back. This is the one place master weights live.
- **CPU offload** (`train.offload = "cpu"`, stage >= 1): masters (always separate then) and moments live in
  host memory and the update runs there (`raypar.core.dp.offload`: gradients D2H, AdamW on the host,
  masters H2D into the owned parameter range before the all-gather).
- **Grad norm** (`grad_sq_norm`): this (stage, tp rank) coordinate's part, summed over the DP group
  when shards are split; tp-replicated parameters count on tp rank 0 only, a tied embedding's copy on the
  last stage (`model.tied_copy`) nowhere: the first stage's counts it. That copy is not checkpointed
  either, and loads from the tensor it is a copy of (`model.init_source`).
- **State.** `checkpoint_parts` names the rectangles this rank owns (each rank writes only those; at
  stage 0 replica 0 writes everything); `load` reads this rank's part of any checkpoint; `full_state` /
  `load_full_state` move the whole state across a change of dp (re-sharding) and heal new replicas
  (all in the `DPState` mixin, raypar.core.dp.state).
- **Selection.** `select(name)` takes part of the parameters only: a stage's expert parameters and its
  dense ones have different groups and divisors (raypar.core.parallel.ep), so each part gets a strategy of
  its own. With `divisor`, gradients are summed over the group and divided by it (expert gradients are
  divided by the full dp degree, not by their group's size) instead of averaged.
- **Compression** (`compressor`, `raypar.core.dp.compress`, a constructor argument): from its start
  step, each bucket's reduction is compressed (bf16, top-k or PowerSGD), run synchronously in `finish`.
  Its per-rank state (residuals, PowerSGD factors) is checkpointed by every rank with a leading dp
  dimension, and reset by a load at another dp and by `load_full_state` (`raypar.core.dp.compress` says why).
- **`close()`** removes every hook, so a rebind leaves nothing of the old strategy attached.

AdamW is torch's own functional implementation (`raypar.core.dp.optim.adamw_`), applied to the owned pieces:
elementwise, so sharding changes nothing of its arithmetic.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from collectives import Group, Work
from raypar.core.config.options import CPU_OFFLOAD, ZERO_STAGES, ZeroStage
from raypar.core.config.schema import TrainConfig
from raypar.core.dp import hsdp
from raypar.core.dp.compress import Compressor, Deferred
from raypar.core.dp.flat import Bucket, FlatLayout, Piece, Run, Slot
from raypar.core.dp.offload import HostUpdate, Transfer, host_zeros
from raypar.core.dp.optim import adamw_
from raypar.core.dp.state import MOMENTS, DPState


class StageModel(Protocol):
    """What a strategy needs of the model: named parameters and where each sits in its global tensor."""

    def named_parameters(self) -> Any: ...

    def shard_specs(self) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]: ...

    def replicated(self, name: str) -> bool: ...


@dataclass(frozen=True)
class StrategySpec:
    """How a strategy treats the parameters it owns (whatever its ZeRO stage).

    `select`: the parameters this strategy owns (default: all). `divisor`: sum gradients over the group and
    divide by this instead of averaging. `dtype`: the parameters' dtype from now on (default: theirs; fp32
    masters are taken from their values before any rounding). `reduce_dtype`: the dtype gradients are
    summed in across the group (default: theirs); 16-bit gradients reduced in fp32 stay fp32 up to the
    update. `host_threads`: the threads of the host update under CPU offload."""

    train: TrainConfig
    bucket_bytes: int = 25 * 2**20
    tp_rank: int = 0
    dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    select: Callable[[str], bool] | None = None
    divisor: int | None = None
    host_threads: int = 1


class DPStrategy(DPState):
    """Plain data parallelism (ZeRO-0), and the machinery every stage shares: a subclass names its
    `stage` (`raypar.core.dp.strategies` maps `parallel.zero` to the class)."""

    stage: ClassVar[ZeroStage] = ZERO_STAGES[0]
    reduce_op = "avg"  # over the DP group; a test subclass sums instead (a negative control)

    def __init__(
        self,
        model: StageModel,
        *,
        spec: StrategySpec,
        group: Group | None = None,
        compressor: Compressor | None = None,
        replicate: Group | None = None,
    ) -> None:
        """`group`: the DP group (None or size 1: no reduction), under HSDP the shard group, with
        `replicate` the group holding copies of this rank's shard (raypar.core.dp.hsdp). `compressor`:
        compresses the reduction from its start step (None: never)."""
        cfg, select, bucket_bytes = spec.train, spec.select, spec.bucket_bytes
        self.cfg, self.tp_rank, self.compressor = cfg, spec.tp_rank, compressor
        self.group = group if group is not None and group.size > 1 else None
        self.size = self.group.size if self.group else 1
        self.rank = self.group.rank if self.group else 0
        self.replicate = replicate if replicate is not None and replicate.size > 1 else None
        shards = self.stage.shards_optimizer
        self.sharded = shards and self.size > 1
        self.divisor = spec.divisor
        if spec.divisor is not None:
            self.reduce_op = "sum"
        every = list(model.named_parameters())
        named = [(n, p) for n, p in every if p.requires_grad and (select is None or select(n))]
        # A plain module (no placement methods) holds every parameter whole, none tp-replicated.
        self.specs = model.shard_specs() if hasattr(model, "shard_specs") else {
            n: (tuple(p.shape), (0,) * p.ndim) for n, p in named
        }
        self.replicated = getattr(model, "replicated", lambda name: False)
        self.tied_copy = getattr(model, "tied_copy", lambda name: False)
        self.source = getattr(model, "init_source", lambda name: name)
        self.layout = FlatLayout(
            named, self.size if shards else 1, self.rank if shards else 0, bucket_bytes,
            self._bucket_groups(model, {n for n, _ in named}),
        )
        self._decayed = [p for p in self.layout.pieces if len(p.slot.shape) >= 2]  # AdamW decays matrices
        dtypes = {p.dtype for _, p in named}
        if len(dtypes) > 1:
            raise ValueError(f"parameters of one stage must share a dtype, got {sorted(map(str, dtypes))}")
        self.dtype = spec.dtype or (dtypes.pop() if dtypes else torch.float32)
        self.rdtype = spec.reduce_dtype or self.dtype
        # an empty selection (a stage without experts) still answers on the stage's device
        self.device = every[0][1].device if every else torch.device("cpu")
        owned = self.layout.owned_numel
        offload = cfg.offload == CPU_OFFLOAD and shards
        self.offload = HostUpdate(owned, self.device, spec.host_threads) if offload else None
        self._bucket_updates = [  # offloaded: each bucket's run (one at most) and decayed pieces
            ([r for r in self.layout.runs if r.bucket == b], [p for p in self._decayed if p.bucket == b])
            for b in range(len(self.layout.buckets) if offload else 0)
        ]
        # offloaded, the master is a host tensor of its own even for fp32 parameters on the CPU
        self.master_is_param = (
            self.dtype == torch.float32 and not self.stage.shards_parameters and self.offload is None
        )
        self.owned_params: torch.Tensor | None = None  # ZeRO-3 offloaded: the device copy of the owned piece
        self.step_count = 0
        self.traffic = {"reduce_bytes": 0, "gather_bytes": 0}
        self._armed: set[int] = set()  # ids of the parameters whose next gradient is final
        self._held: set[int] = set()  # buckets that only `finish` reduces
        self.master_grads: torch.Tensor | None = None  # fp32 copies, when the reduced grads are 16-bit
        with torch.no_grad():
            self.master = None if self.master_is_param else self._optim_zeros(owned)
            if self.master is not None:  # from the values as they are, before the buckets round them
                for piece in self.layout.pieces:
                    if _materialized(piece.slot.param):
                        flat = piece.slot.param.data.reshape(-1)[piece.lo : piece.hi]
                        self._master(piece).copy_(flat)
            for bucket in self.layout.buckets:
                bucket.params = torch.zeros(bucket.padded, dtype=self.dtype, device=self.device)
                for slot in bucket.slots:
                    view = self.layout.view(bucket.params, slot)
                    if _materialized(slot.param):  # else freed by a ZeRO-3 strategy: load_full_state fills it
                        view.copy_(slot.param.data)
                    slot.param.data = view
        self.moments = {m: self._optim_zeros(owned) for m in MOMENTS}
        scatters = self.stage.reduce_scatters
        self.owned_grads = torch.zeros(owned, dtype=self.rdtype, device=self.device) if scatters else None
        # Gradients persist between steps (zeroed, not freed) unless a reduction leaves a copy of its own:
        # the owned piece (stage >= 2) or a cast copy (another reduction dtype).
        self._free_after_reduce = scatters or self.rdtype != self.dtype
        if not self._free_after_reduce:
            self._allocate_grads()
        # HSDP: starts each bucket's all-reduce across the shard groups after its reduce-scatter
        self.across = hsdp.AcrossGroups(self.device) if self.replicate is not None else None
        self._handles = [
            slot.param.register_post_accumulate_grad_hook(functools.partial(self._on_grad, slot))
            for slot in self.layout.slots.values()
        ]

    def _bucket_groups(self, model: StageModel, selected: set[str]) -> list[list[str]] | None:
        return None  # buckets by size; ZeRO-3 buckets by block

    def _optim_zeros(self, numel: int) -> torch.Tensor:
        """fp32 zeros for master weights or a moment: in host memory when offloaded."""
        return host_zeros(numel, self.device) if self.offload else torch.zeros(numel, device=self.device)

    # -- views -------------------------------------------------------------------------------------
    def _bucket_piece(self, which: str, piece: Piece | Run) -> torch.Tensor:
        return self.layout.piece_of_bucket(getattr(self.layout.buckets[piece.bucket], which), piece)

    def _master(self, piece: Piece | Run) -> torch.Tensor:
        """The fp32 master values of `piece` (a view of the parameters themselves when they are fp32)."""
        if self.master is None:
            return self._bucket_piece("params", piece)
        return self.master[piece.pos : piece.pos + piece.numel]

    def _grad(self, piece: Piece | Run) -> torch.Tensor:
        """The reduced gradient of `piece`, in the reduction dtype."""
        if self.owned_grads is not None:
            return self.owned_grads[piece.pos : piece.pos + piece.numel]
        bucket = self.layout.buckets[piece.bucket]
        return self.layout.piece_of_bucket(bucket.grads if bucket.reduced is None else bucket.reduced, piece)

    def _mgrad(self, piece: Piece | Run) -> torch.Tensor:
        """The gradient the norm, clipping and the update read: fp32 after `unscale_`."""
        if self.master_grads is not None:
            return self.master_grads[piece.pos : piece.pos + piece.numel]
        return self._grad(piece)

    def _moment(self, moment: str, piece: Piece | Run) -> torch.Tensor:
        return self.moments[moment][piece.pos : piece.pos + piece.numel]

    def _counted(self, piece: Piece) -> bool:
        name = piece.slot.name
        return (self.tp_rank == 0 or not self.replicated(name)) and not self.tied_copy(name)

    # -- gradients -----------------------------------------------------------------------------------
    def _allocate_grads(self) -> None:
        for bucket in self.layout.buckets:
            bucket.grads = torch.zeros(bucket.padded, dtype=self.dtype, device=self.device)
            for slot in bucket.slots:
                slot.param.grad = self.layout.view(bucket.grads, slot)

    def _free_grads(self) -> None:
        for bucket in self.layout.buckets:
            bucket.grads = None
            for slot in bucket.slots:
                slot.param.grad = None

    def begin_step(self) -> None:
        """Before the first backward of a step: the gradient buffers exist."""
        if self.layout.buckets and self.layout.buckets[0].grads is None:
            self._allocate_grads()

    def take_traffic(self) -> dict[str, int]:
        """Bytes this rank sent for DP since the last call: gradient reduction, parameter gathers."""
        out, self.traffic = self.traffic, dict.fromkeys(self.traffic, 0)
        return out

    def hold(self, names: set[str]) -> None:
        """The buckets holding any of `names` are reduced by `finish` only, not as their gradients become
        final: the caller changes those gradients in between (a tied embedding's, summed across stages)."""
        self._held = {s.bucket for s in self.layout.slots.values() if s.name in names}

    def disarm(self) -> None:
        """At the start of a step: forget the previous (or a failed) step's readiness and reductions."""
        self._armed.clear()
        for bucket in self.layout.buckets:
            bucket.ready, bucket.work = 0, None
            bucket.final.clear()

    def arm(self, params: list[nn.Parameter] | None = None) -> None:
        """Right before the last op that accumulates gradients into `params` (default: all of this
        strategy's): from then on their gradients are final, and a bucket whose gradients are all final
        starts its reduction. Parameters of other strategies are ignored."""
        slots = self.layout.slots.values()
        self._armed |= {id(s.param) for s in slots} if params is None else {id(p) for p in params}

    def _on_grad(self, slot: Slot, param: nn.Parameter) -> None:
        bucket = self.layout.buckets[slot.bucket]
        if id(param) in self._armed:
            bucket.final.add(id(param))
            complete = len(bucket.final) == len(bucket.slots)
            if complete and bucket.work is None and slot.bucket not in self._held:
                bucket.work = self._reduce(bucket)
        bucket.ready += 1
        if bucket.ready == len(bucket.slots):
            bucket.ready = 0
            self._bucket_done(bucket)

    def _bucket_done(self, bucket: Bucket) -> None:
        """Every gradient of `bucket` accumulated once more (final or not): ZeRO-3 frees its parameters."""

    def _reduce(self, bucket: Bucket) -> Work | Deferred | hsdp.ChainedReduction | None:
        if self.group is not None and self.compressor is not None and self.compressor.active(self.step_count):
            return Deferred(functools.partial(self._compressed_reduce, bucket))
        b = self.size
        # The gradients themselves, or (another reduction dtype) one cast copy of them.
        src = bucket.grads if self.rdtype == self.dtype else bucket.grads.to(self.rdtype)
        if self.replicate is not None:
            return hsdp.reduce_bucket(self, bucket, src)
        if self.owned_grads is None:
            bucket.reduced = None if src is bucket.grads else src
            if self.group is None:
                return None
            self.traffic["reduce_bytes"] += 2 * bucket.padded * (b - 1) // b * src.element_size()
            return self.group.all_reduce(src, self.reduce_op, async_op=True)
        out = self.owned_grads[bucket.own_offset : bucket.own_offset + bucket.piece]
        if self.group is None:
            out.copy_(src)
            return None
        self.traffic["reduce_bytes"] += bucket.piece * (b - 1) * src.element_size()
        return self.group.reduce_scatter(src, self.reduce_op, async_op=True, out=out)

    def reduce_across_groups(self, owned: torch.Tensor) -> Work | None:
        """HSDP: start reducing the owned piece of a bucket's gradients, reduced in the shard group, over the
        copies of this shard in the other shard groups (a test subclass skips it: a negative control)."""
        return self.replicate.all_reduce(owned, self.reduce_op, async_op=True)

    def _compressed_reduce(self, bucket: Bucket) -> None:
        """`_reduce` through the compressor, run when `finish` waits for it. State is keyed by source name,
        so a tied copy compresses exactly as the tensor it copies."""
        src = bucket.grads if self.rdtype == self.dtype else bucket.grads.to(self.rdtype)
        if self.replicate is not None:
            self.traffic["reduce_bytes"] += hsdp.compressed_reduce(self, bucket, src)
            return
        if self.owned_grads is None:
            bucket.reduced = None if src is bucket.grads else src
            slots = [dataclasses.replace(s, name=self.source(s.name)) for s in bucket.slots]
            sent = self.compressor.all_reduce(self.group, src, slots, self.reduce_op)
        else:
            out = self.owned_grads[bucket.own_offset : bucket.own_offset + bucket.piece]
            sent = self.compressor.reduce_scatter(self.group, src, out, self.reduce_op)
        self.traffic["reduce_bytes"] += sent

    def finish(self) -> None:
        """After the last backward: every bucket reduced (launching any not yet started). From stage 2 on
        (or when reduced in another dtype) the full gradients are freed here: only the reduction's result
        outlives it."""
        for bucket in self.layout.buckets:
            if bucket.work is None:  # its hook never completed (a parameter without a gradient)
                bucket.work = self._reduce(bucket)
        for bucket in self.layout.buckets:
            if bucket.work is not None:
                bucket.work.wait()
                bucket.work = None
        if self.divisor not in (None, 1):
            for run in self.layout.runs:
                self._grad(run).div_(self.divisor)
        self._armed.clear()
        for bucket in self.layout.buckets:
            bucket.final.clear()
        if self._free_after_reduce:
            self._free_grads()

    def unscale_(self, inv_scale: float = 1.0, check: bool = False) -> bool:
        """Master gradients: the reduced ones in fp32 times `inv_scale` (fp16's loss scale divided out).
        With `check`: True if any of this rank's is inf or nan (the caller MAX-reduces the verdict)."""
        if self.rdtype == torch.float32:  # buffers of our own: scaled in place
            if inv_scale != 1.0:
                for run in self.layout.runs:
                    self._grad(run).mul_(inv_scale)
        else:
            self.master_grads = torch.empty(self.layout.owned_numel, device=self.device)
            for run in self.layout.runs:
                self._mgrad(run).copy_(self._grad(run)).mul_(inv_scale)
        if not check or not self.layout.runs:
            return False
        return not bool(torch.stack([torch.isfinite(self._mgrad(r)).all() for r in self.layout.runs]).all())

    def grad_sq_norm(self) -> torch.Tensor:
        """This coordinate's part of the squared global gradient norm (float64): its pieces, summed over
        the DP group when the pieces are split across it."""
        grads = [self._mgrad(piece) for piece in self.layout.pieces if self._counted(piece)]
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        if grads:  # one fused call for all pieces: a norm per piece costs a dispatch each
            # In float64: a parameter split across owners (ZeRO >= 1) is summed in two parts, which in fp32
            # moves the norm, and with it the clip factor, by ~1e-7. With bf16 parameters that flips the
            # rounding of the masters nearest a bf16 boundary, one 2^-8 step each, and the runs drift apart
            # by ~1e-4 (more on CPUs whose bf16 kernels round differently). Squares of fp32 values are exact
            # in fp64 and their sums off by ~1e-12, which the fp32 clip factor no longer sees.
            norms = torch._foreach_norm(grads, 2, dtype=torch.float64)
            total += torch.stack(norms).square().sum()
        if self.sharded:
            self.group.all_reduce(total, "sum")
        return total

    def clip_(self, total_norm: float, max_norm: float) -> float:
        """Scale the gradients that the update reads by min(1, max_norm / (total_norm + 1e-6))."""
        if max_norm <= 0:
            return 1.0
        scale = min(1.0, max_norm / (total_norm + 1e-6))
        if scale < 1.0 and self.layout.runs:
            torch._foreach_mul_([self._mgrad(run) for run in self.layout.runs], scale)
        return scale

    def zero_grad(self) -> None:
        """Discard gradients (after an update, or a failed step that must leave nothing behind)."""
        for bucket in self.layout.buckets:
            bucket.work, bucket.ready, bucket.reduced = None, 0, None
            bucket.final.clear()
        self._armed.clear()
        self.master_grads = None
        if self._free_after_reduce:
            self._free_grads()
        else:
            for bucket in self.layout.buckets:
                bucket.grads.zero_()

    # -- the update ----------------------------------------------------------------------------------
    def step(self, lr: float) -> None:
        """AdamW on the owned pieces (weight decay on matrices only), then publish the parameters."""
        if self.offload is None:
            self._adam(self.layout.runs, self._decayed, self._mgrad, lr)
        else:  # bucket by bucket, as each one's gradients reach the host
            self.offload.run(
                [self._transfer(bucket) for bucket in self.layout.buckets],
                lambda b: self._adam(*self._bucket_updates[b], self._host_grad, lr),
            )
        self.step_count += 1
        self._publish()
        self.zero_grad()

    def _adam(
        self, runs: list[Run], decayed: list[Piece], grad: Callable[[Run], torch.Tensor], lr: float
    ) -> None:
        """AdamW on `runs`, with weight decay on the pieces `decayed` (the matrices among them)."""
        if runs:
            adamw_(
                [self._master(r) for r in runs],
                [grad(r).float() for r in runs],  # a no-op for fp32 gradients
                [self._moment("exp_avg", r) for r in runs],
                [self._moment("exp_avg_sq", r) for r in runs],
                self.step_count, self.cfg, lr, [self._master(p) for p in decayed],
            )

    # -- offload: one bucket's owned range on the device and on the host ---------------------------------
    def _host_grad(self, piece: Piece | Run) -> torch.Tensor:
        return self.offload.grads[piece.pos : piece.pos + piece.numel]

    def _transfer(self, bucket: Bucket) -> Transfer:
        own = slice(bucket.own_offset, bucket.own_offset + bucket.piece)
        if self.master_grads is not None:
            grad = self.master_grads[own]
        elif self.owned_grads is not None:
            grad = self.owned_grads[own]
        else:  # stage 1: the owned range of the all-reduced bucket
            full = bucket.grads if bucket.reduced is None else bucket.reduced
            grad = full[self.rank * bucket.piece : (self.rank + 1) * bucket.piece]
        return Transfer(grad, self.offload.grads[own], self.master[own], self._owned_params(bucket))

    def _owned_params(self, bucket: Bucket) -> torch.Tensor:
        """The device parameters of this rank's piece of `bucket`: what the all-gather sends."""
        return bucket.params[self.rank * bucket.piece : (self.rank + 1) * bucket.piece]

    def take_update_s(self) -> float:
        """Seconds the host update took since the last call (0 without offload)."""
        return self.offload.take_update_s() if self.offload else 0.0

    def _publish(self) -> None:
        """Make every replica's full parameters the updated ones (stages 0-2; stage 3 gathers on use)."""
        with torch.no_grad():
            if self.master is not None and self.offload is None:  # offloaded: `step` copied it back
                for run in self.layout.runs:
                    self._bucket_piece("params", run).copy_(self._master(run))
            if not self.sharded:
                return
            works = []
            for bucket in self.layout.buckets:
                mine = bucket.params[self.rank * bucket.piece : (self.rank + 1) * bucket.piece].clone()
                self.traffic["gather_bytes"] += bucket.piece * (self.size - 1) * mine.element_size()
                works.append(self.group.all_gather(mine, async_op=True, out=bucket.params))
            for work in works:
                work.wait()

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of the unique storages of parameters, gradients, master weights and moments, by device
        type (`cpu`, `cuda`), as allocated now. Offloaded, the host master, moments and gradient buffer
        count under `cpu` (once each: storages are counted once)."""
        host_grads = self.offload.grads if self.offload else None
        tensors = [self.master, self.owned_grads, self.master_grads, self.owned_params, host_grads]
        tensors += self.moments.values()
        for bucket in self.layout.buckets:
            tensors += [bucket.params, bucket.grads, bucket.reduced]
        for slot in self.layout.slots.values():
            tensors += [slot.param.data, slot.param.grad]
        seen: dict[tuple[str, int], int] = {}
        for t in tensors:
            if t is not None and (storage := t.untyped_storage()).nbytes():
                seen[(t.device.type, storage.data_ptr())] = storage.nbytes()
        out: dict[str, int] = {}
        for (device, _), n in seen.items():
            out[device] = out.get(device, 0) + n
        return out

    def close(self) -> None:
        """Remove every hook this strategy installed (a rebind builds a new one)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self.across is not None:
            self.across.close()


def _materialized(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() >= (t.storage_offset() + t.numel()) * t.element_size()


class Zero1(DPStrategy):
    """Masters and Adam moments sharded over the DP group; gradients still all-reduced."""

    stage = ZERO_STAGES[1]


class Zero2(DPStrategy):
    """ZeRO-1, and gradients reduce-scattered straight into the owned piece."""

    stage = ZERO_STAGES[2]
