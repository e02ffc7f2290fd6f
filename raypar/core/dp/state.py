"""Moving a data-parallel strategy's state: checkpoint parts and loading any checkpoint, the whole state
across a change of dp (and to heal new replicas), and the owned state of an in-memory snapshot.

`DPState` is a mixin of `raypar.core.dp.strategy.DPStrategy`, kept apart so that raypar.core.dp.strategy reads
as buckets, reduction
and the update. State is named as in checkpoints: a parameter's fp32 master under the parameter's name,
its Adam moments under `optim.<moment>.<name>`. It uses the strategy's flat layout and views
(`_master`, `_moment`, `_counted`), groups and `_publish` (raypar.core.dp.strategy).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch

from collectives import Group
from raypar.core.checkpoint import CheckpointReader, ShardSpec
from raypar.core.config.options import ZeroStage
from raypar.core.dp import compress
from raypar.core.dp.compress import Compressor
from raypar.core.dp.flat import Bucket, FlatLayout, Piece, rectangles

MOMENTS = ("exp_avg", "exp_avg_sq")


class DPState:
    """State movement of a `DPStrategy` (what the actor's checkpoint, healing and snapshot code calls)."""

    # What the strategy provides (set in DPStrategy.__init__).
    layout: FlatLayout
    specs: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]
    source: Callable[[str], str]
    stage: ClassVar[ZeroStage]
    sharded: bool
    group: Group | None
    replicate: Group | None
    size: int
    rank: int
    device: torch.device
    dtype: torch.dtype
    master: torch.Tensor | None
    moments: dict[str, torch.Tensor]
    compressor: Compressor | None
    step_count: int

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every local parameter in full as its fp32 master, on the CPU (a collective when sharded)."""
        return {n: t.to("cpu", copy=True) for n, t in self.full_state().items() if not n.startswith("optim.")}

    def _writes(self) -> bool:
        """Sharded: every owner, of the first shard group only (HSDP: the others hold copies)."""
        first_copy = self.replicate is None or self.replicate.rank == 0
        return first_copy and (self.stage.shards_optimizer or self.rank == 0)

    def checkpoint_parts(self) -> list[dict[str, tuple[torch.Tensor, ShardSpec]]]:
        """What this rank writes, as live views: name -> (rectangle, its place in the global tensor), split
        into parts that each name a tensor at most once (a flat range is up to three rectangles)."""
        parts: list[dict[str, tuple[torch.Tensor, ShardSpec]]] = []
        if not self._writes():
            return compress.state_parts(self)
        for piece in self.layout.pieces:
            if not self._counted(piece):
                continue  # tp-replicated: tp rank 0 writes it
            sources = {"": self._master(piece), **{f"optim.{m}.": self._moment(m, piece) for m in MOMENTS}}
            for k, (_, shape, start, spec) in enumerate(self._rectangles(piece)):
                while len(parts) <= k:
                    parts.append({})
                n = max(1, _prod(shape))
                for prefix, flat in sources.items():
                    parts[k][prefix + piece.slot.name] = (flat[start : start + n].view(shape), spec)
        return parts + compress.state_parts(self)

    def _rectangles(self, piece: Piece) -> list[tuple[tuple[int, ...], tuple[int, ...], int, ShardSpec]]:
        global_shape, tp_offsets = self.specs[piece.slot.name]
        out = []
        for offsets, shape, start in rectangles(piece.slot.shape, piece.lo, piece.hi):
            placed = tuple(a + b for a, b in zip(tp_offsets, offsets, strict=True))
            out.append((offsets, shape, start, ShardSpec(tuple(global_shape), placed)))
        return out

    def _read_piece(self, reader: CheckpointReader, name: str, piece: Piece, out: torch.Tensor) -> None:
        for _, shape, start, spec in self._rectangles(piece):
            part = reader.read_slice(name, spec.global_shape, spec.offsets, shape, torch.float32)
            out[start : start + max(1, _prod(shape))].copy_(part.reshape(-1))

    def load(self, reader: CheckpointReader, step_count: int) -> None:
        """This rank's part of any checkpoint (any layout, any zero stage) after `step_count` updates."""
        with torch.no_grad():
            if not self.stage.shards_parameters:  # else the parameters are gathered from the masters
                for slot in self.layout.slots.values():
                    shape, offsets = self.specs[slot.name]
                    source = self.source(slot.name)  # a tied head is stored as the embedding
                    full = reader.read_slice(source, tuple(shape), tuple(offsets), slot.shape, self.dtype)
                    slot.param.data.copy_(full)
            for piece in self.layout.pieces:
                source = self.source(piece.slot.name)
                if self.master is not None:
                    self._read_piece(reader, source, piece, self._master(piece))
                for m in MOMENTS:
                    if step_count:
                        name = f"optim.{m}.{source}"
                        self._read_piece(reader, name, piece, self._moment(m, piece))
                    else:
                        self._moment(m, piece).zero_()
        compress.load_state(self, reader)
        self.step_count = int(step_count)

    def full_state(self) -> dict[str, torch.Tensor]:
        """The whole state of this coordinate by checkpoint name (master values under the parameter's
        name), local shapes, fp32. Unsharded: live views. Sharded: a collective over the DP group that
        returns host copies (transiently the full state: dp changes are rare)."""
        names = {"": None, **{f"optim.{m}.": m for m in MOMENTS}}
        if not self.sharded:
            def live(piece: Piece, moment: str | None) -> torch.Tensor:
                flat = self._master(piece) if moment is None else self._moment(moment, piece)
                return flat.view(piece.slot.shape)

            return {
                prefix + p.slot.name: live(p, m)
                for p in self.layout.pieces
                for prefix, m in names.items()
            }
        out: dict[str, torch.Tensor] = {}
        for prefix, m in names.items():
            if m is None:
                mine = torch.cat(
                    [self._master_owned(b) for b in self.layout.buckets]
                ) if self.layout.buckets else torch.zeros(0)
            else:
                mine = self.moments[m]
            gathered = self.group.all_gather(mine.to(self.device).contiguous()).view(self.size, -1)
            for bucket in self.layout.buckets:
                own = gathered[:, bucket.own_offset : bucket.own_offset + bucket.piece].reshape(-1)
                for slot in bucket.slots:
                    out[prefix + slot.name] = self.layout.view(own, slot).to("cpu", copy=True)
        return out

    def _master_owned(self, bucket: Bucket) -> torch.Tensor:
        if self.master is not None:
            return self.master[bucket.own_offset : bucket.own_offset + bucket.piece]
        return bucket.params[self.rank * bucket.piece : (self.rank + 1) * bucket.piece].float()

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """The names and local shapes of `full_state()`."""
        return {
            prefix + s.name: s.shape
            for s in self.layout.slots.values() for prefix in ("", *(f"optim.{m}." for m in MOMENTS))
        }

    def state_template(self) -> dict[str, torch.Tensor]:
        """Tensors shaped like `full_state()`'s, to receive a broadcast into."""
        return {name: torch.empty(shape, device=self.device) for name, shape in self.state_shapes().items()}

    def load_full_state(self, state: dict[str, torch.Tensor], step_count: int) -> None:
        """Take this rank's part of a `full_state()` (from any dp and zero stage)."""
        with torch.no_grad():
            if not self.stage.shards_parameters:  # else the parameters are gathered from the masters
                for slot in self.layout.slots.values():
                    if slot.param.data.data_ptr() != state[slot.name].data_ptr():
                        slot.param.data.copy_(state[slot.name])
            for piece in self.layout.pieces:
                lo, hi = piece.lo, piece.hi
                if self.master is not None:
                    self._master(piece).copy_(state[piece.slot.name].reshape(-1)[lo:hi])
                for m in MOMENTS:
                    self._moment(m, piece).copy_(state[f"optim.{m}.{piece.slot.name}"].reshape(-1)[lo:hi])
        if self.compressor is not None:  # per-rank residuals do not survive a new DP group
        # (raypar.core.dp.compress)
            self.compressor.reset()
        self.step_count = int(step_count)

    def owned_state(self) -> dict[str, torch.Tensor]:
        """Host copies of exactly what this rank owns (fp32 master and Adam moments of its pieces, flat):
        with the step count, all an in-memory copy needs, since the rest of the parameters is gathered
        from the other owners (`load_owned_state`)."""
        with torch.no_grad():
            flat = {"master": [self._master(p).float() for p in self.layout.pieces]}
            flat.update({m: [self._moment(m, p) for p in self.layout.pieces] for m in MOMENTS})
            return {k: torch.cat(v).to("cpu", copy=True) if v else torch.zeros(0) for k, v in flat.items()}

    def load_owned_state(self, state: dict[str, torch.Tensor], step_count: int) -> None:
        """Take back an `owned_state()` taken at this rank of the same group, then rebuild the parameters
        from the owners' pieces (a collective over the DP group when sharded: every rank calls it)."""
        with torch.no_grad():
            pos = 0
            for piece in self.layout.pieces:
                self._master(piece).copy_(state["master"][pos : pos + piece.numel])
                for m in MOMENTS:
                    self._moment(m, piece).copy_(state[m][pos : pos + piece.numel])
                pos += piece.numel
        self.step_count = int(step_count)
        self._publish()


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
