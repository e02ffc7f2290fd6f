"""Model-state memory per rank under ZeRO 0-3, measured against the formulas, with step time and DP bytes.

    python benchmarks/zero_memory.py            # `small`, dp 1 2 4, pp 1 2: a markdown table
    python benchmarks/zero_memory.py --quick    # `tiny`, dp 1 2, pp 1 (the test suite runs this)

Ranks are threads of this process joined by a gloo group (tests/support/threads.py), so bytes are exact while
step times are only indicative (the ranks share this machine's cores). Measured: the unique storages of
parameters, gradients, master weights and moments of stage 0 on DP rank 0 after a step
(`DPStrategy.model_state_bytes`). Ψ = that stage's parameters. For fp32 parameters (their own master
below stage 3) the formulas are 16Ψ, 8Ψ+8Ψ/d, 4Ψ+12Ψ/d and 16Ψ/d; the 16-bit-parameter formulas of the
ZeRO paper (16Ψ, 4Ψ+12Ψ/d, 2Ψ+14Ψ/d, 16Ψ/d) apply once parameters are bf16 with fp32 masters.

Offload rows (`train.offload = "cpu"`, stages 1-3): the host holds a separate master (4Ψ/d), the moments
(8Ψ/d) and a gradient buffer (4Ψ/d); the device keeps parameters and gradients: 8Ψ at stage 1, 4Ψ+4Ψ/d at
stage 2, and at stage 3 the owned gradient and a copy of the owned parameters (8Ψ/d). Totals 8Ψ+16Ψ/d,
4Ψ+20Ψ/d and 24Ψ/d; here the device is the CPU too, so the column is their sum.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dataclasses  # noqa: E402

from raypar.core.config.schema import Config  # noqa: E402
from raypar.core.data import datasets as data  # noqa: E402
from raypar.core.dp.strategy import DPStrategy  # noqa: E402
from raypar.core.dp.zero3 import Zero3Strategy  # noqa: E402
from raypar.core.model.llama import LlamaStage  # noqa: E402
from raypar.core.parallel.mesh import stage_layers  # noqa: E402
from raypar.core.run_config import load_config  # noqa: E402
from tests.support.threads import run_ranks  # noqa: E402

FP32_FORMULA = {0: lambda d: 16.0, 1: lambda d: 8 + 8 / d, 2: lambda d: 4 + 12 / d, 3: lambda d: 16 / d}
OFFLOAD_FORMULA = {1: lambda d: 8 + 16 / d, 2: lambda d: 4 + 20 / d, 3: lambda d: 24 / d}


def measure(cfg: Config, dp: int, pp: int, zero: int, steps: int, offload: str) -> dict[str, float]:
    m = cfg.model
    train = dataclasses.replace(cfg.train, offload=offload)
    layers = stage_layers(m.n_layers, pp)[0]

    def rank(group):
        model = LlamaStage(m, layers, True, pp == 1, None, cfg.train.seed)
        psi = sum(p.numel() for p in model.parameters())
        cls = Zero3Strategy if zero == 3 else DPStrategy
        strategy = cls(model, train, group, zero, int(cfg.parallel.bucket_mb * 2**20))
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
            for zero, offload in [(z, "none") for z in (0, 1, 2, 3)] + [(z, "cpu") for z in (1, 2, 3)]:
                r = measure(cfg, dp, pp, zero, steps, offload)
                ratio = r["bytes"] / r["formula"]
                worst = max(worst, abs(ratio - 1))
                print(f"| {pp} | {dp} | {zero} | {offload} | {r['psi']:,} | {r['bytes'] / 2**20:.2f} | "
                      f"{r['formula'] / 2**20:.2f} | {ratio:.3f} | {r['step_s']:.3f} "
                      f"| {r['moved'] / 2**20:.2f} |")
    print(f"largest deviation from the formula: {100 * worst:.2f} %")
    return 0 if worst <= 0.05 else 1


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
