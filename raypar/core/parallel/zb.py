"""Zero-bubble backward split without walking the graph twice: deferred weight gradients.

Under ZB-H1 a unit's backward is split in two: B, the input gradient the previous stage waits for, and W,
the parameter gradients, deferred into the pipeline's bubble (Qi et al. 2023). Autograd gives B alone
(`torch.autograd.grad` to the input prunes the weight-gradient GEMMs), but asking it for W afterwards walks
the graph again: every activation gradient from the output down is recomputed to reach the weights, about
half a backward more. Zero-bubble needs the work split, not repeated; Megatron-LM's WeightGradStore does
that for its linears, and so does this module.

Linears attached to a store (`attach`) run as `_Linear`. While the store captures (B), its backward returns
the input gradient and leaves (input, output gradient) in the store instead of doing the weight GEMM. B
takes the gradients of every other parameter (norm weights, embeddings, the router: no GEMMs) from the
same walk and stashes them. W (`flush`) then hands all of it to the parameters through one small autograd
graph of `_Deferred` nodes, so the GEMMs run in W and each parameter's AccumulateGrad, with the DP
reducer's post-accumulate hooks, fires exactly as in a plain backward. Any other op can leave work for W
the same way, from its backward while the store captures (`defer`).

The unit's graph is still kept from B to W (`retain_graph`): its memory is what the planner and the
meter count for ZB-H1 today. Freeing it at B would keep only the linears' inputs and the output gradients.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Unit = tuple[int, int]  # (chunk, microbatch)


def _weight_grad(x: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """d loss / d weight of y = x @ weight.T: grad_out.T @ x over every token."""
    return grad_out.reshape(-1, grad_out.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))


class WeightGradStore:
    """The deferred weight gradients of one rank's units, from their B to their W."""

    def __init__(self) -> None:
        self.capturing: Unit | None = None
        # per unit: (parameter, what computes its gradient at W)
        self.deferred: dict[Unit, list[tuple[nn.Parameter, Callable[[], torch.Tensor]]]] = {}
        self.weights: set[int] = set()  # ids of the parameters whose gradient GEMM is deferred

    @contextmanager
    def capture(self, unit: Unit) -> Iterator[None]:
        """While B of `unit` runs: the attached linears leave their weight GEMMs here."""
        self.capturing, self.deferred[unit] = unit, []
        try:
            yield
        finally:
            self.capturing = None

    def defer(self, param: nn.Parameter, grad: Callable[[], torch.Tensor]) -> None:
        """During B: leave `grad()`, the gradient of `param` this unit contributes, to be computed at W."""
        assert self.capturing is not None, "deferring outside a backward_input"
        self.deferred[self.capturing].append((param, grad))

    def others(self, params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
        """Of `params`, those whose gradient B computes (no deferred GEMM)."""
        return [p for p in params if id(p) not in self.weights]

    def stash(self, unit: Unit, params: Sequence[nn.Parameter], grads: Sequence[torch.Tensor | None]) -> None:
        """Gradients B computed for `params` (None: unused by this unit), handed over at W."""
        self.deferred[unit] += [
            (p, functools.partial(_given, g)) for p, g in zip(params, grads, strict=True) if g is not None
        ]

    def flush(self, unit: Unit) -> None:
        """W of `unit`: compute its deferred gradients (the GEMMs run now), accumulate them into `.grad`."""
        nodes = [_Deferred.apply(p, grad) for p, grad in self.deferred.pop(unit)]
        if nodes:
            torch.autograd.backward(torch.stack([n.float() for n in nodes]).sum())


def _given(grad: torch.Tensor) -> torch.Tensor:
    return grad


class _Deferred(torch.autograd.Function):
    """A zero standing for one deferred gradient of `param`: its backward computes and hands it over."""

    @staticmethod
    def forward(ctx: Any, param: nn.Parameter, grad: Callable[[], torch.Tensor]) -> torch.Tensor:
        ctx.grad = grad  # held until W only
        return param.new_zeros(())

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad, ctx.grad = ctx.grad(), None
        return grad, None


class _Linear(torch.autograd.Function):
    """F.linear whose weight gradient is deferred to the store while it captures."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: nn.Parameter, store: WeightGradStore) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.store = store
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, weight = ctx.saved_tensors
        grad_x = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_w = None
        # needs_input_grad says what required grad at forward, not what this backward asks for, so the
        # store says whether this is a B.
        if ctx.store.capturing is not None:
            ctx.store.defer(weight, functools.partial(_weight_grad, x.detach(), grad_out.detach()))
        elif ctx.needs_input_grad[1]:  # a plain backward: both now
            grad_w = _weight_grad(x, grad_out)
        return grad_x, grad_w, None


def linear(x: torch.Tensor, weight: nn.Parameter, store: WeightGradStore | None) -> torch.Tensor:
    """F.linear; with a store, the variant whose weight gradient B can leave for W."""
    return F.linear(x, weight) if store is None else _Linear.apply(x, weight, store)


def attach(model: nn.Module, store: WeightGradStore) -> None:
    """Route every linear of `model` that can defer (a module with a `wgrad_store` slot) through `store`."""
    for module in model.modules():
        if hasattr(module, "wgrad_store"):
            module.wgrad_store = store
            store.weights.add(id(module.weight))


def store_of(model: nn.Module) -> WeightGradStore:
    """The store `model`'s linears defer to, attached on the first call for this model and reused by every
    later step: a model's linears and their weights are fixed when it is built (a new layout builds a new
    model, which gets a store of its own), so walking its modules once is enough. What a step that did not
    finish left deferred is dropped, as a new store would have it."""
    store = model.__dict__.get("_zb_store")
    if store is None:
        store = WeightGradStore()
        attach(model, store)
        model._zb_store = store  # not a module, parameter or buffer: a plain attribute of the model
    store.deferred.clear()
    return store
