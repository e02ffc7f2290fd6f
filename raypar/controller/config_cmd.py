"""`raypar config [CONFIG] [--section S] [--set k=v ...]`: a config's keys with their help and the values the
config resolves to, without starting Ray.

The config is resolved as `raypar train` resolves it (`raypar.core.run_config.resolve`: the TOML file, the
`--set` overrides, the preset, `model.init_from`'s config.json and a prepared `data.source`'s vocabulary) and
checked by the same rules; a bad one is the same one line and exit 2. Only a config that names such files
imports what reads them (torch among it, seconds); any other resolves through `from_dict` alone, which is
what `resolve` does for it.
"""

from __future__ import annotations

import argparse
from typing import Any

from raypar.core.config import load, reference
from raypar.core.config.errors import ConfigError
from raypar.core.config.schema import Config

# data.source values that name no files (raypar.core.run_config.model_fields_from_files reads none for them)
BUILT_IN_SOURCES = ("", "synthetic", "stdlib")


def add_parser(sub: Any) -> None:
    """The `config` subcommand on the CLI's subparsers."""
    cmd = sub.add_parser("config", help="a config's keys with their help and resolved values (no Ray)")
    cmd.add_argument("config", nargs="?", help="TOML config (default: every key's default)")
    cmd.add_argument(
        "--section", metavar="S", help=f"one section: {', '.join(reference.sections())} (default: all)"
    )
    cmd.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a key"
    )


def _names_files(raw: dict[str, Any]) -> bool:
    model, data = raw.get("model"), raw.get("data")
    init_from = isinstance(model, dict) and bool(model.get("init_from"))
    source = data.get("source", "") if isinstance(data, dict) else ""
    return init_from or str(source) not in BUILT_IN_SOURCES


def resolve(path: str | None, overrides: list[str]) -> Config:
    """The config `raypar train` would run."""
    raw = load.read_raw(path, overrides)
    if _names_files(raw):
        from raypar.core.run_config import resolve as resolve_files  # reads them: imports torch

        return resolve_files(raw)
    return load.from_dict(raw)


def run(args: argparse.Namespace) -> int:
    known = reference.sections()
    if args.section is not None and args.section not in known:
        raise ConfigError(f"--section: unknown section {args.section!r} (known: {', '.join(known)})")
    cfg = resolve(args.config, args.set)
    print(reference.describe(cfg, args.section).rstrip("\n"))
    return 0
