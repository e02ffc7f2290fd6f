"""Model-state memory per rank under ZeRO 0-3, measured against the formulas, with step time and DP bytes.

    python benchmarks/zero_memory.py            # `small`, dp 1 2 4, pp 1 2: a markdown table
    python benchmarks/zero_memory.py --quick    # `tiny`, dp 1 2, pp 1 (the test suite runs this)

Ranks are threads of this process joined by a gloo group (tests/support/threads.py), so bytes are exact while
step times are only indicative (the ranks share this machine's cores). Measured: the unique storages of
parameters, gradients, master weights and moments of stage 0 on DP rank 0 after a step
(`DPStrategy.model_state_bytes`). Ψ = that stage's parameters. For fp32 parameters (their own master
below stage 3) the formulas are 16Ψ, 8Ψ+8Ψ/d, 4Ψ+12Ψ/d and 16Ψ/d; the 16-bit-parameter formulas of the
ZeRO paper (16Ψ, 4Ψ+12Ψ/d, 2Ψ+14Ψ/d, 16Ψ/d) apply once parameters are bf16 with fp32 masters.

HSDP rows (`parallel.dp_shard`, raypar.core.dp.hsdp): dp=4 in shard groups of 2, ZeRO 1-3. The state is
sharded over the shard group, so the formulas above hold with d = dp_shard, exactly, for Ψ counted as the
strategy lays it out (each bucket padded to a multiple of dp_shard). DP bytes a rank sends per step, per
bucket piece q = padded/s of w bytes (s = dp_shard, r = dp/s groups): (s-1)·q·w reduce-scattered and
2·q·w·(r-1)/r all-reduced across the groups (the only bytes that leave a node when a shard group fits on
one), then (s-1)·q·w all-gathered in the group (ZeRO-1/2: the update; ZeRO-3: every unit's parameters for
the forward and again for the backward).

HSDP rows of an MoE model (4 experts in every other block, ep=2): the dense and the expert strategy each
against the same formulas, the experts' d being their holders in the shard group (dp_shard / ep; at d = 1 the
shard group holds one copy, which is all-reduced across the groups, nothing gathered).

HSDP overlap rows: the all-reduce across groups chained after each bucket's reduce-scatter during backward
(raypar.core.dp.hsdp) against started in `finish` after the whole backward (the behaviour before; the
test suite's negative control), alternated on the same ranks; the slowest rank's forward + backward + finish
per step and the part `finish` waits (the reduction the backward did not hide).

Offload rows (`train.offload = "cpu"`, stages 1-3): the host holds a separate master (4Ψ/d), the moments
(8Ψ/d) and a gradient buffer (4Ψ/d); the device keeps parameters and gradients: 8Ψ at stage 1, 4Ψ+4Ψ/d at
stage 2, and at stage 3 the owned gradient and a copy of the owned parameters (8Ψ/d). Totals 8Ψ+16Ψ/d,
4Ψ+20Ψ/d and 24Ψ/d; here the device is the CPU too, so the column is their sum.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dataclasses  # noqa: E402

from raypar.core import data  # noqa: E402
from raypar.core.config.schema import Config  # noqa: E402
from raypar.core.dp.strategies import STRATEGIES  # noqa: E402
from raypar.core.dp.strategy import DPStrategy, StrategySpec  # noqa: E402
from raypar.core.model import families  # noqa: E402
from raypar.core.model.stage import StageSpec  # noqa: E402
from raypar.core.parallel.mesh import Coord, stage_layers  # noqa: E402
from raypar.core.run_config import load_config  # noqa: E402
from tests.support import moe_threads  # noqa: E402
from tests.support.dp_threads import AcrossAtFinish, hsdp_groups, strategy_class  # noqa: E402
from tests.support.threads import run_groups, run_ranks  # noqa: E402

FP32_FORMULA = {0: lambda d: 16.0, 1: lambda d: 8 + 8 / d, 2: lambda d: 4 + 12 / d, 3: lambda d: 16 / d}
OFFLOAD_FORMULA = {1: lambda d: 8 + 16 / d, 2: lambda d: 4 + 20 / d, 3: lambda d: 24 / d}


def measure(cfg: Config, dp: int, pp: int, zero: int, steps: int, offload: str) -> dict[str, float]:
    m = cfg.model
    train = dataclasses.replace(cfg.train, offload=offload)
    layers = stage_layers(m.n_layers, pp)[0]

    def rank(group):
        model = families.build_stage(m, stage=StageSpec((layers,), True, pp == 1), seed=cfg.train.seed)
        psi = sum(p.numel() for p in model.parameters())
        spec = StrategySpec(train, int(cfg.parallel.bucket_mb * 2**20))
        strategy = STRATEGIES[zero](model, spec=spec, group=group)
        dataset = data.open_dataset(cfg.data, m)
        sampler = data.GlobalSampler(dataset.num_samples, cfg.train.global_batch, cfg.train.seed)
        mbs, r = cfg.train.global_batch // dp, group.rank if group is not None else 0
        times, traffic = [], 0
        for step in range(steps + 1):  # the first step warms up
            start = time.perf_counter()
            strategy.begin_step()
            strategy.arm()
            inputs, targets = data.microbatch(dataset, sampler, step, r, mbs)
            out = model(inputs, targets if pp == 1 else None)
            # stage 0 of a pipeline has no loss: any scalar of its output drives the same backward shape
            (out if pp == 1 else out.float().pow(2).mean()).backward()
            strategy.finish()
            strategy.clip_(strategy.grad_sq_norm().sqrt().item(), 1.0)
            strategy.step(cfg.train.lr)
            moved = strategy.take_traffic()
            if step:
                times.append(time.perf_counter() - start)
                traffic += moved["reduce_bytes"] + moved["gather_bytes"]
        return psi, sum(strategy.model_state_bytes().values()), sum(times) / steps, traffic / steps

    psi, measured, step_s, moved = run_ranks(dp, rank)[0] if dp > 1 else rank(None)
    formula = (OFFLOAD_FORMULA if offload == "cpu" else FP32_FORMULA)[zero](dp)
    return {"psi": psi, "bytes": measured, "formula": formula * psi, "step_s": step_s, "moved": moved}


def hsdp_steps(
    cfg: Config, dp: int, shard: int, zero: int, steps: int, control: type[DPStrategy] | None = None
) -> list[tuple]:
    """`steps` steps at dp in shard groups of `shard` on thread ranks (`control`: a strategy's overrides);
    per rank: model-state bytes, DP traffic of the last step, bucket pieces, and per step the seconds of
    forward + backward + `finish` and of `finish` alone (what the backward left of the reduction)."""
    m = cfg.model

    def rank(r: int, groups: dict) -> tuple:
        shard_group = next(g for n, g in groups.items() if n.startswith("dps"))
        replicate = next(g for n, g in groups.items() if n.startswith("dpr"))
        model = families.build_stage(m, seed=cfg.train.seed)
        spec = StrategySpec(cfg.train, int(cfg.parallel.bucket_mb * 2**20))
        strategy = strategy_class(zero, control)(model, spec=spec, group=shard_group, replicate=replicate)
        dataset = data.open_dataset(cfg.data, m)
        sampler = data.GlobalSampler(dataset.num_samples, cfg.train.global_batch, cfg.train.seed)
        times = []
        for step in range(steps):
            strategy.take_traffic()
            strategy.begin_step()
            strategy.arm()
            inputs, targets = data.microbatch(dataset, sampler, step, r, cfg.train.global_batch // dp)
            start = time.perf_counter()
            model(inputs, targets).backward()
            reduce_from = time.perf_counter()
            strategy.finish()
            end = time.perf_counter()
            times.append((end - start, end - reduce_from))
            strategy.clip_(strategy.grad_sq_norm().sqrt().item(), 1.0)
            strategy.step(cfg.train.lr)
        moved = strategy.take_traffic()
        pieces = [b.padded // shard for b in strategy.layout.buckets]
        return sum(strategy.model_state_bytes().values()), moved, pieces, times

    return run_groups(dp, hsdp_groups(dp, shard), rank)


def measure_hsdp(cfg: Config, dp: int, shard: int, zero: int) -> dict[str, float]:
    """One step at dp in shard groups of `shard` on thread ranks; rank 0's bytes and DP traffic against the
    formulas (exact: Ψ counted padded, as the strategy lays it out)."""
    measured, moved, pieces, _ = hsdp_steps(cfg, dp, shard, zero, 1)[0]
    w, groups = 4, dp // shard
    across = sum(2 * q * (groups - 1) // groups * w for q in pieces)
    gathers = 2 if STRATEGIES[zero].stage.shards_parameters else 1
    formula = {
        "bytes": FP32_FORMULA[zero](shard) * sum(pieces) * shard,
        "reduce": sum(q * (shard - 1) * w for q in pieces) + across,
        "gather": gathers * sum(q * (shard - 1) * w for q in pieces),
        "across": across,
    }
    return {"bytes": measured, **{f"moved_{k}": v for k, v in moved.items()}, "formula": formula}


def hsdp_table(cfg: Config) -> float:
    """Prints the HSDP rows; returns the largest relative deviation from the formulas (0: exact)."""
    print("\n| dp | dp_shard | zero | measured MiB | formula MiB | DP reduce B/step (formula) "
          "| DP gather B/step (formula) | across groups B/step |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    worst = 0.0
    for zero in (1, 2, 3):
        r = measure_hsdp(cfg, 4, 2, zero)
        f = r["formula"]
        pairs = ((r["bytes"], f["bytes"]), (r["moved_reduce_bytes"], f["reduce"]),
                 (r["moved_gather_bytes"], f["gather"]))  # fmt: skip
        worst = max([worst] + [abs(a / b - 1) for a, b in pairs])
        print(f"| 4 | 2 | {zero} | {r['bytes'] / 2**20:.3f} | {f['bytes'] / 2**20:.3f} "
              f"| {r['moved_reduce_bytes']:,} ({f['reduce']:,}) "
              f"| {r['moved_gather_bytes']:,} ({f['gather']:,}) | {f['across']:,} |")
    return worst


def hsdp_moe_table(cfg: Config) -> float:
    """Prints the HSDP rows of an MoE model (tests/support/moe_threads.py, one step and one update): each
    strategy's bytes on rank 0 against the formula with d = its sharding group (dense: dp_shard; experts:
    their holders in the shard group, dp_shard / ep), and the experts' DP bytes sent against the same
    reduce-scatter + across-group all-reduce + all-gather count as the dense rows'. Returns the largest
    relative deviation (0: exact). One microbatch per replica, the global batch of `cfg`."""
    print("\n| dp | dp_shard | ep | zero | part | Ψ (padded) | d | measured MiB | formula MiB "
          "| DP reduce B/step (formula) | DP gather B/step (formula) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    worst = 0.0
    for dp, shard, ep in ((4, 2, 2), (8, 4, 2)):
        for zero in (1, 2, 3):
            moe = dataclasses.replace(cfg.model, moe_experts=4, moe_every=2, moe_capacity_factor=0.0)
            par = dataclasses.replace(cfg.parallel, dp=dp, dp_shard=shard, ep=ep, zero=zero, microbatches=1)
            run_cfg = dataclasses.replace(cfg, model=moe, parallel=par)
            got = moe_threads.parallel(run_cfg, lr=1e-3)
            (state,) = [s for coord, s in got["state"].items() if coord == Coord(0, 0, 0)]
            for part, d in (("dense", shard), ("experts", shard // ep)):
                measured, padded, moved = state[part]
                q, w, groups = padded // d, 4, dp // shard
                # the update's all-gather; ZeRO-3: each unit's forward and backward, per microbatch
                units = 2 * run_cfg.microbatches_at(dp)
                gathers = (units if STRATEGIES[zero].stage.shards_parameters else 1) if d > 1 else 0
                across = 2 * q * (groups - 1) // groups * w
                within = q * (d - 1) * w  # a reduce-scatter's (or an all-gather's) bytes in the group
                formula = (FP32_FORMULA[zero](d) * padded, within + across, gathers * within)
                pairs = ((measured, formula[0]), (moved["reduce_bytes"], formula[1]),
                         (moved["gather_bytes"], formula[2]))  # fmt: skip
                worst = max([worst] + [abs(a / b - 1) if b else float(a != 0) for a, b in pairs])
                print(f"| {dp} | {shard} | {ep} | {zero} | {part} | {padded:,} | {d} "
                      f"| {measured / 2**20:.3f} | {formula[0] / 2**20:.3f} "
                      f"| {moved['reduce_bytes']:,} ({formula[1]:,}) "
                      f"| {moved['gather_bytes']:,} ({formula[2]:,}) |")
    return worst


def hsdp_overlap_table(cfg: Config, rounds: int, steps: int) -> None:
    """HSDP's all-reduce across groups chained during backward (raypar.core.dp.hsdp) against started in
    `finish` (tests.support.dp_threads.AcrossAtFinish, the behaviour before), alternated `rounds` times;
    per step the slowest rank's forward + backward + finish and its finish alone, medians after the first
    step of each run (warm-up)."""
    print("\n| dp | dp_shard | zero | fwd+bwd+finish s: chained | at finish | ratio "
          "| finish wait s: chained | at finish |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for zero in (2, 3):
        got: dict[str, list[tuple[float, float]]] = {"chained": [], "at finish": []}
        for _ in range(rounds):
            for name, control in (("chained", None), ("at finish", AcrossAtFinish)):
                ranks = [r[3] for r in hsdp_steps(cfg, 4, 2, zero, steps, control)]
                got[name] += [max(per_rank) for per_rank in zip(*ranks, strict=True)][1:]
        step = {k: statistics.median(t for t, _ in v) for k, v in got.items()}
        wait = {k: statistics.median(f for _, f in v) for k, v in got.items()}
        chained, at_finish = step["chained"], step["at finish"]
        print(f"| 4 | 2 | {zero} | {chained:.3f} | {at_finish:.3f} | {at_finish / chained:.2f}x "
              f"| {wait['chained']:.4f} | {wait['at finish']:.4f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny model, dp 1 and 2, pp 1: seconds")
    args = parser.parse_args(argv)
    preset, dps, pps, steps = ("tiny", (1, 2), (1,), 1) if args.quick else ("small", (1, 2, 4), (1, 2), 3)
    root = Path(__file__).resolve().parents[1]
    overrides = [f'model.preset="{preset}"', "train.global_batch=8"]
    cfg = load_config(root / "examples/configs/tiny.toml", overrides)
    print("| pp | dp | zero | offload | Ψ (stage 0) | measured MiB | formula MiB | measured/formula | step s "
          "| DP MiB/step |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    worst = 0.0
    for pp in pps:
        for dp in dps:
            offloadable = [z for z, cls in STRATEGIES.items() if cls.stage.shards_optimizer]
            for zero, offload in [(z, "none") for z in STRATEGIES] + [(z, "cpu") for z in offloadable]:
                r = measure(cfg, dp, pp, zero, steps, offload)
                ratio = r["bytes"] / r["formula"]
                worst = max(worst, abs(ratio - 1))
                print(f"| {pp} | {dp} | {zero} | {offload} | {r['psi']:,} | {r['bytes'] / 2**20:.2f} | "
                      f"{r['formula'] / 2**20:.2f} | {ratio:.3f} | {r['step_s']:.3f} "
                      f"| {r['moved'] / 2**20:.2f} |")
    print(f"largest deviation from the formula: {100 * worst:.2f} %")
    hsdp = hsdp_table(cfg)
    print(f"HSDP: largest deviation from the formulas: {100 * hsdp:.2f} % (Ψ counted padded)")
    hsdp_moe = hsdp_moe_table(cfg)
    print(f"HSDP with experts: largest deviation from the formulas: {100 * hsdp_moe:.2f} %")
    hsdp_overlap_table(cfg, *((1, 2) if args.quick else (3, 6)))
    return 0 if worst <= 0.05 and hsdp == 0 and hsdp_moe == 0 else 1


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
