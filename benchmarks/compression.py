"""Gradient compression for the DP reduction, side by side: bytes on the wire, step time, final loss.

    python benchmarks/compression.py            # `small`, dp 2, 200 steps per compressor: a markdown table
    python benchmarks/compression.py --quick    # `tiny`, dp 2, 12 steps (the test suite runs this)

Every compressor trains the same model from the same seed on the same samples (raypar's global sampler,
synthetic data) with ZeRO 0, the config's AdamW and learning-rate schedule. Ranks are threads of this
process joined by a gloo group (tests/support/threads.py), so bytes are exact
(`DPStrategy.traffic["reduce_bytes"]` of DP rank 0, per step, after compression starts) while step times
are only indicative (the ranks share this machine's cores). Final loss: the mean training loss over the
last 10 % of steps (at least one), averaged over replicas.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raypar.core import data  # noqa: E402
from raypar.core.config.options import COMPRESSIONS  # noqa: E402
from raypar.core.config.schema import Config  # noqa: E402
from raypar.core.dp import compress  # noqa: E402
from raypar.core.dp.optim import lr_at  # noqa: E402
from raypar.core.dp.strategy import DPStrategy, StrategySpec  # noqa: E402
from raypar.core.model import families  # noqa: E402
from raypar.core.run_config import load_config  # noqa: E402
from tests.support.threads import run_ranks  # noqa: E402


def train(cfg: Config, dp: int, name: str, steps: int) -> dict[str, float]:
    """`steps` steps at dp ranks with compressor `name`; rank 0's bytes and times, all ranks' losses."""
    m, par = cfg.model, cfg.parallel

    def rank(group):
        model = families.build_stage(m, seed=cfg.train.seed)
        compressor = compress.build(dataclasses.replace(par, grad_compression=name), cfg.train.seed)
        spec = StrategySpec(cfg.train, int(par.bucket_mb * 2**20))
        strategy = DPStrategy(model, spec=spec, group=group, compressor=compressor)
        dataset = data.open_dataset(cfg.data, m)
        sampler = data.GlobalSampler(dataset.num_samples, cfg.train.global_batch, cfg.train.seed)
        mbs = cfg.train.global_batch // dp
        losses, times, sent = [], [], []
        for step in range(steps):
            start = time.perf_counter()
            strategy.begin_step()
            strategy.arm()
            inputs, targets = data.microbatch(dataset, sampler, step, group.rank, mbs)
            loss = model(inputs, targets)
            loss.backward()
            strategy.finish()
            strategy.clip_(strategy.grad_sq_norm().sqrt().item(), cfg.train.grad_clip)
            strategy.step(lr_at(step, cfg.train))
            times.append(time.perf_counter() - start)
            sent.append(strategy.take_traffic()["reduce_bytes"])
            losses.append(loss.item())
        return losses, times, sent

    results = run_ranks(dp, rank)
    losses = [statistics.fmean(r[0][s] for r in results) for s in range(steps)]
    _, times, sent = results[0]
    tail = max(1, steps // 10)
    compressed = sent[par.compression_start_step :] or sent
    return {
        "bytes_per_step": statistics.fmean(compressed),
        "step_s": statistics.median(times[1:] or times),  # the first step warms up
        "final_loss": statistics.fmean(losses[-tail:]),
        "losses": losses,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny model, 12 steps: seconds")
    parser.add_argument("--steps", type=int, default=0, help="steps per compressor (default 200, quick 12)")
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config overrides, e.g. parallel.topk_ratio=0.05")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    preset, steps = ("tiny", 12) if args.quick else ("small", 200)
    steps = args.steps or steps
    root = Path(__file__).resolve().parents[1]
    start = 2 if args.quick else 10
    overrides = [f'model.preset="{preset}"', "train.global_batch=8", f"train.steps={steps}",
                 "train.warmup_steps=10", "parallel.topk_ratio=0.01", "parallel.powersgd_rank=4",
                 f"parallel.compression_start_step={start}", *args.set]
    cfg = load_config(root / "examples/configs/tiny.toml", overrides)
    par = cfg.parallel
    settings = {"none": "", "bf16": "", "topk": f"ratio {par.topk_ratio:g}",
                "powersgd": f"rank {par.powersgd_rank}"}
    results = {name: train(cfg, args.dp, name, steps) for name in COMPRESSIONS}
    base = results["none"]
    print(f"preset {preset}, dp {args.dp}, {steps} steps, compression from step "
          f"{par.compression_start_step}, bucket_mb {par.bucket_mb:g}")
    print("| compressor | setting | reduce bytes/step (rank 0) | vs none | step ms | final loss | vs none |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        print(f"| {name} | {settings[name]} | {r['bytes_per_step']:,.0f} | "
              f"{r['bytes_per_step'] / base['bytes_per_step']:.3f} | {1e3 * r['step_s']:.1f} | "
              f"{r['final_loss']:.4f} | {r['final_loss'] / base['final_loss']:.3f} |")
    if args.json:
        args.json.write_text(json.dumps({"preset": preset, "dp": args.dp, "steps": steps,
                                         "settings": settings, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
