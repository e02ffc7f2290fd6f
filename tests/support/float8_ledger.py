"""One process's float8 casts, cast by cast, and a layout's run checked against them and forced onto them.

Why a model-level fp8 check must be teacher-forced: a layout computes some high-precision values with fp32
sums in another order (a row-parallel all-reduce, copy_to_tp's sum of input gradients, a ring attention's
merges), ~1e-7 relative apart from one process's. Where such a value lies that close to a float8 rounding
midpoint, the two runs cast it to neighbouring float8 values: a flip of one e4m3 step, 2^-3 relative, ~10^6
times the nudge. Downstream of a flip, values move by ~1e-3 and later casts flip in their turn: over a
model's backward the gradients of two correct runs part by up to ~2e-2 of their largest entries (rowwise at
tp=2, measured: layer 0's projections; tensorwise's flips tend to land on small elements), as far as a
missing amax reduction moves them. So the layout's run (`Forced`) compares every cast's amaxes with one
process's (`Recording`'s ledger, in call order: every rank of tp or cp casts the linears one process casts,
in its order) within fp32 regrouping, then takes one process's float8 values and scales for its slice of
the operand: what is left to compare is the GEMMs, the collectives and the assembly, within fp32
regrouping, and the share of elements forcing changed says the casts differed only at rounding midpoints.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from collectives import Group
from raypar.core.config.schema import Config
from raypar.core.parallel import cp
from raypar.core.parallel.float8 import TOKENS, Cast, Float8Matmul
from tests.support.pipeline_threads import StepOutcome, reference_step, run_step

# A reduced amax is a max, exact, of values that fp32 regrouping moves by ~1e-7 of the magnitudes summed into
# them (~1e-6 after a few layers). Relative to a small row's own amax that can be far more: attention's
# gradients are sums with cancellation (ring's dq rows of ~1e-5 moved ~1e-4 relative, measured), so the
# tolerance is 2^-16 of the operand's largest amax. A missing reduction gives the shard's own max, smaller
# by the other shard's share: a few percent of the largest amaxes wherever it differs at all.
AMAX_RTOL = 2.0**-16


@dataclass
class Ledger:
    """What one process cast: per cast, in call order, the reduced amax, the float8 values and the scale."""

    casts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)


class Recording(Float8Matmul):
    """One process's float8 GEMMs, writing every cast into `ledger`."""

    def __init__(self, recipe: str, ledger: Ledger):
        super().__init__(recipe)
        self.ledger = ledger
        self.last_amaxes: list[torch.Tensor] = []

    def reduce_amaxes(self, amaxes, spans, splits):
        self.last_amaxes = super().reduce_amaxes(amaxes, spans, splits)
        return self.last_amaxes

    def cast(self, operands, splits, emulate):
        out = super().cast(operands, splits, emulate)
        self.recorded(out)
        return out

    def recorded(self, out: list[Any]) -> None:
        for amax, q in zip(self.last_amaxes, out, strict=True):
            self.ledger.casts.append((amax.clone(), q._data.clone(), q._scale.clone()))


class Forced(Recording):
    """A layout rank's float8 GEMMs: each cast's amaxes checked against the ledger's (sliced to this rank's
    part of the operand), then its float8 values and scale replaced by the ledger's. Mismatches are
    collected, not raised: a rank that raised would leave its peers waiting in a collective."""

    def __init__(
        self, recipe: str, ledger: Ledger, seq_len: int, cp_style: str, grad_factor: float = 1.0,
        where: Any = None,
    ):
        super().__init__(recipe, ledger)
        self.where = where  # the rank's coordinate, for messages
        self.seq_len, self.cp_style = seq_len, cp_style
        # A cp rank's loss is the mean over its T/cp tokens (the cp group's mean is the sequence's), so every
        # gradient it casts is cp times one process's: a power of two, which moves amax and scale exactly and
        # leaves the float8 values alone.
        self.grad_factor = grad_factor
        self.next = 0  # the ledger's next cast
        self.mismatches: list[str] = []
        self.elements = self.changed = 0  # float8 elements cast, and those forcing changed

    def recorded(self, out: list[Any]) -> None:
        pass  # a layout rank checks against the ledger; it does not write one

    def cast(self, operands, splits, emulate):
        out = super().cast(operands, splits, emulate)
        for (t, c), amax, q in zip(operands, self.last_amaxes, out, strict=True):
            if self.next >= len(self.ledger.casts):
                self.mismatches.append(f"cast {self.next} ({self._name(c)}): one process cast fewer")
                continue
            index = self._indices(t, c, splits)
            want_amax, want_data, want_scale = (_take(w, index) for w in self.ledger.casts[self.next])
            if c.role is self.grad.role:
                want_amax, want_scale = want_amax * self.grad_factor, want_scale / self.grad_factor
            if want_data.shape != q._data.shape or amax.shape != want_amax.shape:
                self.mismatches.append(f"cast {self.next} ({self._name(c)}): shape {tuple(q._data.shape)}")
            else:
                err = (amax.float() - want_amax.float()).abs().max()
                if err > AMAX_RTOL * want_amax.float().abs().max():
                    self.mismatches.append(
                        f"amax of cast {self.next} ({self._name(c)}) differs: {amax.max().item():.6g} vs "
                        f"{want_amax.max().item():.6g} at most"
                    )
                self.elements += q._data.numel()
                self.changed += int((q._data.view(torch.uint8) != want_data.view(torch.uint8)).sum())
                q._data.copy_(want_data)
                q._scale.copy_(want_scale)
            self.next += 1
        return out

    def _name(self, cast: Cast) -> str:
        return next(n for n, c in vars(self).items() if c is cast)

    def _indices(self, t: torch.Tensor, cast: Cast, splits: dict[str, Group | None]) -> list[Any]:
        """Per dim of the operand, where this rank's part lies in one process's (None: all of it)."""
        index: list[Any] = []
        for axis, dim in enumerate(cast.dims):
            group, n = splits.get(dim), t.shape[axis]
            if group is None or group.size == 1:
                index.append(None)
            elif dim == TOKENS:  # [batch * T/cp] rows of the rank's positions in each sequence
                local = cp.positions(self.seq_len, group.size, group.rank, self.cp_style)
                batch = torch.arange(n // len(local)).unsqueeze(1) * self.seq_len
                index.append((batch + local).reshape(-1))
            else:  # tp: a contiguous chunk of the weight's dim
                index.append(torch.arange(group.rank * n, (group.rank + 1) * n))
        return index


def _take(full: torch.Tensor, index: list[Any]) -> torch.Tensor:
    """The rank's part of one process's tensor: a rowwise amax or scale keeps its reduced dim at size 1, a
    tensorwise one is a scalar, and neither is indexed there."""
    for axis, positions in enumerate(index):
        if positions is not None and full.dim() > axis and full.shape[axis] > 1:
            full = full.index_select(axis, positions)
    return full


def record(cfg: Config, recipe: str) -> tuple[Ledger, tuple[float, dict[str, torch.Tensor]]]:
    """One process's step (it depends on the model, data and batch, not on the layout), recording its casts:
    the ledger, and its loss and gradients."""
    ledger = Ledger()
    want = reference_step(cfg, model_hook=lambda m: m.set_float8(Recording(recipe, ledger)))
    return ledger, want


def forced_step(
    cfg: Config, recipe: str, ledger: Ledger, rank_class: type[Forced] = Forced
) -> tuple[StepOutcome, list[Forced]]:
    """The layout's step (tp, cp) forced onto `ledger`: its outcome, and every rank's `Forced`."""
    ranks: list[Forced] = []
    p = cfg.parallel

    def hook(model: Any, coord: Any, groups: Any) -> None:
        ranks.append(rank_class(recipe, ledger, cfg.model.seq_len, p.cp_style, grad_factor=p.cp, where=coord))
        model.set_float8(ranks[-1])

    return run_step(cfg, model_hook=hook), ranks
