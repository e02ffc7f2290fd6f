"""The flat layout a DP strategy keeps one stage shard's parameters in: buckets, padding, owned pieces.

Parameters are packed into buckets in backward order (the reverse of registration order, as torch DDP
does), each bucket one contiguous flat buffer padded to a multiple of `shards`. Rank r of the DP group
owns piece r of every bucket: elements [r * piece, (r + 1) * piece). A reduce-scatter of a bucket's
gradient buffer therefore lands exactly on the owner's piece, without copying gradients in or out.

A parameter crosses at most one piece boundary per owner, so what one rank owns of one parameter is one
flat range of it. Checkpoints store rectangles of global tensors, so a flat range of a 2-D tensor is cut
into at most three rectangles (a partial first row, whole rows, a partial last row): `rectangles`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Slot:
    """One parameter's place: elements [offset, offset + numel) of bucket `bucket`."""

    name: str
    param: nn.Parameter
    bucket: int
    offset: int
    numel: int
    shape: tuple[int, ...]


@dataclass
class Piece:
    """What this rank owns of one parameter: its flattened elements [lo, hi), held at [pos, pos + hi - lo)
    of the rank's owned buffer (the concatenation of its piece of every bucket)."""

    slot: Slot
    lo: int
    hi: int
    pos: int

    @property
    def numel(self) -> int:
        return self.hi - self.lo

    @property
    def bucket(self) -> int:
        return self.slot.bucket

    @property
    def start(self) -> int:
        """Where the piece starts in its bucket's flat tensors."""
        return self.slot.offset + self.lo


@dataclass
class Run:
    """Everything this rank owns of one bucket: elements [start, start + numel) of the bucket's flat
    tensors, held at [pos, pos + numel) of the owned buffer. Its pieces, one after the other: an elementwise
    update (AdamW, clipping, unscaling) runs on it as one tensor, one kernel per bucket instead of one per
    parameter (a dispatch each, which shows in short steps: benchmarks/README.md, `train_throughput.py`)."""

    bucket: int
    start: int
    numel: int
    pos: int


@dataclass
class Bucket:
    slots: list[Slot]
    size: int
    padded: int
    piece: int
    own_offset: int  # where this bucket's owned piece starts in the owned buffer
    params: torch.Tensor | None = None  # the full flat parameters (None or freed storage under ZeRO-3)
    grads: torch.Tensor | None = None  # the full flat gradients, alive from first backward to reduction
    reduced: torch.Tensor | None = None  # their cast copy, when reduced in another dtype (stages 0-1)
    ready: int = 0  # gradients accumulated since the bucket last completed (ZeRO-3 frees it then)
    final: set[int] = field(default_factory=set)  # ids of the parameters whose gradient is final
    work: object | None = None
    names: set[str] = field(default_factory=set)


class FlatLayout:
    """Buckets of `named` (name, parameter) pairs, padded for `shards` owners; this rank is `rank`.

    `groups` (lists of names) force bucket boundaries: ZeRO-3 passes one group per block so that a bucket
    is what is gathered before the block runs. Otherwise buckets close once they reach `bucket_bytes`.
    """

    def __init__(
        self,
        named: list[tuple[str, nn.Parameter]],
        shards: int,
        rank: int,
        bucket_bytes: int,
        groups: list[list[str]] | None = None,
    ) -> None:
        self.shards, self.rank = shards, rank
        order = list(reversed(named))
        if groups is None:
            groups, current, size = [], [], 0
            for name, p in order:
                current.append(name)
                size += p.numel() * p.element_size()
                if size >= bucket_bytes:
                    groups.append(current)
                    current, size = [], 0
            if current:
                groups.append(current)
        by_name = dict(named)
        self.buckets: list[Bucket] = []
        self.slots: dict[str, Slot] = {}
        own = 0
        for names in groups:
            slots, offset = [], 0
            for name in names:
                p = by_name[name]
                slot = Slot(name, p, len(self.buckets), offset, p.numel(), tuple(p.shape))
                slots.append(slot)
                self.slots[name] = slot
                offset += p.numel()
            padded = math.ceil(max(offset, 1) / shards) * shards
            piece = padded // shards
            self.buckets.append(Bucket(slots, offset, padded, piece, own, names=set(names)))
            own += piece
        self.owned_numel = own
        self.pieces: list[Piece] = []
        for bucket in self.buckets:
            start, end = rank * bucket.piece, (rank + 1) * bucket.piece
            for slot in bucket.slots:
                lo, hi = max(slot.offset, start), min(slot.offset + slot.numel, end)
                if lo < hi:
                    pos = bucket.own_offset + lo - start
                    self.pieces.append(Piece(slot, lo - slot.offset, hi - slot.offset, pos))
        self.runs = [  # the padding at a bucket's end is no one's
            Run(b, start, min(bucket.size - start, bucket.piece), bucket.own_offset)
            for b, bucket in enumerate(self.buckets)
            if bucket.size > (start := bucket.piece * rank)
        ]

    def view(self, flat: torch.Tensor, slot: Slot) -> torch.Tensor:
        """Slot `slot` of a bucket-sized flat tensor, shaped like the parameter."""
        return flat[slot.offset : slot.offset + slot.numel].view(slot.shape)

    def piece_of_bucket(self, flat: torch.Tensor, piece: Piece | Run) -> torch.Tensor:
        """The flat elements of `piece` (or run) inside its bucket-sized tensor `flat`."""
        return flat[piece.start : piece.start + piece.numel]


Rectangle = tuple[tuple[int, ...], tuple[int, ...], int]


def rectangles(shape: tuple[int, ...], lo: int, hi: int) -> list[Rectangle]:
    """Cut flat elements [lo, hi) of a row-major tensor of `shape` (at most 2-D) into rectangles.

    Returns (offsets, shape, flat start relative to lo) per rectangle, at most three, in flat order.
    """
    if len(shape) <= 1:
        return [((lo,), (hi - lo,), 0)] if shape else [((), (), 0)]
    if len(shape) != 2:
        raise ValueError(f"flat ranges of {len(shape)}-D tensors are not supported (shape {shape})")
    cols = shape[1]
    out: list[Rectangle] = []
    at = lo
    if at % cols:  # a partial first row
        end = min(hi, (at // cols + 1) * cols)
        out.append(((at // cols, at % cols), (1, end - at), at - lo))
        at = end
    whole = (hi - at) // cols
    if whole:
        out.append(((at // cols, 0), (whole, cols), at - lo))
        at += whole * cols
    if at < hi:  # a partial last row
        out.append(((at // cols, 0), (1, hi - at), at - lo))
    return out
