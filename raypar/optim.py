"""The optimizer of one actor's shard: learning-rate schedule, AdamW, gradient-norm parts and clipping.

Callers see named parameters only (``step``, ``state_tensors`` keyed by parameter name, norms by name),
so what sits behind them can change without touching the caller: fp32 master copies of bf16/fp16
parameters, or ZeRO, where each tensor here becomes this rank's slice of the same named state.

Communication stays outside: the actor all-reduces ``grad_sq_norm`` over its model-parallel group, takes
the square root, and calls ``clip_`` with the global norm.

Checkpoint contract: ``state_tensors()`` holds the moments, ``optim.exp_avg.<param>`` and
``optim.exp_avg_sq.<param>``. The count of applied updates (``step_count``, which drives Adam's bias
correction) is not a tensor: it goes in the checkpoint's JSON metadata and back through
``load_state_tensors(tensors, step)``. It is kept apart from the training step because once dynamic
loss scaling skips overflowing steps the two differ.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
from torch import nn

from raypar.config import TrainConfig

OPTIM_PREFIX = "optim."
ADAM_EPS = 1e-8  # not in TrainConfig: no run has needed another value yet
_MOMENTS = ("exp_avg", "exp_avg_sq")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for the optimizer step with 0-based index ``step``.

    Linear warm-up reaching ``cfg.lr`` at step ``warmup_steps - 1`` (so step 0 already learns), then a
    cosine from ``cfg.lr`` down to ``cfg.min_lr`` at the last step ``cfg.steps - 1``, flat after it.
    A pure function of the step, so a resumed run needs nothing else to continue the schedule.
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = cfg.steps - 1 - cfg.warmup_steps
    if decay_steps <= 0:  # warm-up covers the whole run: nothing left to decay over
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


class Optimizer:
    """AdamW over ``module``'s parameters: weight decay on matrices only, fp32 moments, fp32 master weights.

    Norm gains and biases (< 2-D) are not decayed: pulling them to zero fights what they are for.
    Every parameter must have a gradient at each ``step``, so all parameters have taken the same number
    of updates and one ``step_count`` describes the whole state.

    Master weights: AdamW updates fp32 ``masters``. For fp32 parameters the master is the parameter itself;
    for 16-bit ones it is an fp32 copy, written back (rounded) into the parameter after each update, so
    updates far smaller than a 16-bit ulp still accumulate. ``unscale_`` turns the accumulated (possibly
    loss-scaled, 16-bit) gradients into fp32 master gradients; norms, clipping and the update read those.
    The masters are the checkpointed values of the parameters, so checkpoints do not depend on precision.
    """

    def __init__(self, module: nn.Module, cfg: TrainConfig, dtype: torch.dtype = torch.float32) -> None:
        """``module``'s parameters (fp32, as initialised) become fp32 masters; with a 16-bit ``dtype`` the
        module's parameters are then converted to it in place."""
        self.params: dict[str, nn.Parameter] = {
            name: p for name, p in module.named_parameters() if p.requires_grad
        }
        self.masters: dict[str, nn.Parameter] = {
            name: p if dtype == torch.float32 else nn.Parameter(p.detach().float().clone())
            for name, p in self.params.items()
        }
        for p in self.params.values():
            p.data = p.data.to(dtype)
        decay = [p for p in self.masters.values() if p.ndim >= 2]
        no_decay = [p for p in self.masters.values() if p.ndim < 2]
        groups = [
            {"params": ps, "weight_decay": wd}
            for ps, wd in ((decay, cfg.weight_decay), (no_decay, 0.0))
            if ps
        ]
        self._adamw = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=ADAM_EPS)
        self.step_count = 0

    def unscale_(self, inv_scale: float = 1.0, check: bool = False) -> bool:
        """Master gradients = parameter gradients in fp32 times ``inv_scale``. With ``check``: True if any
        is inf or nan (this actor's part of the verdict: the caller MAX-reduces it over every actor)."""
        flags = []
        for name, p in self.params.items():
            master = self.masters[name]
            if p.grad is None:
                continue
            if master is not p:
                master.grad = p.grad.float()
                p.grad = None  # the 16-bit copy is not needed past this point
            if inv_scale != 1.0:
                master.grad.mul_(inv_scale)
            if check:
                flags.append(torch.isfinite(master.grad).all())
        return bool(flags) and not bool(torch.stack(flags).all())

    def step(self, lr: float) -> None:
        """Apply one update with learning rate ``lr`` to every parameter from its master gradient."""
        missing = [name for name, p in self.masters.items() if p.grad is None]
        if missing:
            raise RuntimeError(f"optimizer step without gradients for {', '.join(missing)}")
        for group in self._adamw.param_groups:
            group["lr"] = lr
        self._adamw.step()
        self.step_count += 1
        self.refresh_params()

    @torch.no_grad()
    def refresh_params(self) -> None:
        """Round the masters into the 16-bit parameters (after an update, a load or a heal)."""
        for name, p in self.params.items():
            if self.masters[name] is not p:
                p.copy_(self.masters[name])

    def zero_grad(self) -> None:
        # None rather than zeros: the next backward allocates fresh gradients instead of adding into them.
        self._adamw.zero_grad(set_to_none=True)
        for p in self.params.values():
            p.grad = None

    def state_bytes(self) -> int:
        """Bytes held beyond the parameters and their own gradients: the moments and, for 16-bit
        parameters, the fp32 masters and master gradients."""
        extra = [t for n, m in self.masters.items() if m is not self.params[n] for t in (m, m.grad)]
        return sum(
            t.numel() * t.element_size() for t in [*self.state_tensors().values(), *extra] if t is not None
        )

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The moments by checkpoint name; the live tensors (copy them before writing in the background)."""
        out = {}
        for name, p in self.masters.items():
            state = self._adamw.state.get(p)
            for moment in _MOMENTS if state else ():
                out[f"{OPTIM_PREFIX}{moment}.{name}"] = state[moment]
        return out

    def load_state_tensors(self, tensors: Mapping[str, torch.Tensor], step: int) -> None:
        """Restore moments saved by ``state_tensors`` after ``step`` updates; continuing is bitwise
        identical to never having stopped."""
        self._adamw.state.clear()
        self.step_count = int(step)
        if step == 0:
            return
        for name, p in self.masters.items():
            state = {}
            for moment in _MOMENTS:
                key = f"{OPTIM_PREFIX}{moment}.{name}"
                if key not in tensors:
                    raise KeyError(f"optimizer state {key} missing from checkpoint (step {step})")
                saved = tensors[key]
                if saved.shape != p.shape:
                    raise ValueError(f"{key}: shape {tuple(saved.shape)} != parameter {tuple(p.shape)}")
                state[moment] = saved.to(device=p.device, dtype=torch.float32, copy=True)
            # AdamW keeps the count per parameter as a float32 scalar; the same dtype keeps bias
            # correction (computed from it) bit-identical.
            state["step"] = torch.tensor(float(step), dtype=torch.float32)
            self._adamw.state[p] = state

    def grad_sq_norm(self, replicated: Callable[[str], bool], is_tp_rank0: bool) -> torch.Tensor:
        """Sum of squared local gradients, float64, on the parameters' device.

        Parameters replicated across tensor-parallel ranks (``replicated(name)``, e.g. norm gains) count
        on tp rank 0 only, so the sum of this over the model-parallel group is the global norm squared.
        """
        device = next(iter(self.masters.values())).device if self.masters else torch.device("cpu")
        total = torch.zeros((), dtype=torch.float64, device=device)
        for name, p in self.masters.items():
            if p.grad is not None and (is_tp_rank0 or not replicated(name)):
                total += torch.linalg.vector_norm(p.grad, dtype=torch.float32).double().square()
        return total

    def clip_(self, total_norm: float, max_norm: float) -> float:
        """Scale gradients by min(1, max_norm / (total_norm + 1e-6)); ``max_norm <= 0`` disables. Returns
        the factor applied."""
        if max_norm <= 0:
            return 1.0
        scale = min(1.0, max_norm / (total_norm + 1e-6))
        if scale < 1.0:
            for p in self.masters.values():
                if p.grad is not None:
                    p.grad.mul_(scale)
        return scale
