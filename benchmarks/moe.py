"""Mixture of experts under expert parallelism: all-to-all traffic, step time against ep, load balance.

1. All-to-all bytes per MoE layer: what one rank sends to other ranks in one dispatch (the splits the layer
   actually used, over real gloo groups of threads), against the expectation for uniform routing without
   drops, T * k * h * bytes * (ep - 1) / ep (T tokens per rank, top-k, hidden size h). The combine sends the
   same back, and backward repeats both: 4x this per layer per microbatch.
2. Step time at ep = 1, 2, 4 side by side: one set of dp=4 actors on a local Ray, rebuilt for each ep.
3. Load balance over training steps with and without the auxiliary loss (one process, every expert):
   the coefficient of variation of the tokens per expert (0 = perfectly even) and the busiest expert's
   share over the mean share, averaged over the second half of the run, with the tokens dropped.

    python benchmarks/moe.py [--quick] [--json]

The numbers in benchmarks/results/moe.md need a quiet machine; --quick only proves the script runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from typing import Any

# benchmarks/collectives.py would shadow the `collectives` package: the repository root goes first.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import torch  # noqa: E402

from collectives import GroupSpec, LocalStoreRef, create_group  # noqa: E402
from raypar.core import data  # noqa: E402
from raypar.core.config.load import from_dict  # noqa: E402
from raypar.core.config.schema import Config  # noqa: E402
from raypar.core.dp.optim import ADAM_EPS  # noqa: E402
from raypar.core.model.llama import LlamaStage  # noqa: E402
from raypar.core.model.moe import MoELayer  # noqa: E402
from raypar.core.run_config import load_config  # noqa: E402


def model_cfg(quick: bool) -> Config:
    """moe-small.toml; quick: the test suite's tiny model with 8 experts in every other block."""
    root = os.path.dirname(_HERE)
    if not quick:
        return load_config(os.path.join(root, "examples/configs/moe-small.toml"))
    moe = ["model.moe_experts=8", "model.moe_top_k=2", "model.moe_every=2", "parallel.dp=2", "parallel.ep=2"]
    return load_config(os.path.join(root, "examples/configs/tiny.toml"), moe)


def _thread_ranks(size: int, fn: Any) -> list[Any]:
    """fn(group) on `size` threads forming one gloo group."""
    ref = LocalStoreRef()  # an in-process store: the ranks are threads of this process
    results: list[Any] = [None] * size

    def member(rank: int) -> None:
        names = tuple(f"m{i}" for i in range(size))
        results[rank] = fn(create_group(GroupSpec("ep", names, rank, ref, timeout_s=60), ref.store))

    threads = [threading.Thread(target=member, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def alltoall_bytes(cfg: Config, ep: int, tokens: int) -> dict[str, float]:
    """Bytes one rank sends to the others in one dispatch, measured from the splits used, vs the formula."""
    m = cfg.model
    h, k, itemsize = m.d_model, m.moe_top_k, 4

    def rank(group: Any) -> float:
        torch.manual_seed(group.rank)
        layer = MoELayer(m, None, group if ep > 1 else None)
        with torch.no_grad():
            for p in layer.parameters():
                p.normal_(0, 0.02)
            layer(torch.randn(tokens, h))
        kept = layer.last_kept.sum(dim=1)  # [ep, E]: rows from each rank to each expert
        to_ranks = kept.view(ep, ep, -1).sum(dim=2)[group.rank if ep > 1 else 0]
        return float(to_ranks.sum() - to_ranks[group.rank if ep > 1 else 0]) * h * itemsize

    sent = _thread_ranks(ep, rank) if ep > 1 else [0.0]
    expected = tokens * k * h * itemsize * (ep - 1) / ep
    return {"ep": ep, "tokens": tokens, "sent_bytes": statistics.mean(sent), "expected_bytes": expected}


def step_times(cfg: Config, eps: list[int], steps: int) -> dict[int, float]:
    """Median step time at each ep on one set of dp=max(eps) actors (a local Ray is started if none)."""
    from raypar.controller.actor_mesh import ActorMesh
    from raypar.controller.connection import connect

    dp = max(eps)
    connect(None, num_cpus=max(os.cpu_count() or 1, dp))

    def at(ep: int) -> Config:
        raw = cfg.to_dict()
        raw["parallel"].update(dp=dp, ep=ep, microbatches=1)
        return from_dict(raw)

    mesh = ActorMesh(at(eps[0]), f"bench-moe-{os.getpid()}")
    out = {}
    try:
        mesh.start()
        for ep in eps:
            mesh.reconfigure(at(ep))
            mesh.step(0)  # warm-up
            times = [mesh.step(s).step_time_s for s in range(1, steps + 1)]
            out[ep] = statistics.median(times)
    finally:
        mesh.shutdown()
    return out


def load_balance(cfg: Config, steps: int, coef: float) -> dict[str, float]:
    """Train one process with every expert for `steps`; the second half's load statistics."""
    m, t = cfg.model, cfg.train
    m.moe_aux_loss_coef = coef
    torch.manual_seed(0)
    model = LlamaStage(m, seed=t.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, eps=ADAM_EPS)
    dataset = data.open_dataset(cfg.data, m)
    sampler = data.GlobalSampler(dataset.num_samples, t.global_batch, t.seed)
    cvs, peaks, dropped = [], [], 0
    for step in range(steps):
        inputs, targets = data.microbatch(dataset, sampler, step, 0, t.global_batch)
        (model(inputs, targets) + model.take_aux_loss()).backward()
        opt.step()
        opt.zero_grad()
        for stats in model.take_moe_stats().values():
            if step >= steps // 2:
                load = stats.load.double()
                cvs.append(float(load.std(unbiased=False) / load.mean()))
                peaks.append(float(load.max() / load.mean()))
                dropped += stats.dropped
    return {
        "aux_coef": coef,
        "load_cv": statistics.mean(cvs),
        "max_over_mean": statistics.mean(peaks),
        "dropped": dropped,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few steps: proves the script runs")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--skip-ray", action="store_true", help="leave out the step-time section")
    args = parser.parse_args(argv)
    cfg = model_cfg(args.quick)
    tokens = 128 if args.quick else 4096
    result: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "load": os.getloadavg()[0]}}
    result["alltoall"] = [alltoall_bytes(cfg, ep, tokens) for ep in (1, 2, 4)]
    if not args.skip_ray:
        eps = [1, 2] if args.quick else [1, 2, 4]  # quick: 2 actors instead of 4
        result["step_time_s"] = step_times(cfg, eps, 1 if args.quick else 5)
    steps = 4 if args.quick else 200
    result["balance"] = [load_balance(model_cfg(args.quick), steps, c) for c in (0.0, 0.01)]
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"machine: {result['machine']}")
        for row in result["alltoall"]:
            print(
                f"ep={row['ep']}: sent {row['sent_bytes']:.0f} B per rank per dispatch, "
                f"T*k*h*4*(ep-1)/ep = {row['expected_bytes']:.0f} B"
            )
        for ep, seconds in result.get("step_time_s", {}).items():
            print(f"step time ep={ep}: {seconds * 1000:.0f} ms")
        for row in result["balance"]:
            print(
                f"aux coef {row['aux_coef']}: load CV {row['load_cv']:.3f}, busiest/mean "
                f"{row['max_over_mean']:.2f}, dropped {row['dropped']} (second half of {steps} steps)"
            )
    return result


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    print(f"({time.perf_counter() - start:.0f}s)", file=sys.stderr)
