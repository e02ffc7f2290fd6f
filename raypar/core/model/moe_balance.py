"""Aux-loss-free load balancing (DeepSeek-V3, section 2.1.2): each MoE layer's per-expert routing bias, moved
after every step by the sign of each expert's load error.

The loads are the step's assignments per expert over the whole mesh: every microbatch, every replica and
every cp rank (the tp ranks of a stage route the same tokens and count them alike). One all-reduce over
the stage's cp x dp group sums every rank's counts, so every replica derives the same update from the same
integers and adds the same float32 values to the same bias: the bias stays bitwise equal on every replica
without being broadcast. The update is computed in phase 1 of a step (the collective runs while every actor
is in it) and added when the step is committed, with the parameters' update; a step that fails is redone
and its pending update recomputed.

Its spread, DeepSeek's MaxVio (max load / mean load - 1), is what metrics.jsonl reports as
`expert_load_spread` (raypar.controller.actor_calls.moe_totals).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from collectives import Group
from raypar.core.model.moe import MoELayer


def bias_updates(
    layers: Mapping[str, MoELayer], rate: float, group: Group | None, device: torch.device
) -> dict[str, torch.Tensor]:
    """layer -> rate * sign(mean load - load) per expert, from the loads of the step so far (the layers'
    `stats`, not taken) summed over `group` (the stage's cp x dp group; None: this rank is the mesh)."""
    if not layers:
        return {}
    loads = torch.stack([layer.stats.load for layer in layers.values()]).to(device)  # [layers, E] int64
    if group is not None and group.size > 1:
        group.all_reduce(loads, "sum")
    loads = loads.double()
    error = loads.mean(dim=1, keepdim=True) - loads  # an underloaded expert's bias goes up
    steps = (rate * error.sign()).float()
    return dict(zip(layers, steps.unbind(), strict=True))


def apply_bias_updates(layers: Mapping[str, MoELayer], updates: Mapping[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, step in updates.items():
            layers[name].expert_bias.add_(step.to(layers[name].expert_bias.device))


def load_spread(load: Sequence[int]) -> float:
    """MaxVio: how far the busiest expert is over the mean load (0: perfectly balanced)."""
    mean = sum(load) / len(load)
    return max(load) / mean - 1.0 if mean else 0.0
