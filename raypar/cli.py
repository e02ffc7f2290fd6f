"""`raypar` command line. Usage and config errors: one line on stderr, exit 2, before any actor starts.
Runtime failures: one line naming the actor and the cause, exit 1."""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

from raypar import config as config_mod
from raypar.config import ConfigError


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse prints usage + message over several lines
        raise UsageError(f"{self.prog}: {message}")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="raypar", description="Data x pipeline x tensor parallel training on Ray actors")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    train = sub.add_parser("train", help="train a model from a TOML config")
    train.add_argument("config", help="TOML file with [model] [parallel] [train] [data] [checkpoint]")
    train.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a key"
    )
    train.add_argument(
        "--run-dir", type=Path, help="where config.toml and metrics.jsonl go (default runs/NAME)"
    )
    train.add_argument("--name", help="run name (default: config name + time)")
    train.add_argument("--address", help="Ray cluster: 'auto' or HOST:PORT (default: start a local Ray)")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")

    prepare = sub.add_parser("prepare", help="turn text files into byte-level token shards (Arrow IPC)")
    prepare.add_argument("globs", nargs="+", help="text file globs (** allowed)")
    prepare.add_argument("--out", required=True, type=Path, help="output directory")
    return parser


def _train(args: argparse.Namespace) -> int:
    cfg = config_mod.load(args.config, args.set)
    name = args.name or f"{Path(args.config).stem}-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    run_dir = args.run_dir or Path("runs") / name
    from raypar.driver import RunFailure, run_training  # imports Ray: only once the config is known good

    try:
        summary = run_training(cfg, name, run_dir, args.address, progress=not args.no_progress)
    except RunFailure as err:
        print(f"raypar: run {name} failed: {err}", file=sys.stderr)
        return 1
    print(
        f"raypar: run {summary['run']} done: {summary['steps']} steps, loss {summary['first_loss']:.4f} -> "
        f"{summary['final_loss']:.4f}, {summary['tokens']:,} tokens in {summary['wall_s']:.1f}s "
        f"({summary['tokens'] / summary['wall_s']:,.0f} tokens/s overall); {summary['run_dir']}/metrics.jsonl"
    )
    return 0


def _prepare(args: argparse.Namespace) -> int:
    from raypar import data

    index = data.prepare(args.globs, str(args.out))
    print(f"raypar: {index['total_tokens']:,} tokens from {len(index['files'])} files -> {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
        handler = {"train": _train, "prepare": _prepare}[args.command]
        return handler(args)
    except (ConfigError, UsageError) as err:
        print(f"raypar: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("raypar: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
