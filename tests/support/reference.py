"""The one-process reference run: the same model, data and update rule in a plain PyTorch loop.

Written independently of the parallel path on purpose: one forward over the whole global batch,
`torch.optim.AdamW` and `torch.nn.utils.clip_grad_norm_` directly, no microbatches, no groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from raypar.core import data
from raypar.core.checkpoint import hf
from raypar.core.config.schema import Config
from raypar.core.dp.optim import ADAM_EPS, lr_at
from raypar.core.model import families
from raypar.core.model.moe_balance import apply_bias_updates, bias_updates


@dataclass
class Run:
    losses: list[float]
    grad_norms: list[float]
    params: dict[str, torch.Tensor]
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)  # per step, after clipping
    val_losses: dict[int, float] = field(default_factory=dict)  # step -> validation loss after it


def reference_run(cfg: Config, steps: int, microbatch_size: int | None = None) -> Run:
    """`microbatch_size`: forward the global batch in microbatches of that size, the loss being the mean of
    their (cross-entropy + MoE aux) losses, as the parallel run defines it; the default is one forward."""
    torch.manual_seed(0)
    m, t = cfg.model, cfg.train
    model = families.build_stage(m, seed=t.seed, init=not m.init_from)
    if m.init_from:
        hf.load_stage(model, m.init_from)
    params = [p for p in model.parameters()]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": t.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=ADAM_EPS)
    dataset, val = data.open_datasets(cfg.data, m)
    sampler = data.GlobalSampler(dataset.num_samples, t.global_batch, t.seed)
    losses, norms, val_losses = [], [], {}
    mbs = microbatch_size or t.global_batch
    count = t.global_batch // mbs
    grads = []
    for step in range(steps):
        loss = 0.0
        for mb in range(count):
            inputs, targets = data.microbatch(dataset, sampler, step, mb, mbs)
            ce = model(inputs, targets)
            aux = model.take_aux_loss()
            ((ce if aux is None else ce + aux) / count).backward()
            loss += ce.detach() / count
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, t.grad_clip)))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        for group in opt.param_groups:
            group["lr"] = lr_at(step, t)
        opt.step()
        opt.zero_grad()
        if m.moe_bias_update_rate:  # the step's loads: the global batch's, as the replicas all-reduce them
            layers = model.moe_layers()
            moves = bias_updates(layers, m.moe_bias_update_rate, None, torch.device("cpu"))
            apply_bias_updates(layers, moves)
        model.take_moe_stats()
        losses.append(loss.item())
        if t.eval_every and ((step + 1) % t.eval_every == 0 or step + 1 == t.steps):
            model.eval()
            with torch.no_grad():
                batches = [
                    data.eval_microbatch(val, k, 0, t.global_batch, t.global_batch)
                    for k in range(t.eval_batches)
                ]
                val_losses[step] = sum(model(x, y).item() for x, y in batches) / len(batches)
                model.take_aux_loss()
                model.take_moe_stats()  # validation routes tokens too: not the next step's loads
            model.train()
    params_out = {n: p.detach().clone() for n, p in model.named_parameters()}
    return Run(losses, norms, params_out, grads, val_losses)
