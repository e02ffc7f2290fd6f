"""The experts as one grouped GEMM (torch._grouped_mm) against one matmul chain per expert, at moe-small.

One replica's share of a moe-small training step, in one process holding every expert (ep = 1, so the
difference is the expert compute alone, not the all-to-all): the config's microbatches of random tokens
(global_batch / (dp * microbatches) sequences of seq_len each), forward with the aux loss, backward. The
same model, routing and numbers both ways (tests/unit/test_moe_dropless.py checks that); only the expert
kernel differs: raypar.core.model.moe.grouped_partial, or tests.support.moe_threads.LoopedExperts. Both
routings: dropless (capacity factor 0) and the config's capacity factor. Median of `--repeats` steps after
one warm-up step; also the MoE layers' share of it (their forward and backward, timed by hooks... no: by
running the MoE layers alone on the same tokens, so that no timer sits inside the step).

    python benchmarks/moe_grouped.py [--quick] [--repeats N] [--threads N] [--json FILE]

The numbers in benchmarks/results/moe_grouped.md need a quiet machine; --quick (the tiny model) only proves
the script runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

# benchmarks/collectives.py would shadow the `collectives` package: the repository root goes first.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import torch  # noqa: E402

from raypar.core.config.schema import Config  # noqa: E402
from raypar.core.model.llama import LlamaStage  # noqa: E402
from raypar.core.model.moe import MoELayer  # noqa: E402
from raypar.core.run_config import load_config  # noqa: E402
from tests.support.moe_threads import LoopedExperts  # noqa: E402

KERNELS: dict[str, type[MoELayer]] = {"grouped": MoELayer, "loop": LoopedExperts}


def config(quick: bool, capacity_factor: float | None = None) -> Config:
    """moe-small.toml at one process; quick: the test suite's tiny model with 8 experts, every other block.
    `capacity_factor`: the routing's (None: the config's)."""
    root = os.path.dirname(_HERE)
    routing = [] if capacity_factor is None else [f"model.moe_capacity_factor={capacity_factor}"]
    if quick:
        moe = ["model.moe_experts=8", "model.moe_every=2", "parallel.dp=2", "parallel.microbatches=2"]
        return load_config(os.path.join(root, "examples/configs/tiny.toml"), moe + routing)
    return load_config(os.path.join(root, "examples/configs/moe-small.toml"), routing)


def step_seconds(cfg: Config, kernel: type[MoELayer], repeats: int) -> float:
    """Median wall time of one replica's forward + backward over its microbatches."""
    m = cfg.model
    model = LlamaStage(m, seed=0)
    for layer in model.moe_layers().values():
        layer.__class__ = kernel
    count = cfg.microbatches_at(cfg.dp_fixed)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(m.vocab_size, (cfg.microbatch_size, m.seq_len + 1), generator=gen)
               for _ in range(count)]  # fmt: skip

    def step() -> float:
        start = time.perf_counter()
        for tokens in batches:
            loss = model(tokens[:, :-1], tokens[:, 1:]) + model.take_aux_loss()
            (loss / count).backward()
        model.take_moe_stats()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    step()  # warm-up: allocations, kernel selection
    return statistics.median(step() for _ in range(repeats))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--quick", action="store_true", help="the tiny model, 2 steps: proves it runs")
    parser.add_argument("--repeats", type=int, default=0, help="timed steps per row (default 2 quick, 10)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (one actor's default)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    repeats = args.repeats or (2 if args.quick else 10)
    default_cf = config(args.quick).model.moe_capacity_factor
    rows = []
    for cf, routing in ((0.0, "dropless"), (default_cf, f"capacity {default_cf}")):
        cfg = config(args.quick, cf)
        times = {name: step_seconds(cfg, kernel, repeats) for name, kernel in KERNELS.items()}
        rows.append({"routing": routing, **{f"{k}_s": v for k, v in times.items()},
                     "speedup": times["loop"] / times["grouped"]})  # fmt: skip
        print(f"{routing:>14}: grouped {times['grouped'] * 1e3:7.1f} ms   loop {times['loop'] * 1e3:7.1f} ms"
              f"   speed-up x{times['loop'] / times['grouped']:.2f}")
    result = {"model": "tiny (8 experts)" if args.quick else "moe-small", "threads": args.threads,
              "repeats": repeats, "rows": rows}  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
