"""The planner: which layouts of a config fit a device's memory, and how fast each would run.

Memory per actor = model states + activations in flight + buffers, for the tightest pipeline stage:

- Model states (ZeRO paper, Ψ = parameters on this actor): bytes per parameter of parameter + gradient +
  optimizer state, sharded over dp by the ZeRO stage. fp32 Adam: 4 + 4 + 8; 16-bit: 2 + 4 + 12 (fp32 master
  gradients, as Megatron's main grads, where the ZeRO paper counts 2; fp32 master weights and both
  moments). zero 0: (p+g+K)Ψ; 1: (p+g)Ψ + KΨ/dp; 2: pΨ + (g+K)Ψ/dp; 3: (p+g+K)Ψ/dp.
- Activations: what autograd saves for backward per microbatch, counted per op of this model's block the
  way Korthikanti et al. (2022) count theirs (their 34·sbh + 5·as²b for a GPT layer becomes the sums below
  for RMSNorm, RoPE, grouped-query SDPA and SwiGLU), times the stage's layers, times the most microbatches
  in flight under the schedule (read off the schedule itself).
- Buffers: DP reduction buckets, the stage's outgoing activations kept until their gradient returns, and
  the transient logits of the loss. Not validated (they are not measured separately).

Step time = compute at an assumed MFU (recomputation adds its extra forward FLOPs) + the pipeline bubble
((pp - 1)/m of compute for GPipe and 1F1B alike) + exposed communication (tensor-parallel all-reduces are
on the critical path; the DP gradient all-reduce overlaps the last microbatch's backward; pipeline sends
are exposed only while the pipeline fills and drains). Layouts are the config with (dp, pp, tp, zero,
recompute, microbatches) replaced, kept only if `config.validate` accepts them, so the planner never lists
what `raypar train` would refuse.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from raypar import config, schedules
from raypar.config import Config, ConfigError, ModelConfig
from raypar.memory import max_in_flight
from raypar.mesh import stage_layers
from raypar.model import flops_per_token

PRECISION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class Device:
    name: str
    kind: str  # "cuda" or "cpu": which attention kernel runs, how dropout stores its mask
    peak_flops_16: float  # dense bf16/fp16
    peak_flops_32: float
    intra_bw: float  # bytes/s per direction inside a node (tensor parallelism)
    inter_bw: float  # bytes/s per device between nodes
    per_node: int = 8


# Datasheet peaks (dense) and per-direction link bandwidths; CPU numbers are this project's 2-core
# machine (DESIGN.md: ~90 GFLOP/s fp32 and ~210 bf16 per core, gloo over loopback ~1 GB/s).
DEVICES = {
    "h200": Device("h200", "cuda", 989e12, 67e12, 450e9, 50e9),
    "h100": Device("h100", "cuda", 989e12, 67e12, 450e9, 50e9),
    "a100": Device("a100", "cuda", 312e12, 19.5e12, 300e9, 25e9),
    "cpu": Device("cpu", "cpu", 210e9, 90e9, 1e9, 1e9, per_node=1024),
}


@dataclass(frozen=True)
class Layout:
    dp: int
    pp: int
    tp: int
    zero: int
    recompute: str
    microbatches: int

    def overrides(self) -> dict[str, dict[str, Any]]:
        return {
            "parallel": {"dp": self.dp, "pp": self.pp, "tp": self.tp, "microbatches": self.microbatches},
            "train": {"recompute": self.recompute},
        }


@dataclass
class StageMemory:
    model_states: float
    activations_per_mb: int
    in_flight: int
    buffers: float

    @property
    def activations(self) -> int:
        return self.activations_per_mb * self.in_flight

    @property
    def total(self) -> float:
        return self.model_states + self.activations + self.buffers


@dataclass
class Prediction:
    layout: Layout
    stages: list[StageMemory]
    compute_s: float
    bubble_s: float
    comm_s: float
    tokens_per_step: int
    fits: bool = True

    @property
    def memory_bytes(self) -> float:
        return max(s.total for s in self.stages)

    @property
    def step_time_s(self) -> float:
        return self.compute_s + self.bubble_s + self.comm_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_time_s

    def to_json(self) -> dict[str, Any]:
        worst = max(self.stages, key=lambda s: s.total)
        return {
            **dataclasses.asdict(self.layout),
            "memory_bytes": self.memory_bytes,
            "model_state_bytes": worst.model_states,
            "activation_bytes": worst.activations,
            "in_flight": worst.in_flight,
            "buffer_bytes": worst.buffers,
            "step_time_s": self.step_time_s,
            "compute_s": self.compute_s,
            "bubble_s": self.bubble_s,
            "comm_s": self.comm_s,
            "tokens_per_s": self.tokens_per_s,
            "fits": self.fits,
        }


# -- memory -----------------------------------------------------------------------------------------------
def stage_params(m: ModelConfig, layers: range, first: bool, last: bool, tp: int) -> int:
    """Parameters one tp rank of a stage holds (norm gains are replicated, everything else split by tp)."""
    d, hd = m.d_model, m.head_dim
    matmuls = 2 * d * m.n_heads * hd + 2 * d * m.n_kv_heads * hd + 3 * d * m.d_ff
    total = len(layers) * (2 * d + matmuls // tp)
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


def predict_memory(
    cfg: Config, layout: Layout, device_kind: str, wrong_in_flight: bool = False
) -> list[StageMemory]:
    """Per pipeline stage: model states, activations, in-flight microbatches and buffers of one actor.
    `wrong_in_flight` drops the in-flight factor: a deliberately broken formula for negative controls."""
    m, t = cfg.model, cfg.train
    mbs = t.global_batch // (layout.dp * layout.microbatches)
    e = PRECISION_BYTES[t.precision]
    split = stage_layers(m.n_layers, layout.pp, cfg.parallel.stage_layers or None)
    plan = schedules.build(cfg.parallel.schedule, layout.pp, layout.microbatches)
    out = []
    for p, layers in enumerate(split):
        first, last = p == 0, p == layout.pp - 1
        params = stage_params(m, layers, first, last, layout.tp)
        acts = stage_activation_bytes(cfg, layers, first, last, layout.tp, mbs, device_kind, layout.recompute)
        in_flight = 1 if wrong_in_flight else max_in_flight(plan[p])
        reduce = 0 if layout.dp == 1 else params * 4 / (layout.dp if layout.zero else 1)
        sends = 0 if last else in_flight * e * mbs * m.seq_len * m.d_model
        logits = 8 * mbs * m.seq_len * m.vocab_size // layout.tp if last else 0
        states = model_state_bytes(params, t.precision, layout.zero, layout.dp)
        out.append(StageMemory(states, acts, in_flight, reduce + sends + logits))
    return out


# -- time -------------------------------------------------------------------------------------------------
def _all_reduce_s(nbytes: float, ranks: int, bw: float) -> float:
    return 0.0 if ranks == 1 else 2 * (ranks - 1) / ranks * nbytes / bw


def predict(
    cfg: Config, layout: Layout, device: Device, mfu: float, wrong_in_flight: bool = False
) -> Prediction:
    m, t = cfg.model, cfg.train
    e = PRECISION_BYTES[t.precision]
    stages = predict_memory(cfg, layout, device.kind, wrong_in_flight)
    tokens = t.global_batch * m.seq_len
    world = layout.dp * layout.pp * layout.tp
    recomputed = sum(1 for i in range(m.n_layers) if i % t.recompute_every == 0)
    d, s = m.d_model, m.seq_len
    block = 2 * d * d + 2 * d * m.n_kv_heads * m.head_dim + 3 * d * m.d_ff
    extra = {"none": 0.0, "selective": 4.0 * d * s, "full": 2.0 * block + 4.0 * d * s}[layout.recompute]
    flops = tokens * (flops_per_token(m) + recomputed * extra)
    peak = device.peak_flops_16 if e == 2 else device.peak_flops_32
    compute = flops / world / (peak * mfu)
    bubble = compute * (layout.pp - 1) / layout.microbatches
    mbs = t.global_batch // (layout.dp * layout.microbatches)
    layers = max(len(r) for r in stage_layers(m.n_layers, layout.pp, cfg.parallel.stage_layers or None))
    intra = layout.tp * layout.pp * layout.dp <= device.per_node
    tp_bw = device.intra_bw if layout.tp <= device.per_node else device.inter_bw
    reductions = 4 + (2 if layout.recompute == "full" else 0)  # 2 forward, 2 backward, replayed forwards
    activation = e * mbs * s * d
    tp_comm = layout.microbatches * layers * reductions * _all_reduce_s(activation, layout.tp, tp_bw)
    bw = device.intra_bw if intra else device.inter_bw
    pp_comm = 2 * (layout.pp - 1) * activation / bw
    params = max(
        stage_params(m, r, i == 0, i == layout.pp - 1, layout.tp)
        for i, r in enumerate(stage_layers(m.n_layers, layout.pp, cfg.parallel.stage_layers or None))
    )
    dp_bytes = params * 4  # reduced in fp32
    dp_comm = _all_reduce_s(dp_bytes, layout.dp, bw)
    if layout.zero == 3:  # parameters gathered for every forward and backward
        dp_comm += 2 * layout.microbatches * _all_reduce_s(params * e, layout.dp, bw) / 2
    dp_exposed = max(0.0, dp_comm - compute / layout.microbatches * 2 / 3)
    return Prediction(layout, stages, compute, bubble, tp_comm + pp_comm + dp_exposed, tokens)


# -- enumeration ------------------------------------------------------------------------------------------
def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def zero_stages(cfg: Config) -> tuple[int, ...]:
    """ZeRO stages the config can express (stage 0 only until the config has a `zero` key)."""
    return ZERO_STAGES if hasattr(cfg.parallel, "zero") else (0,)


def layout_config(cfg: Config, layout: Layout) -> Config:
    """`cfg` with the layout's knobs; raises ConfigError where the config's own rules reject them."""
    raw = cfg.to_dict()
    for section, values in layout.overrides().items():
        raw[section].update(values)
    if hasattr(cfg.parallel, "zero"):
        raw["parallel"]["zero"] = layout.zero
    raw["parallel"]["max_dp"] = 0
    if layout.pp != cfg.parallel.pp:
        raw["parallel"]["stage_layers"] = []
    return config.from_dict(raw)


def candidates(cfg: Config, devices: int) -> list[tuple[Layout, Config]]:
    out = []
    for tp in _divisors(devices):
        for pp in _divisors(devices // tp):
            dp = devices // (tp * pp)
            if cfg.train.global_batch % dp:
                continue
            for m in _divisors(cfg.train.global_batch // dp):
                for zero in zero_stages(cfg) if dp > 1 else (0,):
                    for recompute in config.RECOMPUTE:
                        layout = Layout(dp, pp, tp, zero, recompute, m)
                        try:
                            out.append((layout, layout_config(cfg, layout)))
                        except ConfigError:
                            continue  # a layout `raypar train` would refuse is never listed
    return out


def plan(cfg: Config, devices: int, memory: float, device: Device, mfu: float = 0.4) -> list[Prediction]:
    """Every valid layout on `devices` devices, fitting ones first, each group by predicted throughput."""
    preds = []
    for layout, layout_cfg in candidates(cfg, devices):
        pred = predict(layout_cfg, layout, device, mfu)
        pred.fits = pred.memory_bytes <= memory
        preds.append(pred)
    return sorted(preds, key=lambda p: (not p.fits, -p.tokens_per_s))


def current_layout(cfg: Config) -> Layout:
    return Layout(
        cfg.dp_fixed,
        cfg.parallel.pp,
        cfg.parallel.tp,
        getattr(cfg.parallel, "zero", 0),
        cfg.train.recompute,
        cfg.parallel.microbatches,
    )


def check_fits(cfg: Config, memory: float, device: Device, where: str) -> None:
    """Raise ConfigError naming one knob to turn if the config's own layout is predicted not to fit."""
    layout = current_layout(cfg)
    need = predict(cfg, layout, device, 0.4).memory_bytes
    if need <= memory:
        return
    tries = [dataclasses.replace(layout, recompute=r) for r in ("selective", "full")]
    tries += [dataclasses.replace(layout, zero=z) for z in zero_stages(cfg) if z > layout.zero]
    tries += [dataclasses.replace(layout, microbatches=layout.microbatches * 2)]
    for knob in tries:
        try:
            knob_cfg = layout_config(cfg, knob)
        except ConfigError:
            continue
        if predict(knob_cfg, knob, device, 0.4).memory_bytes <= memory:
            changed = next(
                f"{key}={getattr(knob, key)}"
                for key in ("recompute", "zero", "microbatches")
                if getattr(knob, key) != getattr(layout, key)
            )
            section = "train" if changed.startswith("recompute") else "parallel"
            raise ConfigError(
                f"{section}.{changed.split('=')[0]}: the plan predicts {gib(need)} per actor > {gib(memory)} "
                f"on {where}; set {section}.{changed} (see `raypar plan`)"
            )
    raise ConfigError(
        f"parallel.tp/pp: the plan predicts {gib(need)} per actor > {gib(memory)} on {where}, and no "
        "single knob fits; more devices (pp or tp) are needed (see `raypar plan`)"
    )


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"


def device_named(name: str) -> Device:
    """The table's entry whose key is in `name` (e.g. "NVIDIA H200"); an unknown GPU plans as an H100."""
    lowered = name.lower()
    return next((dev for key, dev in DEVICES.items() if key in lowered), DEVICES["h100"])


def parse_size(text: str) -> float:
    """'80GB', '80GiB', '141G', '512MiB', '1e9' -> bytes (G = GB = 1e9, GiB = 2**30)."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)
    if not match:
        raise ValueError(f"not a size: {text!r} (e.g. 80GB, 141GiB)")
    number, unit, binary = match.groups()
    power = " KMGT".index(unit.upper() or " ")
    return float(number) * (1024 if binary else 1000) ** power


def table(preds: list[Prediction], top: int) -> str:
    head = f"{'dp':>3} {'pp':>3} {'tp':>3} {'zero':>4} {'recompute':>9} {'mb':>4} {'memory':>12} "
    head += f"{'states':>11} {'activ.':>11} {'step s':>9} {'tokens/s':>11}"
    rows = [head]
    for p in preds[:top]:
        j = p.to_json()
        rows.append(
            f"{j['dp']:>3} {j['pp']:>3} {j['tp']:>3} {j['zero']:>4} {j['recompute']:>9} "
            f"{j['microbatches']:>4} {gib(j['memory_bytes']):>12} {gib(j['model_state_bytes']):>11} "
            f"{gib(j['activation_bytes']):>11} {j['step_time_s']:>9.3g} {j['tokens_per_s']:>11,.0f}"
        )
    return "\n".join(rows)
