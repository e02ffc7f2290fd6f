"""The planner's search: every layout of a config on N devices that `raypar train` would accept, the fastest
found first, then ranked (raypar.core.planner.rank).

A layout is the config with (dp, pp, tp, zero, recompute, microbatches, virtual_stages, cp, cp_style,
sequence_parallel, ep, schedule, offload) replaced; it is listed only if the config's own rules
(`rules.validate`) accept it. Schedules searched: 1F1B (interleaved with every chunk count that splits the
layers), ZB-H1 and DualPipeV; GPipe is left out: the same bubble as 1F1B with every microbatch in flight,
it never ranks above it. Memory per actor: raypar.core.planner.memory; step time: raypar.core.planner.step.

The search is a best-first one. A layout's compute and bubble (no communication, which only adds) bound its
step time from below and cost microseconds, so layouts are taken in order of that bound and validated and
predicted in full only until the bound passes both the tie band of the fastest fitting layout and the
`top`-th fitting one: nothing left could rank above them. Knobs that only cost time are tried only where
the cheaper ones do not fit: full recomputation (a third more compute than selective, Korthikanti et al.
2022) where selective does not fit, and offload (host traffic every step) where ZeRO-3 alone does not.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import math
import re
from collections.abc import Iterator

from raypar.core.checkpoint import available_memory
from raypar.core.config import rules
from raypar.core.config.errors import ConfigError
from raypar.core.config.options import (
    CP_STYLES,
    CPU_OFFLOAD,
    DUALPIPEV,
    FULL,
    NO_OFFLOAD,
    ONE_F_ONE_B,
    RECOMPUTE,
    SCHEDULES,
    SELECTIVE,
    ZB_H1,
    ZERO_STAGES,
)
from raypar.core.config.schema import Config
from raypar.core.model.moe import is_moe_layer
from raypar.core.planner.memory import Layout, rank_chunks, rank_states
from raypar.core.planner.step import (
    DEVICES,
    Device,
    Prediction,
    axes_comm_s,
    bubble_ratio,
    predict,
    rank_compute_s,
    step_times,
)

# The largest --devices planned for: ten times today's largest clusters, searched in seconds.
MAX_DEVICES = 2**20
# Layouts predicted in full where none fits, the least memory first (their model states may be all that
# was worked out during the search), for `raypar plan` to show the nearest.
NEAREST = 64
# Schedules the search tries at pp > 1, with their chunk counts (None: every count that splits the layers).
SEARCHED = ((ONE_F_ONE_B.name, None), (ZB_H1.name, (1,)), (DUALPIPEV.name, (2,)))


def _divisors(n: int) -> list[int]:
    """The divisors of n in increasing order, in O(sqrt n): `--devices` may be any integer."""
    small = [k for k in range(1, math.isqrt(n) + 1) if n % k == 0]
    return small + [n // k for k in reversed(small) if k * k != n]


def zero_stages(cfg: Config) -> tuple[int, ...]:
    """ZeRO stages the config can express (stage 0 only until the config has a `zero` key)."""
    return tuple(ZERO_STAGES) if hasattr(cfg.parallel, "zero") else (0,)


def with_layout(cfg: Config, layout: Layout) -> Config:
    """`cfg` with the layout's knobs, not validated (see `layout_config`). The sections are replaced field by
    field (their types are the layout's own): thousands of layouts are built per plan."""
    sections = {name: dict(values) for name, values in layout.overrides().items()}
    if hasattr(cfg.parallel, "zero"):
        sections["parallel"]["zero"] = layout.zero
    sections["parallel"]["max_dp"] = 0
    if layout.pp != cfg.parallel.pp:
        sections["parallel"]["stage_layers"] = []
    return dataclasses.replace(
        cfg, **{name: dataclasses.replace(getattr(cfg, name), **values) for name, values in sections.items()}
    )


def layout_config(cfg: Config, layout: Layout) -> Config:
    """`cfg` with the layout's knobs; raises ConfigError where the config's own rules reject them (the
    rules `raypar train` runs)."""
    out = with_layout(cfg, layout)
    rules.validate(out)
    return out


def sequence_axes(cfg: Config, devices: int) -> list[tuple[int, str, int]]:
    """(cp, cp_style, tp) splits of `devices`: both cp styles (they differ in what they send and in what
    they require: ring 2·cp chunks of the sequence, Ulysses heads divisible by cp)."""
    out = []
    for cp in _divisors(devices):
        for tp in _divisors(devices // cp):
            styles = tuple(CP_STYLES)[::-1] if cp > 1 else (cfg.parallel.cp_style,)  # the order ties rank in
            out += [(cp, style, tp) for style in styles]
    return out


def _pipelines(cfg: Config, pp: int, microbatches: int) -> Iterator[tuple[str, int]]:
    """(schedule, virtual_stages) the rules allow at pp and m microbatches per replica (the necessary
    conditions of rules._validate_pipeline; validate still decides)."""
    n = cfg.model.n_layers
    if pp == 1:
        yield ONE_F_ONE_B.name, 1
        return
    for schedule, chunks in SEARCHED:
        for v in chunks or [v for v in _divisors(n) if v == 1 or n % (pp * v) == 0]:
            if SCHEDULES[schedule].v_shape:
                ok = n % (pp * v) == 0 and microbatches >= 2 * pp
            elif v > 1:
                ok = microbatches % pp == 0
            else:
                ok = microbatches >= pp
            if ok:
                yield schedule, v


def candidates(cfg: Config, devices: int, per_node: int = 0) -> list[Layout]:
    """Every layout on `devices` devices that passes the config rules' necessary conditions (the rules
    themselves are run on the layouts the search evaluates), without the knobs tried only where cheaper
    ones do not fit (full recomputation, offload: `fallbacks`). With `per_node` devices a node, also HSDP
    where it fits: ZeRO sharded over the replicas whose stage shares a node (dp_shard = per_node / (tp cp)),
    replicated across nodes, when that is more than one replica and fewer than dp."""
    out = []
    m_cfg = cfg.model
    experts = m_cfg.moe_experts
    for cp, cp_style, tp in sequence_axes(cfg, devices):
        # Splits the model cannot take are skipped in bulk, so the search stays small however many devices.
        if m_cfg.n_heads % tp or m_cfg.n_kv_heads % tp or m_cfg.seq_len % cp:
            continue
        for pp in _divisors(devices // (tp * cp)):
            dp = devices // (tp * cp * pp)
            if cfg.train.global_batch % dp or pp > m_cfg.n_layers:
                continue
            eps = [ep for ep in _divisors(dp) if experts % ep == 0] if experts else [1]
            for microbatches in _divisors(cfg.train.global_batch // dp):
                for (schedule, v), sp, ep, recompute in itertools.product(
                    _pipelines(cfg, pp, microbatches), (False, True) if tp > 1 else (False,), eps,
                    [r for r in RECOMPUTE if r != FULL],
                ):
                    # ZeRO-3 gathers around each unit's one forward and one backward (rules: one chunk)
                    split = SCHEDULES[schedule].splits_backward
                    zeros = [z for z in zero_stages(cfg) if dp * cp > 1 or z == 0]
                    zeros = [z for z in zeros if not (ZERO_STAGES[z].shards_parameters and (v > 1 or split))]
                    shard = per_node // (tp * cp)
                    # (rules: whole EP groups in a shard group)
                    hsdp = (shard,) if 2 <= shard < dp and not dp % shard and not shard % ep else ()
                    out += [
                        Layout(dp, pp, tp, z, recompute, microbatches, v, cp, cp_style, sp, ep, schedule,
                               NO_OFFLOAD, dp_shard)
                        for z in zeros
                        for dp_shard in ((0, *hsdp) if z else (0,))
                    ]
    return out


def fallbacks(cfg: Config, layout: Layout) -> list[Layout]:
    """The slower knobs, tried where `layout` does not fit: full recomputation in place of selective,
    offload of the sharded optimizer where the layout shards it."""
    out = []
    if layout.recompute == SELECTIVE:
        out.append(dataclasses.replace(layout, recompute=FULL))
    if ZERO_STAGES[layout.zero].shards_optimizer and layout.offload == NO_OFFLOAD:
        out.append(dataclasses.replace(layout, offload=CPU_OFFLOAD))
    return out


def _bound(cfg: Config, layout: Layout, device: Device, mfu: float) -> float:
    """A lower bound of the layout's predicted step time (`cfg` has its knobs): its compute, bubble and
    tp/cp/ep collectives, without the pipeline's hops and the exposed DP traffic, which only add."""
    compute = rank_compute_s(cfg, layout, device, mfu)
    ratio = bubble_ratio(cfg.parallel.schedule, layout.pp, layout.microbatches, layout.virtual_stages)
    held = [[i for chunk in chunks for i in chunk] for chunks in rank_chunks(cfg, layout)]
    moe_layers = max(sum(map(functools.partial(is_moe_layer, cfg.model), rank)) for rank in held)
    return compute * (1 + ratio) + axes_comm_s(cfg, layout, device, max(map(len, held)), moe_layers)


def plan(
    cfg: Config, devices: int, memory: float, device: Device, mfu: float = 0.4, top: int | None = None,
    tie: float = 0.03,
) -> list[Prediction]:
    """Valid layouts on `devices` devices with their predictions, unordered (raypar.core.planner.rank
    orders them). `top` None: every one. Else only fitting ones, and the search stops once no layout left
    could rank among the `top` fastest or within `tie` of the fastest; if none fits, every one (the
    nearest are wanted)."""
    if devices > MAX_DEVICES:
        raise ConfigError(f"--devices: at most {MAX_DEVICES:,} (the search is over divisors of it), got "
                          f"{devices:,}")
    bounds: dict[tuple[object, ...], float] = {}
    queue = []
    for i, layout in enumerate(candidates(cfg, devices, device.per_node)):
        # The bound depends on neither zero nor offload: computed once per the rest.
        key = (layout.dp, layout.pp, layout.tp, layout.cp, layout.cp_style, layout.sequence_parallel,
               layout.ep, layout.microbatches, layout.virtual_stages, layout.schedule, layout.recompute)
        if key not in bounds:
            bounds[key] = _bound(with_layout(cfg, layout), layout, device, mfu)
        queue.append((bounds[key], i, layout, None))
    heapq.heapify(queue)
    counter = itertools.count(len(queue))
    states: dict[tuple[object, ...], float] = {}
    tried: set[Layout] = set()
    over: list[tuple[float, int, Layout]] = []  # (memory, or its model states alone, ...) of those over
    fitting: list[float] = []  # the `top` fastest fitting step times found, negated (a max-heap)
    best = math.inf
    out = []
    while queue:
        bound, _, layout, times = heapq.heappop(queue)
        if top is not None and len(fitting) >= top and bound > max(-fitting[0], best * (1 + tie)):
            break
        layout_cfg = with_layout(cfg, layout)
        if times is None:  # the bound was compute and collectives only: back in line at the whole time
            times = step_times(layout_cfg, layout, device, mfu)
            heapq.heappush(queue, (sum(times), next(counter), layout, times))
            continue
        # Model states alone, the same for every microbatch count, recompute and cp style: where they do
        # not fit, neither schedule nor activations are worked out (in top mode).
        key = (layout.dp, layout.pp, layout.tp, layout.cp, layout.ep, layout.zero, layout.virtual_stages,
               SCHEDULES[layout_cfg.parallel.schedule].v_shape, layout_cfg.train.offload)
        if key not in states:
            chunks = rank_chunks(layout_cfg, layout)
            states[key] = max(rank_states(layout_cfg, layout, p, held)[1] for p, held in enumerate(chunks))
        if top is not None and states[key] > memory:
            fits, need = False, states[key]
        else:
            pred = predict(layout_cfg, layout, device, mfu, times=times)
            fits, need = pred.memory_bytes <= memory, pred.memory_bytes
            pred.fits = fits
        if not fits:
            for slower in set(fallbacks(cfg, layout)) - tried:  # full+offload is reached two ways
                tried.add(slower)
                heapq.heappush(queue, (_bound(with_layout(cfg, slower), slower, device, mfu), next(counter),
                                       slower, None))
            if top is not None:  # not shown when some layout fits; else the nearest are
                over.append((need, next(counter), layout))
                continue
        try:
            rules.validate(layout_cfg)
        except ConfigError:
            continue  # a layout `raypar train` would refuse is never listed
        out.append(pred)
        if fits:
            best = min(best, pred.step_time_s)
            heapq.heappush(fitting, -pred.step_time_s)
            if top is not None and len(fitting) > top:
                heapq.heappop(fitting)
    if top is not None and not out:  # nothing fits: the layouts needing the least memory, predicted in full
        for _, _, layout in heapq.nsmallest(NEAREST, over):
            try:
                layout_cfg = layout_config(cfg, layout)
            except ConfigError:
                continue
            out.append(predict(layout_cfg, layout, device, mfu))
            out[-1].fits = False
    return out


def current_layout(cfg: Config) -> Layout:
    return Layout(
        cfg.dp_fixed,
        cfg.parallel.pp,
        cfg.parallel.tp,
        getattr(cfg.parallel, "zero", 0),
        cfg.train.recompute,
        cfg.parallel.microbatches,
        cfg.parallel.virtual_stages,
        cfg.parallel.cp,
        cfg.parallel.cp_style,
        cfg.parallel.sequence_parallel,
        cfg.parallel.ep,
        cfg.parallel.schedule,
        cfg.train.offload,
        cfg.parallel.dp_shard,
    )


def knobs(cfg: Config, layout: Layout, device: Device) -> list[tuple[str, float]]:
    """("section.key=value", predicted memory) for each single knob `raypar train` accepts on `layout`,
    cheapest in time first: recomputation, a higher ZeRO stage, offload, more microbatches."""
    tries = [dataclasses.replace(layout, recompute=r) for r in (SELECTIVE, FULL) if r != layout.recompute]
    tries += [dataclasses.replace(layout, zero=z) for z in zero_stages(cfg) if z > layout.zero]
    tries += [dataclasses.replace(layout, offload=CPU_OFFLOAD)] if layout.offload in ("", NO_OFFLOAD) else []
    tries += [dataclasses.replace(layout, microbatches=layout.microbatches * 2)]
    out = []
    for knob in tries:
        try:
            knob_cfg = layout_config(cfg, knob)
        except ConfigError:
            continue
        key = next(k for k in ("recompute", "zero", "offload", "microbatches")
                   if getattr(knob, k) != getattr(layout, k))
        section = "train" if key in ("recompute", "offload") else "parallel"
        need = predict(knob_cfg, knob, device, 0.4).memory_bytes
        out.append((f"{section}.{key}={getattr(knob, key)}", need))
    return out


def fitting_knob(cfg: Config, layout: Layout, memory: float, device: Device) -> str | None:
    """The first single knob ("section.key=value") that makes `layout` fit `memory`; None if none does."""
    return next((knob for knob, need in knobs(cfg, layout, device) if need <= memory), None)


def check_fits(cfg: Config, memory: float, device: Device, where: str) -> None:
    """Raise ConfigError naming one knob to turn if the config's own layout is predicted not to fit."""
    layout = current_layout(cfg)
    need = predict(cfg, layout, device, 0.4).memory_bytes
    if need <= memory:
        return
    knob = fitting_knob(cfg, layout, memory, device)
    if knob:
        raise ConfigError(
            f"{knob.split('=')[0]}: the plan predicts {gib(need)} per actor > {gib(memory)} on {where}; set "
            f"{knob} (see `raypar plan`)"
        )
    raise ConfigError(
        f"parallel.tp/pp: the plan predicts {gib(need)} per actor > {gib(memory)} on {where}, and no "
        "single knob fits; more devices (pp or tp) are needed (see `raypar plan`)"
    )


def check_local_memory(cfg: Config, address: str | None) -> None:
    """A run on a new local Ray (`address` None or "local": no cluster named) with parallel.device "cpu", or
    "auto" where no CUDA device is seen, puts every actor on this machine: refuse it when the actors' model
    states alone (parameters, gradients, Adam moments, 16-bit: fp32 masters; raypar.core.planner.memory)
    exceed the memory available here, instead of actors trying to allocate them. Activations come on top,
    so passing does not promise a fit. A cluster's nodes are not this machine, and GPU layouts are checked
    against the GPU (`check_fits`): neither is checked here."""
    if address not in (None, "local") or cfg.parallel.device not in ("cpu", "auto"):
        return
    import torch

    if cfg.parallel.device == "auto" and torch.cuda.is_available():
        return
    layout = current_layout(cfg)
    chunks = rank_chunks(cfg, layout)
    ranks = [rank_states(cfg, layout, p, held)[1] for p, held in enumerate(chunks)]
    replicas = layout.dp * layout.cp * layout.tp  # actors per pipeline rank
    need, have = replicas * sum(ranks), available_memory()
    if need > have:
        m = cfg.model
        raise ConfigError(
            f"model: d_model={m.d_model}, n_layers={m.n_layers}, vocab_size={m.vocab_size} needs "
            f"{need / 2**30:,.1f} GiB of model states on this machine (a local Ray's {layout.world} "
            f"actor(s), up to {max(ranks) / 2**30:,.1f} GiB each: parameters, gradients, Adam moments, "
            f"masters), and it has {have / 2**30:,.1f} GiB available (a smaller model, or a cluster's "
            "--address)"
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


