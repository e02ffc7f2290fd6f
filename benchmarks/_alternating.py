"""What the one-process benchmarks that time variants of a model in alternating blocks share (recompute.py,
families.py): their command line, and the header line saying what was run on how loaded a machine."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch


def parse(description: str, what: str, argv: list[str] | None) -> tuple[argparse.Namespace, str, int, int]:
    """The arguments, torch's thread count set from them, and (preset, blocks, iterations per block): `tiny`
    and a few iterations under --quick. `what`: the variants' name in the help."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="tiny model, few iterations: seconds")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch", type=int, default=8, help="sequences per microbatch")
    parser.add_argument("--blocks", type=int, default=6, help=f"alternating blocks per {what}")
    parser.add_argument("--per-block", type=int, default=3, help="iterations per block")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    preset, blocks, per_block = ("tiny", 2, 2) if args.quick else (args.preset, args.blocks, args.per_block)
    return args, preset, blocks, per_block


def header(args: argparse.Namespace, preset: str) -> str:
    return (f"preset {preset}, microbatch {args.batch}, {args.threads} thread(s), load average "
            f"{os.getloadavg()[0]:.1f}")
