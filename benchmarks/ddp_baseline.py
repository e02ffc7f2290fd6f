"""The torch DDP side of `train_throughput.py --part dp`: run under torchrun, one process per rank.

    python -m torch.distributed.run --nproc_per_node 2 --standalone benchmarks/ddp_baseline.py \
        --preset small --set model.seq_len=128 --set train.global_batch=8 --steps 4 --out ddp.json
    python -m torch.distributed.run --nproc_per_node 2 --standalone benchmarks/ddp_baseline.py \
        --quick --out ddp.json                            # smoke run: tiny model, one step, no warm-up

Each rank builds `_common.PlainLoop` (raypar's stage, same init, same global sampler, AdamW,
clip_grad_norm_) wrapped in `DistributedDataParallel(bucket_cap_mb=--bucket-mb)` on the gloo default group,
with `torch.set_num_threads(--threads)`, and takes rows [rank * B/world, (rank + 1) * B/world) of every global
batch, as raypar's replica `rank` does. After `--warmup` untimed steps it times `--steps` steps; rank 0 writes
its per-step seconds and losses, and the CPU seconds per step summed over the ranks, to `--out` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from benchmarks import _common  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny, 1 step, no warm-up")
    args = parser.parse_args()
    if args.quick:
        args.preset, args.steps, args.warmup = "tiny", 1, 0
        args.set = [*args.set, "train.global_batch=4"]

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = _common.make_config(args.preset, args.set)

    def wrap(model: torch.nn.Module) -> DistributedDataParallel:
        return DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb)

    loop = _common.PlainLoop(cfg, wrap=wrap, rank=rank, world=world)
    times, cpu, losses = [], [], []
    for step in range(args.warmup + args.steps):
        seconds, loss = loop.step(step)
        losses.append(loss)
        if step >= args.warmup:
            times.append(seconds)
            cpu.append(loop.last_cpu_s)
    cpu_all = torch.tensor(cpu, dtype=torch.float64)
    dist.all_reduce(cpu_all)  # CPU seconds per step, summed over the ranks
    if rank == 0:
        result = {"step_s": times, "cpu_s": cpu_all.tolist(), "losses": losses, "world": world}
        with open(args.out, "w") as f:
            json.dump({**result, "threads": args.threads}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
