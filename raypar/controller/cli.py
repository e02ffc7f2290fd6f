"""`raypar` command line.

Usage and config errors: one line on stderr, exit 2, before any actor starts (Ray is imported only once the
input is known good). Runtime failures: one line naming the actor (run, dp, pp, tp) and the cause, exit 1.
Ctrl-C: exit 130; SIGTERM: exit 143; both release the run's actors and placement groups first.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from raypar.controller import config_cmd, preflight, prepare_cmd, ray_env, stopping
from raypar.controller.usage import UsageError
from raypar.core.config.errors import ConfigError
from raypar.core.config.rules import check_tracker_packages
from raypar.core.config.schema import Config

# A run name is one path component under runs/ and part of actor names (`raypar:<run>:...`): no separators,
# no leading '.' (so never '.' or '..'), no ':'.
_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
# The model FLOPs utilisation `raypar plan` assumes unless told (--mfu), and `raypar train --dry-run` with it.
PLAN_MFU = 0.4


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
    train.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        metavar="PATH|latest",
        help="continue from a checkpoint: a step directory, a checkpoint root, or latest "
        "(the newest under checkpoint.dir)",
    )
    train.add_argument("--stop-at", type=int, metavar="STEP", help="stop before this step (resume later)")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.add_argument(
        "--dry-run", action="store_true", help="resolve and check the config, print it with the plan's "
        "prediction for its layout, and exit without starting Ray"
    )
    train.add_argument(
        "--profile-steps", metavar="A-B", help="torch.profiler on every actor for steps A..B "
        "(train.profile_steps): profile.json, and in `raypar report`'s timeline.json"
    )

    plan = sub.add_parser("plan", help="layouts that fit N devices, with predicted memory and step time")
    plan.add_argument("config", help="TOML config (its model, batch and precision are planned for)")
    plan.add_argument("--devices", required=True, type=int, help="number of devices (actors)")
    plan.add_argument("--device-memory", required=True, help="memory per device, e.g. 80GB, 141GiB")
    plan.add_argument("--device", default="h100", help="h200, h100, a100, l4 or cpu (peaks and bandwidths)")
    plan.add_argument(
        "--mfu", type=float, default=PLAN_MFU, help=f"assumed model FLOPs utilisation ({PLAN_MFU})"
    )
    plan.add_argument(
        "--compile-speedup", type=float, metavar="X",
        help="compute time eager / compiled on this device, for train.compile (default: the device's, 1.0)",
    )
    plan.add_argument("--top", type=int, default=20, help="rows of the table (default 20)")
    plan.add_argument("--all", action="store_true", help="also list layouts that do not fit")
    plan.add_argument("--json", action="store_true", help="print JSON (every layout)")
    plan.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a key"
    )

    prepare_cmd.add_parser(sub)

    scale = sub.add_parser("scale", help="change a running run's number of data-parallel replicas")
    scale.add_argument("--run", required=True, help="the run's name")
    scale.add_argument("--dp", required=True, type=int, help="new number of replicas")
    scale.add_argument("--address", default="auto", help="Ray cluster (default: auto)")

    status = sub.add_parser("status", help="live runs: layout, step, throughput, actors and their nodes")
    status.add_argument("--address", default="auto", help="Ray cluster (default: auto)")
    status.add_argument("--json", action="store_true", help="print JSON")

    rep = sub.add_parser("report", help="timeline (Chrome trace + PNG) and loss plot of a run directory")
    rep.add_argument("run_dir", type=Path)
    rep.add_argument("--step", type=int, help="the step to draw (default: the median one)")

    gen = sub.add_parser("generate", help="sample text from a checkpoint (one process, KV cache)")
    gen.add_argument("path", help="a step directory or a checkpoint root (its latest)")
    gen.add_argument("--prompt", required=True, help="the text to continue")
    gen.add_argument("--max-tokens", type=int, default=200, help="new tokens at most (default 200)")
    gen.add_argument("--temperature", type=float, default=0.8, help="0: greedy (default 0.8)")
    gen.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (default 0.95)")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    gen.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N")
    gen.add_argument(
        "--chat", action="store_true",
        help="answer --prompt as a user turn, rendered by the chat template the data was prepared with; "
        "stop at the end-of-turn token",
    )

    config_cmd.add_parser(sub)

    ckpt = sub.add_parser("checkpoint", help="inspect or export a checkpoint")
    ckpt_sub = ckpt.add_subparsers(dest="action", required=True, parser_class=_Parser)
    inspect = ckpt_sub.add_parser("inspect", help="summarise a checkpoint's manifest")
    inspect.add_argument("path", help="a step directory or a checkpoint root (its latest)")
    export = ckpt_sub.add_parser(
        "export", help="write one consolidated safetensors file, or a Hugging Face model directory"
    )
    export.add_argument("path", help="a step directory or a checkpoint root (its latest)")
    export.add_argument("out", help="output .safetensors path or URI (--format hf: a new directory)")
    export.add_argument(
        "--format", choices=("safetensors", "hf"), default="safetensors",
        help="hf: config.json + model*.safetensors for transformers' LlamaForCausalLM.from_pretrained",
    )
    return parser


def _train(args: argparse.Namespace) -> int:
    if args.name is not None and not _RUN_NAME.fullmatch(args.name):
        raise UsageError(
            f"--name: must be 1-100 letters, digits, '.', '_' or '-', starting with a letter or digit "
            f"(it names a directory under runs/), got {args.name!r}"
        )
    from raypar.core.run_config import load_config  # imports torch: seconds, after main's signal handlers

    profile = [f"train.profile_steps={json.dumps(args.profile_steps)}"] if args.profile_steps else []
    cfg = load_config(args.config, args.set + profile)
    check_tracker_packages(cfg)  # the driver alone writes to the trackers
    if args.stop_at is not None and args.stop_at <= 0:
        raise UsageError(f"--stop-at: must be a positive step, got {args.stop_at}")
    from raypar.controller import run_records, shared_paths
    from raypar.core import planner

    shared_paths.make_absolute(cfg)  # actors run in other directories, and on other nodes
    samples = preflight.check_data(cfg)
    preflight.check_compile_cache(cfg)
    preflight.check_fits(cfg)
    planner.check_local_memory(cfg, ray_env.target(args.address))  # a local Ray's actors all live here
    resume = preflight.resolve_resume(cfg, args.resume) if args.resume else None
    resume = shared_paths.absolute(resume) if resume else None
    name = args.name or f"{Path(args.config).stem}-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    run_dir = args.run_dir or Path("runs") / name
    shared_paths.check_run_dir(str(run_dir))  # not in `ray job submit`'s temporary copy of the working dir
    if args.dry_run:  # every check above and the records' below, but nothing created (check_outputs mkdirs)
        run_records.check(cfg, run_dir, resume)
        return _dry_run(cfg, args.address)
    preflight.check_outputs(cfg, run_dir)
    run_records.check(cfg, run_dir, resume)  # never over another run's records or checkpoints
    from raypar.controller.connection import RunFailure  # imports Ray: only once the input is known good
    from raypar.controller.training import TrainingLoop

    try:
        loop = TrainingLoop(
            cfg, name, run_dir, args.address, resume, args.stop_at, not args.no_progress, samples=samples
        )
        summary = loop.execute()
    except RunFailure as err:
        print(f"raypar: run {name} failed: {err}", file=sys.stderr)
        return 1
    # this run's tokens over this run's time (a resumed run's total counts the steps before it too)
    mine = summary["run_tokens"]
    tokens_s = mine / summary["wall_s"] if summary["wall_s"] else 0.0
    resumed = f" ({mine:,} in this run)" if mine != summary["tokens"] else ""
    loss = (
        f"loss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f}, "
        if summary["final_loss"] is not None
        else ""
    )
    print(
        f"raypar: run {summary['run']} done at step {summary['steps']}: {loss}{summary['tokens']:,} tokens"
        f"{resumed} in "
        f"{summary['wall_s']:.1f}s ({tokens_s:,.0f} tokens/s overall), {summary['restarts']} restarts; "
        f"{summary['run_dir']}/metrics.jsonl"
    )
    return 0


def _dry_run(cfg: Config, address: str | None) -> int:
    """Print the resolved config and the planner's prediction for its own layout on the device it would run
    on here: the driver's GPU, else this machine's CPU, which a local Ray's actors all share."""
    import torch

    from raypar.core import planner
    from raypar.core.checkpoint import available_memory
    from raypar.core.config.schema import to_toml
    from raypar.core.planner import rank

    layout = planner.current_layout(cfg)
    gpu = cfg.parallel.device != "cpu" and torch.cuda.is_available()
    device = planner.device_named(torch.cuda.get_device_properties(0).name) if gpu else planner.DEVICES["cpu"]
    pred = planner.predict(cfg, layout, device, PLAN_MFU)
    if gpu:
        need, memory = pred.memory_bytes, torch.cuda.get_device_properties(0).total_memory
        where = "per GPU"
    else:  # every actor on this machine: each pipeline rank's bytes times the actors holding that rank
        need = sum(s.total for s in pred.stages) * layout.dp * layout.cp * layout.tp
        memory = available_memory()
        cluster = ray_env.target(address) is not None
        where = "on this machine" + (" (a cluster's nodes are not checked)" if cluster else "")
    step = pred.step_time_s
    print(to_toml(cfg), end="")
    print(
        f"raypar train --dry-run: config valid, Ray not started. {rank.describe(layout)} on {layout.world} "
        f"actors: the plan predicts {planner.gib(need)} of {planner.gib(memory)} {where}: "
        f"{'fits' if need <= memory else 'does NOT fit'}; a step of {step:.3g} s, {pred.tokens_per_s:,.0f} "
        f"tokens/s on {device.name} at an assumed MFU of {PLAN_MFU:g} ({pred.compute_s / step:.0%} compute, "
        f"{pred.bubble_s / step:.0%} bubble, {pred.comm_s / step:.0%} communication)"
    )
    return 0


def _plan(args: argparse.Namespace) -> int:
    from raypar.core import planner
    from raypar.core.planner import rank
    from raypar.core.run_config import load_config

    cfg = load_config(args.config, args.set)
    if args.devices <= 0:
        raise UsageError(f"--devices: must be positive, got {args.devices}")
    if args.device not in planner.DEVICES:
        raise UsageError(f"--device: must be one of {', '.join(planner.DEVICES)}, got {args.device!r}")
    if not 0 < args.mfu <= 1:
        raise UsageError(f"--mfu: must be in (0, 1], got {args.mfu}")
    if args.top <= 0:
        raise UsageError(f"--top: must be a positive number of rows, got {args.top}")
    try:
        memory = planner.parse_size(args.device_memory)
    except ValueError as err:
        raise UsageError(f"--device-memory: {err}") from None
    if not (0 < memory < float("inf")):
        raise UsageError(f"--device-memory: must be a positive, finite size, got {args.device_memory!r}")
    device = planner.DEVICES[args.device]
    if args.compile_speedup is not None:
        if not 0 < args.compile_speedup < float("inf"):
            raise UsageError(f"--compile-speedup: must be a positive factor, got {args.compile_speedup}")
        device = dataclasses.replace(device, compile_speedup=args.compile_speedup)
    # --json and --all list every layout; the table needs only the top rows and the fastest group.
    top = None if args.json or args.all else args.top
    preds = planner.plan(cfg, args.devices, memory, device, args.mfu, top)
    order = rank.ranked(preds)
    shown = order if args.all else [(g, p) for g, p in order if p.fits]
    if args.json:
        print(json.dumps([{"group": g, **p.to_json()} for g, p in shown], indent=1))
        return 0
    fits = sum(p.fits for p in preds)
    where = f"{args.devices} x {args.device} with {planner.gib(memory)} each (assumed MFU {args.mfu:g})"
    if not preds:
        print(f"raypar plan: 0 of 0 valid layouts fit {where}: no split of them passes the config's rules")
        return 0
    if not fits:
        print(f"raypar plan: none of the valid layouts fits {where}; the nearest:")
        print("\n".join(rank.nearest(cfg, order, memory, device)))
        return 0
    print(f"raypar plan: {fits} fitting layouts on {where}, ranked by predicted tokens/s; groups within "
          f"{rank.TIE:.0%}, simplest then most headroom first" + ("" if args.all else " (the search stops "
          "where nothing left could rank: --all for every layout)"))
    print(rank.explain(order, memory))
    print(rank.table(shown, args.top))
    return 0


def _connect(address: str) -> None:
    from raypar.controller.connection import RunFailure, connect

    try:
        connect(address)
    except RunFailure as err:
        print(f"raypar: {err}", file=sys.stderr)
        raise SystemExit(1) from None


def _scale(args: argparse.Namespace) -> int:
    from raypar.controller import connection

    if args.dp <= 0:
        raise UsageError(f"--dp: must be a positive number of replicas, got {args.dp}")
    _connect(args.address)
    try:
        print(f"raypar: {connection.scale(args.run, args.dp)}")
    except LookupError as err:
        raise UsageError(str(err)) from None
    except Exception as err:  # noqa: BLE001 - the control actor's refusal, raised through Ray
        cause = getattr(err, "cause", None) or err
        raise UsageError(str(cause).strip().splitlines()[-1]) from None
    return 0


def _status(args: argparse.Namespace) -> int:
    from raypar.controller import connection

    _connect(args.address)
    runs = connection.runs()
    if args.json:
        print(json.dumps(runs, indent=2))
        return 0
    print("\n".join(status_lines(runs)))
    return 0


def status_lines(runs: list[dict[str, Any]]) -> list[str]:
    """`raypar status` as text: per live run its step, loss, throughput and layout, then its actors."""
    if not runs:
        return ["raypar: no live runs"]
    lines = []
    for run in runs:
        late = run.get("late")
        if late:  # a step past train.hang_watchdog_s (raypar.controller.hang_watch), while it lasts
            lines.append(
                f"{run['run']}: step {late['step']} running for {late['running_s']:.0f} s, "
                f"{late['answered']} of {late['actors']} actors answered"
            )
        if run.get("step") is None:  # placing its actors: on the nodes there are, or on nodes to come
            waiting = run.get("waiting")
            lines.append(f"{run['run']}: waiting for {waiting} (the autoscaler adds nodes)" if waiting
                         else f"{run['run']}: starting")  # fmt: skip
            continue
        layout = " ".join(f"{axis}={run[axis]}" for axis in ("dp", "pp", "tp", "cp"))
        lines.append(
            f"{run['run']}: step {run['step'] + 1}/{run['steps']}  loss {run['loss']:.4f}  "
            f"{run['tokens_per_s']:,.0f} tokens/s  {layout}  restarts {run['restarts']}  {run['run_dir']}"
        )
        lines += [
            f"  {name:40s} node {where['node_id'][:12]}  {where['ip']}  pid {where['pid']}{_lag(where)}"
            for name, where in run["actors"].items()
        ]
        lines += [  # raypar.controller.drain: these replicas move at the next step boundary
            f"  draining: node {node[:12]}{_deadline(d['deadline'])} holds replica(s) {d['replicas']}"
            for node, d in run.get("draining", {}).items()
        ]
    return lines


def _deadline(deadline: float | None) -> str:
    return "" if deadline is None else f" (deadline in {deadline - time.time():.0f} s)"


def _lag(where: dict[str, Any]) -> str:
    """An actor's compute time over its stage peers' median at the last step (core.observe.stragglers)."""
    lag = where.get("lag_s")
    return "" if lag is None else f"  lag {1e3 * lag:+.1f} ms"


def _report(args: argparse.Namespace) -> int:
    from raypar.core.observe import report

    if args.step is not None and args.step < 0:
        raise UsageError(f"--step: must be a step number >= 0, got {args.step}")
    try:
        result = report.write_report(args.run_dir, args.step)
    except (OSError, ValueError) as err:
        raise UsageError(str(err)) from None
    print(report.describe(result))
    return 0


def _checkpoint(args: argparse.Namespace) -> int:
    from raypar.core import checkpoint

    try:
        uri = checkpoint.resolve(args.path)
        if args.action == "inspect":
            print(checkpoint.inspect(uri))
        elif args.format == "hf":
            from raypar.core.checkpoint import hf

            print(f"raypar: wrote {hf.export(uri, args.out, say=lambda line: print(f'raypar: {line}'))}")
        else:
            print(f"raypar: wrote {checkpoint.export(uri, args.out)}")
    except (checkpoint.CheckpointError, FileExistsError) as err:  # the checkpoint named, or the output
        raise UsageError(str(err)) from None
    return 0


def _generate(args: argparse.Namespace) -> int:
    if args.max_tokens <= 0:
        raise UsageError(f"--max-tokens: must be positive, got {args.max_tokens}")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise UsageError("--temperature: must be >= 0, and --top-p in (0, 1]")
    from raypar.core import checkpoint, generate

    try:
        uri = checkpoint.resolve(args.path)
        model, tok = generate.load(uri, args.device)
        chat = generate.load_chat(uri) if args.chat else None
        text = generate.sample(
            model, tok, args.prompt, args.max_tokens, args.temperature, args.top_p, args.seed, chat
        )
    except checkpoint.CheckpointError as err:  # the checkpoint named is bad: usage
        raise UsageError(str(err)) from None
    except ValueError as err:
        raise UsageError(str(err)) from None
    print(text if args.chat else args.prompt + text)
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        stopping.install()  # first, and in the try: a SIGTERM from here on is one line and 143 (issue 45)
        args = _parser().parse_args(argv)
        if args.command in ("train", "scale", "status"):
            ray_env.prepare(args.address)  # before anything imports Ray, which reads it then
        handler = {
            "train": _train,
            "plan": _plan,
            "prepare": prepare_cmd.run,
            "scale": _scale,
            "status": _status,
            "report": _report,
            "checkpoint": _checkpoint,
            "generate": _generate,
            "config": config_cmd.run,
        }[args.command]
        return handler(args)
    except (ConfigError, UsageError) as err:
        print(f"raypar: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM's Terminated (Ray re-raises it as a plain one)
        return stopping.say_stop()


if __name__ == "__main__":
    sys.exit(main())
