"""Float8 GEMMs for the tensor-parallel linears (`train.precision = "fp8"`), scaled as one process scales.

torchao's float8 training (`torchao.float8`) casts the three operands of a linear's three GEMMs (input,
weight, output gradient) to float8 with dynamic scaling: each cast takes the amax of its tensor (the whole
tensor, "tensorwise", or each row along one dim, "rowwise"), turns it into a scale and multiplies it in; the
GEMM divides it out (emulated in fp32 on the CPU, `torch._scaled_mm` on GPUs). Under tensor parallelism a
rank holds only a slice of a weight, of a row-parallel linear's input or of a column-parallel linear's output
gradient; under context parallelism only T/cp of a sequence's tokens, of every input and output gradient.
The amax of its slice is not the amax of the tensor, and the rank would round with another scale than one
process does. Here such an amax is MAX-reduced over the groups that split it first (tp for a weight dim, cp
for the tokens: a rowwise amax along the features of one token needs neither), so every layout scales every
element as one process does: the same operand gives the same float8 values, and only the order of the
GEMM's sums differs. (Inside a model the operands themselves carry fp32 regrouping, and an element at a
rounding midpoint may round the other way: tests.support.float8_ledger checks the layouts teacher-forced.)

Written here, and why: torchao's own reduction (`reduce_amax`) all-reduces over torch.distributed's default
group, which raypar does not have (its groups are standalone gloo or CuPy-NCCL `Group`s), and torchao's
`matmul_with_hp_or_float8_args` does all three GEMMs in one backward, where zero-bubble needs the weight GEMM
deferred to W (raypar.core.parallel.zb). So the autograd function below follows torchao's, cast by cast,
calling torchao for everything else: the amax (`tensor_to_amax`), the scale (`amax_to_scale`), the cast
(`hp_tensor_and_scale_to_float8`) and the scaled GEMM (`torch.mm` on its `Float8TrainingTensor`). The casts
of a backward, the weight GEMM's too, run (and reduce) in B; W only multiplies the float8 operands.

Which linears: the attention projections and the dense MLP (a stage's `set_float8`). The vocabulary head,
the router and the experts stay in bf16, as torchtitan leaves its output layer: the head's logits are where
float8's 3 mantissa bits cost the most loss, and an expert's tokens come from the whole ep group.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from collectives import Group
from raypar.core.config.options import PRECISIONS
from raypar.core.config.schema import TrainConfig
from raypar.core.parallel.zb import WeightGradStore

TOKENS, INNER, OUTER = "tokens", "inner", "outer"  # the dims of a linear's operands, by what they index
# The dims of each operand as torchao holds it: input [tokens, in], weight.t() [in, out], grad [tokens, out]
_INPUT, _WEIGHT_T, _GRAD = (TOKENS, INNER), (INNER, OUTER), (TOKENS, OUTER)


@contextmanager
def _quiet(*loggers: str) -> Iterator[None]:
    """torchao warns at import about the CUDA kernels a CPU wheel cannot load, and torch about an Enum it
    registers; neither concerns float8 training, and every actor would print them."""
    saved = [(logging.getLogger(n), logging.getLogger(n).level) for n in loggers]
    for logger, _ in saved:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in saved:
            logger.setLevel(level)


@functools.cache
def _torchao() -> Any:
    """torchao.float8, imported on first use: it is the optional extra `raypar[fp8]` (the config rules
    refuse fp8 without it, before any actor starts)."""
    with _quiet("torchao", "torch.utils._pytree"):
        from torchao.float8 import config, float8_scaling_utils, float8_training_tensor, float8_utils
    return config, float8_scaling_utils, float8_training_tensor, float8_utils


@dataclass(frozen=True)
class Cast:
    """One operand cast of torchao's linear: which torchao `CastConfig` and GEMM role, and along which dim a
    rowwise amax runs (its index into the operand's dims)."""

    config: Any  # torchao.float8.config.CastConfig
    role: Any  # torchao.float8.float8_training_tensor.GemmInputRole
    axis: int
    dims: tuple[str, str]

    def reduced_dims(self) -> tuple[str, ...]:
        """The dims the amax spans: all of them tensorwise, the one `axis` rowwise."""
        config, *_ = _torchao()
        if self.config.scaling_granularity is config.ScalingGranularity.TENSORWISE:
            return self.dims
        return (self.dims[self.axis],)

    def axiswise_dim(self) -> int | None:
        _, scaling, *_ = _torchao()
        return scaling.get_maybe_axiswise_dim(self.axis, self.config.scaling_granularity)


class Float8Matmul:
    """How the linears of a model run their GEMMs in float8: torchao's recipe `recipe` ("tensorwise" or
    "rowwise"). One object serves every linear; each call says which group splits which dim. Its amax
    reduction (`reduce_amaxes`) is the seam a negative control overrides."""

    def __init__(self, recipe: str):
        config, _, tensor, _ = _torchao()
        self.recipe = recipe
        c = self.config = config.Float8LinearConfig.from_recipe_name(recipe)
        roles = tensor.GemmInputRole
        # torchao's casts, in its order: output = input @ weight.t(); grad_input = grad @ weight;
        # grad_weight = grad.t() @ input (argument `axis` as torchao's get_maybe_axiswise_dim calls get it)
        self.input = Cast(c.cast_config_input, roles.INPUT, -1, _INPUT)
        self.weight = Cast(c.cast_config_weight, roles.WEIGHT, 0, _WEIGHT_T)
        self.grad = Cast(c.cast_config_grad_output, roles.GRAD_OUTPUT, -1, _GRAD)
        self.weight_for_grad_input = Cast(c.cast_config_weight_for_grad_input, roles.WEIGHT, -1, _WEIGHT_T)
        grad_for_gw = c.cast_config_grad_output_for_grad_weight
        self.grad_for_grad_weight = Cast(grad_for_gw, roles.GRAD_OUTPUT, 0, _GRAD)
        self.input_for_grad_weight = Cast(c.cast_config_input_for_grad_weight, roles.INPUT, 0, _INPUT)
        # emulated (fp32 GEMMs of the float8 values) where there are no float8 tensor cores: the CPU
        self.mm_configs = {emulate: self._mm_config(emulate) for emulate in (False, True)}

    def _mm_config(self, emulate: bool) -> Any:
        """torchao's per-GEMM settings, as its Float8Linear builds them."""
        _, _, tensor, _ = _torchao()
        c = self.config
        gemms = (c.gemm_config_output, c.gemm_config_grad_input, c.gemm_config_grad_weight)
        return tensor.LinearMMConfig(
            *(tensor.ScaledMMConfig(emulate, g.use_fast_accum, False, c.pad_inner_dim) for g in gemms)
        )

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, store: WeightGradStore | None,
        splits: dict[str, Group | None],
    ) -> torch.Tensor:
        """F.linear(x, weight) with float8 GEMMs; `splits`: dim name -> the group splitting it here (a
        column-parallel linear's tp group splits OUTER, a row-parallel one's INNER)."""
        return _Float8Linear.apply(x, weight, self, splits, store)

    def cast(
        self, operands: Sequence[tuple[torch.Tensor, Cast]], splits: dict[str, Group | None], emulate: bool
    ) -> list[torch.Tensor]:
        """Float8 copies of `operands`, each scaled from its amax over the whole tensor it is a slice of."""
        _, _, tensor, utils = _torchao()
        amaxes = [
            utils.tensor_to_amax(
                t, scaling_granularity=c.config.scaling_granularity, axiswise_dim=c.axiswise_dim()
            )
            for t, c in operands
        ]
        amaxes = self.reduce_amaxes(amaxes, [c.reduced_dims() for _, c in operands], splits)
        mm = self.mm_configs[emulate]
        out = []
        for (t, c), amax in zip(operands, amaxes, strict=True):
            scale = utils.amax_to_scale(amax, c.config.target_dtype, self.config.round_scales_to_power_of_2)
            dtype = c.config.target_dtype
            out.append(tensor.hp_tensor_and_scale_to_float8(t, scale, dtype, mm, c.role, c.axiswise_dim()))
        return out

    def reduce_amaxes(
        self, amaxes: list[torch.Tensor], spans: list[tuple[str, ...]], splits: dict[str, Group | None]
    ) -> list[torch.Tensor]:
        """Each amax MAX-reduced over the groups splitting a dim it spans: one all-reduce per group for all
        the casts that need it (a max is exact, so every rank gets the one-process amax bit for bit)."""
        amaxes = list(amaxes)
        groups = {id(g): g for dims in spans for d in dims if (g := splits.get(d)) is not None and g.size > 1}
        for key, group in groups.items():
            which = [i for i, dims in enumerate(spans) if any(id(splits.get(d)) == key for d in dims)]
            flat = torch.cat([amaxes[i].float().reshape(-1) for i in which])
            group.all_reduce(flat, op="max")
            for i, part in zip(which, flat.split([amaxes[i].numel() for i in which]), strict=True):
                amaxes[i] = part.view_as(amaxes[i]).to(amaxes[i].dtype)
        return amaxes


def float8_for(train: TrainConfig) -> Float8Matmul | None:
    """The float8 GEMMs `train.precision` asks for (its `fp8_recipe`), or None."""
    return Float8Matmul(train.fp8_recipe) if PRECISIONS[train.precision].float8 else None


def _weight_grad(grad_t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """d loss / d weight [out, in] from the float8 copies of the output gradient [out, tokens] (transposed)
    and the input [tokens, in]."""
    return torch.mm(grad_t, x)


class _Float8Linear(torch.autograd.Function):
    """torchao's matmul_with_hp_or_float8_args with the amaxes reduced over their groups, taking a weight
    [out, in] (not its transpose), and whose weight GEMM B leaves to W while the store captures."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, fp8: Float8Matmul, splits: dict[str, Group | None],
        store: WeightGradStore | None,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.fp8, ctx.splits, ctx.store = fp8, splits, store
        emulate = not x.is_cuda
        x2 = x.reshape(-1, x.shape[-1])
        xq, wq = fp8.cast([(x2, fp8.input), (weight.t(), fp8.weight)], splits, emulate)
        return torch.mm(xq, wq).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None]:
        x, weight = ctx.saved_tensors
        fp8, splits, store = ctx.fp8, ctx.splits, ctx.store
        capturing = store is not None and store.capturing is not None
        wants_weight = capturing or ctx.needs_input_grad[1]
        grad2, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        operands = [(grad2, fp8.grad), (weight.t(), fp8.weight_for_grad_input)]
        if wants_weight:
            operands += [(grad2, fp8.grad_for_grad_weight), (x2, fp8.input_for_grad_weight)]
        cast = fp8.cast(operands, splits, emulate=not grad.is_cuda)  # every reduction here, in B
        grad_x = torch.mm(cast[0], cast[1].t()).reshape(*grad.shape[:-1], weight.shape[1])
        grad_w = None
        if capturing:  # zero-bubble B: the weight GEMM waits for W, on operands already in float8
            store.defer(weight, functools.partial(_weight_grad, cast[2].t(), cast[3]))
        elif wants_weight:
            grad_w = _weight_grad(cast[2].t(), cast[3])
        return grad_x, grad_w, None, None, None
