"""The planner's memory model: what one actor of a layout holds, per pipeline rank (raypar.plan ranks it).

Memory per actor = model states + activations in flight + buffers, for the tightest pipeline rank:

- Model states (ZeRO paper, Ψ = parameters on this actor): bytes per parameter of parameter + gradient +
  optimizer state, sharded over dp by the ZeRO stage. fp32 Adam: 4 + 4 + 8; 16-bit: 2 + 4 + 12 (fp32 master
  gradients, as Megatron's main grads, where the ZeRO paper counts 2; fp32 master weights and both
  moments). zero 0: (p+g+K)Ψ; 1: (p+g)Ψ + KΨ/dp; 2: pΨ + (g+K)Ψ/dp; 3: (p+g+K)Ψ/dp.
- Activations: what autograd saves for backward per microbatch, counted per op of this model's block the
  way Korthikanti et al. (2022) count theirs (their 34·sbh + 5·as²b for a GPT layer becomes the sums below
  for RMSNorm, RoPE, grouped-query SDPA and SwiGLU), per model chunk (a rank holds `virtual_stages` of
  them under interleaved 1F1B, and only the first holds the embedding, only the last the head). The peak is
  read off the configured schedule itself, instruction by instruction: a (chunk, microbatch) unit's bytes
  count from its forward until its graph is freed (backward, or backward_weight under zero-bubble).
- Buffers: DP reduction buckets, the rank's outgoing activations kept until their gradient returns, and
  the transient logits of the loss. Not validated (they are not measured separately).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from raypar import schedules
from raypar.config import Config, ModelConfig
from raypar.memory import max_in_flight
from raypar.mesh import stage_layers

PRECISION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class Layout:
    dp: int
    pp: int
    tp: int
    zero: int
    recompute: str
    microbatches: int
    virtual_stages: int = 1  # model chunks per pipeline rank (> 1: interleaved 1F1B)

    def overrides(self) -> dict[str, dict[str, Any]]:
        return {
            "parallel": {
                "dp": self.dp, "pp": self.pp, "tp": self.tp, "microbatches": self.microbatches,
                "virtual_stages": self.virtual_stages,
            },
            "train": {"recompute": self.recompute},
        }


@dataclass
class StageMemory:
    model_states: float
    activations_per_mb: int  # the largest (chunk, microbatch) unit's
    in_flight: int  # units alive at once, at most
    activations: int  # the most bytes alive at once along the schedule
    buffers: float

    @property
    def total(self) -> float:
        return self.model_states + self.activations + self.buffers


def stage_params(m: ModelConfig, n_layers: int, first: bool, last: bool, tp: int) -> int:
    """Parameters one tp rank of a stage with `n_layers` blocks holds (norm gains are replicated, everything
    else split by tp)."""
    d, hd = m.d_model, m.head_dim
    matmuls = 2 * d * m.n_heads * hd + 2 * d * m.n_kv_heads * hd + 3 * d * m.d_ff
    total = n_layers * (2 * d + matmuls // tp)
    if first:
        total += m.vocab_size // tp * d
    if last:
        total += d + m.vocab_size // tp * d
    return total


def model_state_bytes(params: int, precision: str, zero: int, dp: int) -> float:
    p = PRECISION_BYTES[precision]
    # The optimizer's gradients are fp32 in every precision: 16-bit ones are converted one by one into
    # fp32 master gradients (unscaled) and freed, so they hold 4 bytes, not 2, once backward is done.
    g = 4
    k = 12 if p == 2 else 8  # 16-bit: fp32 master + two fp32 moments; fp32: the moments only
    full, sharded = [(p + g + k, 0), (p + g, k), (p, g + k), (0, p + g + k)][zero]
    return params * (full + sharded / dp)


def block_activation_bytes(
    m: ModelConfig, tp: int, mbs: int, precision: str, device_kind: str, recompute: str
) -> int:
    """Bytes one block saves for backward per microbatch of `mbs` sequences, on one tp rank."""
    e = PRECISION_BYTES[precision]
    bs, d = mbs * m.seq_len, m.d_model
    if recompute == "full":
        return e * bs * d  # the block's input, which checkpoint keeps
    heads, hq, hkv, f = m.n_heads // tp, m.d_model // tp, m.n_kv_heads * m.head_dim // tp, m.d_ff // tp
    # RMSNorm keeps its fp32 input (a copy under 16 bits), its normalised output and 1/rms; the linears
    # after it keep its output cast back; 16 bits also keep the gain's fp32 copy.
    norm = 8 * bs * d + 4 * bs + e * bs * d + (4 * d if e != 4 else 0)
    mask = e if device_kind == "cpu" else 1  # CPU dropout saves its scaled noise, CUDA a bool mask
    drop = 2 * mask * bs * d if m.dropout > 0 else 0  # after attention and after the MLP
    wo_input = e * bs * hq
    if recompute == "selective":
        core = e * bs * (hq + 2 * hkv)  # its inputs q, k, v; RoPE, scores and dropout are recomputed
        mlp = 3 * e * bs * f  # gate and up (the activation's inputs) and its product, for w_down
    else:
        if m.dropout > 0 and device_kind == "cpu":
            # The math kernel (CPU's fused one has no dropout): scaled q, expanded k and v, and three
            # [heads, s, s] tensors: probabilities, dropout noise, dropped probabilities.
            core = 3 * e * bs * hq + 3 * e * mbs * heads * m.seq_len**2
        else:
            # A fused kernel: q and k after RoPE, v, the output, and the softmax's log-sum-exp (fp32).
            core = e * bs * (2 * hq + 2 * hkv) + 4 * mbs * heads * m.seq_len
        mlp = 4 * e * bs * f  # gate, silu(gate), up, and the product
    return 2 * norm + core + wo_input + drop + mlp


def stage_activation_bytes(
    cfg: Config, layers: range, first: bool, last: bool, tp: int, mbs: int, device_kind: str, recompute: str
) -> int:
    m, t = cfg.model, cfg.train
    e = PRECISION_BYTES[t.precision]
    bs = mbs * m.seq_len
    total = 0
    for index in layers:
        mode = recompute if index % t.recompute_every == 0 else "none"
        total += block_activation_bytes(m, tp, mbs, t.precision, device_kind, mode)
    if first:
        total += 8 * bs + (bs if tp > 1 else 0)  # token ids (int64); tp > 1: shifted ids and their mask
    if last:
        d = m.d_model
        total += 8 * bs * d + 4 * bs + e * bs * d + (4 * d if e != 4 else 0)  # the final RMSNorm
        total += 4 * bs * (m.vocab_size // tp) + 9 * bs  # fp32 softmax, target index, ownership mask
    return total


def rank_chunks(cfg: Config, layout: Layout) -> list[list[range]]:
    """Per pipeline rank, the layers of each of its chunks: chunk c of rank r is virtual stage c * pp + r
    (as actors.worker builds them), so with v > 1 a rank's layers are not contiguous."""
    pp, v = layout.pp, layout.virtual_stages
    virtual = stage_layers(cfg.model.n_layers, pp * v, cfg.parallel.stage_layers or None)
    return [[virtual[c * pp + r] for c in range(v)] for r in range(pp)]


def layout_schedule(cfg: Config, layout: Layout) -> schedules.Plan:
    """The plan every rank runs: the config's schedule with the layout's stages, microbatches and chunks."""
    return schedules.build(cfg.parallel.schedule, layout.pp, layout.microbatches, layout.virtual_stages)


def peak_bytes(plan: list[schedules.Instr], unit_bytes: list[int]) -> int:
    """Most activation bytes alive at once along one rank's plan, unit (chunk c, mb) holding unit_bytes[c]:
    chunks differ (the first holds the embedding's inputs, the last the head's), so the count of units in
    flight times the largest is not the peak."""
    alive = peak = 0
    for instr in plan:
        if instr.op == schedules.FORWARD:
            alive += unit_bytes[instr.chunk]
        elif instr.op in schedules.WEIGHT_GRAD_OPS:
            alive -= unit_bytes[instr.chunk]
        peak = max(peak, alive)
    return peak


def predict_memory(
    cfg: Config, layout: Layout, device_kind: str, wrong_in_flight: bool = False
) -> list[StageMemory]:
    """Per pipeline rank: model states, activations, in-flight units and buffers of one actor.
    `wrong_in_flight` counts one unit alive at a time: a deliberately broken formula for negative controls."""
    m, t = cfg.model, cfg.train
    mbs = t.global_batch // (layout.dp * layout.microbatches)
    e = PRECISION_BYTES[t.precision]
    plan = layout_schedule(cfg, layout)
    v = layout.virtual_stages
    out = []
    for p, chunks in enumerate(rank_chunks(cfg, layout)):
        ends = [(p == 0 and c == 0, p == layout.pp - 1 and c == v - 1) for c in range(v)]
        params = stage_params(m, sum(map(len, chunks)), p == 0, p == layout.pp - 1, layout.tp)
        unit_bytes = [
            stage_activation_bytes(cfg, layers, first, last, layout.tp, mbs, device_kind, layout.recompute)
            for layers, (first, last) in zip(chunks, ends, strict=True)
        ]
        in_flight = 1 if wrong_in_flight else max_in_flight(plan[p])
        acts = max(unit_bytes) if wrong_in_flight else peak_bytes(plan[p], unit_bytes)
        reduce = 0 if layout.dp == 1 else params * 4 / (layout.dp if layout.zero else 1)
        # Every chunk but the model's last sends its output on (interleaved: the last rank's too, to rank 0).
        sends = 0 if p == layout.pp - 1 and v == 1 else in_flight * e * mbs * m.seq_len * m.d_model
        logits = 8 * mbs * m.seq_len * m.vocab_size // layout.tp if p == layout.pp - 1 else 0
        states = model_state_bytes(params, t.precision, layout.zero, layout.dp)
        out.append(StageMemory(states, max(unit_bytes), in_flight, acts, reduce + sends + logits))
    return out
