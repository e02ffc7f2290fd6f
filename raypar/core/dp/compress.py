"""Gradient compression for the data-parallel reduction (`parallel.grad_compression`).

One small class per compressor, one interface: `all_reduce(group, flat, slots, op)` reduces a bucket's flat
gradients in place, `reduce_scatter(group, flat, out, op)` writes this rank's reduced piece into `out`
(ZeRO >= 2; bf16 only). Both return the bytes this rank sent, counted as the ring collectives they are built
from (the same accounting as `DPStrategy`'s uncompressed reduction: an all-reduce of n elements sends
2n(d-1)/d of them, a reduce-scatter or an all-gather n(d-1)/d).

- **bf16**: a reduce-scatter done as an all-to-all of bf16 chunks summed locally in fp32 (then divided for
  an average), and for an all-reduce an all-gather of the bf16 results. Bytes: an all-to-all sends
  n(d-1)/d elements, as a ring reduce-scatter does, so at 2 bytes instead of 4 both collectives send half
  the fp32 ring's bytes (n padded to a multiple of d). Every replica receives the same bf16 values, so
  replicas stay identical.
- **topk** (error feedback): each parameter of a bucket sends its ceil(`topk_ratio` * numel) largest
  entries of gradient + residual; what is not sent is the residual, added to the next step's gradient.
  The sparse sum all-gathers indices (int32) and values (fp32) and scatter-adds them rank by rank (a fixed
  order: replicas stay bitwise identical). k is per parameter, not per bucket, so that a tied embedding's
  copy on another stage (the same gradient in a differently composed bucket) makes the same selection.
- **powersgd** (Vogels et al. 2019): each matrix M (gradient + residual, viewed as rows x rest) is
  approximated by P Q^T of rank r = min(`powersgd_rank`, rows, cols): P = M Q is all-reduced and
  orthonormalised (QR), Q = M^T P is all-reduced (averaged) and reused as the next step's starting Q (warm
  start). The residual is the local error M - P P^T M. 1-D parameters are all-reduced plainly. Q starts
  from a generator seeded by the train seed and the parameter's source name, the same on every replica.

Compression begins at optimizer step `compression_start_step`; before it the reduction is uncompressed.
Compressed reductions run synchronously, bucket by bucket in `DPStrategy.finish` (wrapped in `Deferred`),
not overlapped with backward: topk and powersgd are several dependent collectives with compute between
them, which an async handle per bucket could not express without a thread.

State (`state_shapes`): residuals (shaped like their parameter) and PowerSGD's Q (cols x r) differ per DP
rank (residuals) or per tp rank (Q), so `DPStrategy` checkpoints them under `optim.compress.<kind>.<param>`
with a leading dp dimension. They are kept only across an unchanged dp: a checkpoint written at another dp
(or without them) and any re-formation of the DP group (elastic scaling, healing: `load_full_state`) reset
them to zero / the seeded Q. Resharding a residual has no meaning (it is one rank's unsent mass, not a
slice of a global tensor); the reset drops at most one step's compression error.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from collectives import Group
from raypar.core.checkpoint import CheckpointReader, ShardSpec
from raypar.core.config.options import BF16, NO_COMPRESSION, POWERSGD, TOPK, ZERO_STAGES
from raypar.core.config.schema import ParallelConfig

Shape = tuple[int, ...]

STATE_PREFIX = "optim.compress."  # under `optim.`: a model export leaves it out


class SlotLike(Protocol):
    """What a compressor needs of a parameter's place in its bucket (`raypar.core.dp.flat.Slot`)."""

    name: str
    offset: int
    numel: int
    shape: tuple[int, ...]


class Deferred:
    """A reduction that runs when waited on: the handle `DPStrategy.finish` waits for, in bucket order."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn = fn

    def wait(self) -> None:
        self._fn()


def _ring_all_reduce_bytes(t: torch.Tensor, size: int) -> int:
    return 2 * t.numel() * (size - 1) // size * t.element_size()


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    """fp32 accumulation for 16-bit gradients; a float64 input (tests) stays float64."""
    return torch.promote_types(t.dtype, torch.float32)


class Compressor:
    """Common interface; `start_step`: the first optimizer step that compresses."""

    name = NO_COMPRESSION.name

    def __init__(self, start_step: int = 0, seed: int = 0) -> None:
        self.start_step, self.seed = start_step, seed
        self.state: dict[str, dict[str, torch.Tensor]] = {}  # kind -> parameter name -> tensor

    def active(self, step_count: int) -> bool:
        return step_count >= self.start_step

    def all_reduce(self, group: Group, flat: torch.Tensor, slots: Sequence[SlotLike], op: str) -> int:
        raise NotImplementedError

    def reduce_scatter(self, group: Group, flat: torch.Tensor, out: torch.Tensor, op: str) -> int:
        stages = [z.level for z in ZERO_STAGES.values() if not z.reduce_scatters]
        raise NotImplementedError(f"{self.name} compression needs an all-reduce (parallel.zero in {stages})")

    def state_shapes(self, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """kind -> shape of the state kept for a parameter of `shape` (none by default)."""
        return {}

    def reset(self) -> None:
        self.state = {}

    def load(self, kind: str, name: str, tensor: torch.Tensor) -> None:
        self.state.setdefault(kind, {})[name] = tensor

    def _feed_back(self, name: str, acc: torch.Tensor) -> None:
        """Error feedback: add the residual left by the previous step to `acc` (the gradient) in place."""
        residual = self.state.get("residual", {}).get(name)
        if residual is not None:
            acc.add_(residual.view(acc.shape))

    def _keep(self, name: str, residual: torch.Tensor, shape: tuple[int, ...]) -> None:
        self.state.setdefault("residual", {})[name] = residual.reshape(shape)


class Bf16(Compressor):
    name = BF16.name

    def _scatter_sum(self, group: Group, flat: torch.Tensor, op: str) -> tuple[torch.Tensor, int]:
        """This rank's chunk (ceil(n / d) elements) of the sum over the group, in fp32, and bytes sent."""
        d, n = group.size, flat.numel()
        chunk = math.ceil(n / d)
        send = torch.zeros(d * chunk, dtype=torch.bfloat16, device=flat.device)
        send[:n] = flat
        recv = group.all_to_all(send)  # row j: rank j's values of this rank's chunk
        mine = recv.view(d, chunk).to(_acc_dtype(flat)).sum(0)
        if op == "avg":
            mine /= d
        return mine, chunk * (d - 1) * send.element_size()

    def reduce_scatter(self, group: Group, flat: torch.Tensor, out: torch.Tensor, op: str) -> int:
        mine, sent = self._scatter_sum(group, flat, op)
        out.copy_(mine[: out.numel()])
        return sent

    def all_reduce(self, group: Group, flat: torch.Tensor, slots: Sequence[SlotLike], op: str) -> int:
        mine, sent = self._scatter_sum(group, flat, op)
        ours = mine.to(torch.bfloat16)
        full = group.all_gather(ours)
        flat.copy_(full[: flat.numel()])
        return sent + ours.numel() * (group.size - 1) * ours.element_size()


class TopK(Compressor):
    name = TOPK.name

    def __init__(self, ratio: float, start_step: int = 0, seed: int = 0) -> None:
        super().__init__(start_step, seed)
        self.ratio = ratio

    def state_shapes(self, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        return {"residual": shape}

    def all_reduce(self, group: Group, flat: torch.Tensor, slots: Sequence[SlotLike], op: str) -> int:
        indices, values = [], []
        for s in slots:
            acc = flat[s.offset : s.offset + s.numel].to(_acc_dtype(flat), copy=True)
            self._feed_back(s.name, acc)
            k = min(s.numel, max(1, math.ceil(self.ratio * s.numel)))
            idx = acc.abs().topk(k, sorted=False).indices
            values.append(acc[idx])
            acc[idx] = 0  # what is sent leaves the residual
            self._keep(s.name, acc, s.shape)
            indices.append(idx + s.offset)
        idx = torch.cat(indices).to(torch.int32)  # a bucket holds < 2**31 elements
        vals = torch.cat(values)
        all_idx = group.all_gather(idx).view(group.size, -1).long()
        all_vals = group.all_gather(vals).view(group.size, -1)
        summed = torch.zeros(flat.numel(), dtype=vals.dtype, device=flat.device)
        for r in range(group.size):  # one rank at a time: its indices are distinct, so no write races
            summed.index_add_(0, all_idx[r], all_vals[r])
        if op == "avg":
            summed /= group.size
        flat.copy_(summed)
        return (idx.numel() * idx.element_size() + vals.numel() * vals.element_size()) * (group.size - 1)


class PowerSGD(Compressor):
    name = POWERSGD.name

    def __init__(self, rank: int, start_step: int = 0, seed: int = 0) -> None:
        super().__init__(start_step, seed)
        self.rank = rank

    def _rank_of(self, shape: tuple[int, ...]) -> int:
        rows = shape[0]
        return min(self.rank, rows, math.prod(shape) // rows)

    def state_shapes(self, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        if len(shape) < 2:
            return {}
        return {"residual": shape, "q": (math.prod(shape) // shape[0], self._rank_of(shape))}

    def _q(self, name: str, cols: int, r: int, like: torch.Tensor) -> torch.Tensor:
        q = self.state.get("q", {}).get(name)
        if q is None:  # the same on every replica: seeded by the run's seed and the parameter's name
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
            q = torch.randn(cols, r, generator=gen, dtype=torch.float64)
        return q.to(like.dtype).to(like.device)

    def all_reduce(self, group: Group, flat: torch.Tensor, slots: Sequence[SlotLike], op: str) -> int:
        sent = 0
        plain = [s for s in slots if len(s.shape) < 2]
        if plain:  # 1-D parameters: all-reduced as they are, in one collective
            vec = torch.cat([flat[s.offset : s.offset + s.numel] for s in plain])
            group.all_reduce(vec, op)
            sent += _ring_all_reduce_bytes(vec, group.size)
            for s, part in zip(plain, vec.split([s.numel for s in plain]), strict=True):
                flat[s.offset : s.offset + s.numel] = part
        mats = [s for s in slots if len(s.shape) >= 2]
        if not mats:
            return sent
        ms, qs = [], []
        for s in mats:
            m = flat[s.offset : s.offset + s.numel].to(_acc_dtype(flat), copy=True).view(s.shape[0], -1)
            self._feed_back(s.name, m)
            ms.append(m)
            qs.append(self._q(s.name, m.shape[1], self._rank_of(s.shape), m))
        # P = M Q, summed (its scale does not matter: it is orthonormalised)
        p_flat = torch.cat([(m @ q).reshape(-1) for m, q in zip(ms, qs, strict=True)])
        group.all_reduce(p_flat, "sum")
        sent += _ring_all_reduce_bytes(p_flat, group.size)
        ps = [
            torch.linalg.qr(p.view(m.shape[0], -1)).Q
            for m, p in zip(ms, p_flat.split([m.shape[0] * q.shape[1] for m, q in zip(ms, qs, strict=True)]),
                            strict=True)
        ]
        q_local = [m.T @ p for m, p in zip(ms, ps, strict=True)]
        for s, m, p, q in zip(mats, ms, ps, q_local, strict=True):
            self._keep(s.name, m - p @ q.T, s.shape)  # the local error: what the projection leaves out
        q_flat = torch.cat([q.reshape(-1) for q in q_local])
        group.all_reduce(q_flat, op)
        sent += _ring_all_reduce_bytes(q_flat, group.size)
        for s, p, q in zip(mats, ps, q_flat.split([q.numel() for q in q_local]), strict=True):
            q = q.view(-1, p.shape[1])
            self.state.setdefault("q", {})[s.name] = q  # warm start: the next step begins from it
            flat[s.offset : s.offset + s.numel] = (p @ q.T).reshape(-1)
        return sent


# parallel.grad_compression -> this rank's compressor (None: uncompressed); names: options.COMPRESSIONS
COMPRESSORS: dict[str, Callable[[ParallelConfig, int], Compressor | None]] = {
    NO_COMPRESSION.name: lambda p, seed: None,
    BF16.name: lambda p, seed: Bf16(p.compression_start_step, seed),
    TOPK.name: lambda p, seed: TopK(p.topk_ratio, p.compression_start_step, seed),
    POWERSGD.name: lambda p, seed: PowerSGD(p.powersgd_rank, p.compression_start_step, seed),
}


def build(p: ParallelConfig, seed: int) -> Compressor | None:
    """The compressor `p.grad_compression` names, its state seeded by the train seed."""
    return COMPRESSORS[p.grad_compression](p, seed)


# -- checkpoints: what a DPStrategy (`dp`) writes and reads of its compressor's state ----------------------
def _spec(dp: Any, kind: str, name: str, shape: tuple[int, ...]) -> tuple[Shape, Shape, Shape]:
    """(global shape, offsets, local shape) of this rank's state `kind` of parameter `name`: row `dp.rank`
    of a leading dp dimension. A residual sits where the parameter does in its global tensor; other state
    (PowerSGD's Q, shaped by the local tp shard) gets a tp dimension of its own."""
    global_shape, tp_offsets = dp.specs[name]
    if kind == "residual":
        return (dp.size, *global_shape), (dp.rank, *tp_offsets), (1, *shape)
    local = dp.layout.slots[name].shape
    splits = [(g // n, o // n) for g, n, o in zip(global_shape, local, tp_offsets, strict=True) if g != n]
    count, index = splits[0] if splits else (1, 0)
    return (dp.size, count, *shape), (dp.rank, index, *(0,) * len(shape)), (1, 1, *shape)


def state_parts(dp: Any) -> list[dict[str, tuple[torch.Tensor, ShardSpec]]]:
    """Every rank's own compressor state as one checkpoint part (none before the first compressed step)."""
    part: dict[str, tuple[torch.Tensor, ShardSpec]] = {}
    state = dp.compressor.state if dp.compressor is not None else {}
    for slot in dp.layout.slots.values():
        if dp.tied_copy(slot.name) or (dp.tp_rank and dp.replicated(slot.name)):
            continue  # as for parameters: the source's state, written by tp rank 0
        for kind, tensors in state.items():
            if (t := tensors.get(slot.name)) is not None:
                global_shape, offsets, local = _spec(dp, kind, slot.name, tuple(t.shape))
                part[f"{STATE_PREFIX}{kind}.{slot.name}"] = (t.view(local), ShardSpec(global_shape, offsets))
    return [part] if part else []


def load_state(dp: Any, reader: CheckpointReader) -> None:
    """This rank's compressor state from a checkpoint written at the same dp; otherwise (another dp, or no
    state stored) it starts afresh."""
    if dp.compressor is None:
        return
    dp.compressor.reset()
    stored = set(reader.names())
    for slot in dp.layout.slots.values():
        source = dp.source(slot.name)  # a tied copy's state is its source's
        for kind, shape in dp.compressor.state_shapes(slot.shape).items():
            name = f"{STATE_PREFIX}{kind}.{source}"
            global_shape, offsets, local = _spec(dp, kind, slot.name, shape)
            if name in stored and reader.global_shape(name) == global_shape:
                t = reader.read_slice(name, global_shape, offsets, local, torch.float32)
                dp.compressor.load(kind, source, t.view(shape).to(dp.device))
