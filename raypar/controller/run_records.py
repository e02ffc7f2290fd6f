"""What a run may find where it writes, checked before anything is written there (and again under the run
directory's lock): a run never truncates another run's metrics nor overwrites checkpoints it did not write.

A fresh run (no --resume) is refused, in one line naming the directory and how to go on, where its
--run-dir already holds step records or its checkpoint.dir already holds checkpoints: a rerun of a
finished name (`make demo` twice) would otherwise start its records and checkpoints from step 0 over the
old ones. Refused rather than continued on its own: Megatron and torchtitan users expect a rerun to pick up
the checkpoint folder, but here that would mean loading whatever checkpoint the directory holds without
being asked, under a config that may have changed since; `--resume latest` does exactly that when asked,
with the model's shape checked against the manifest. A resumed run may write into the directory it resumes
(its metrics are kept through the resumed step) but never over a newer checkpoint than the one it resumed.

Its record files must be regular files: a FIFO there blocks the run forever and a symlink writes through
into another file, so both are refused.
"""

from __future__ import annotations

import fcntl
from pathlib import Path

from raypar.core import checkpoint
from raypar.core.config.errors import ConfigError
from raypar.core.config.schema import Config
from raypar.core.plain_files import NotRegularFile, refuse_unless_regular

RUN_LOCK = ".lock"  # in the run directory: held by the run that writes there (training.hold_run_dir)
# The files a run appends to or rewrites in its directory.
RECORDS = ("metrics.jsonl", "timeline.jsonl", "events.jsonl", "config.toml", "trackers.json")
STEP_RECORDS = ("metrics.jsonl", "timeline.jsonl")  # a run that completed a step left lines here


def check(cfg: Config, run_dir: Path, resume: str | None) -> None:
    """ConfigError unless this run may write into `run_dir` and `cfg.checkpoint.dir` (see the module)."""
    for name in RECORDS:
        try:
            refuse_unless_regular(run_dir / name, f"the run's {name}")
        except NotRegularFile as err:
            raise ConfigError(f"--run-dir: {err} (remove it)") from None
    if _held(run_dir):
        return  # a live run's: refused by its lock (training.hold_run_dir), which names the holder
    if resume is None:
        _fresh_run_dir(cfg, run_dir)
        _fresh_checkpoint_dir(cfg)
    else:
        _no_newer_checkpoint(cfg, resume)


def _how_to_continue(cfg: Config) -> str:
    resume = "continue it with --resume latest, or " if cfg.checkpoint.dir else ""
    return f"{resume}choose another --name or --run-dir"


def _fresh_run_dir(cfg: Config, run_dir: Path) -> None:
    for name in STEP_RECORDS:
        path = run_dir / name
        if path.exists() and path.stat().st_size > 0:
            raise ConfigError(
                f"--run-dir: {run_dir} already holds a run's records ({path} is not empty) and a new run "
                f"would start them again from step 0; {_how_to_continue(cfg)}"
            )


def _held(run_dir: Path) -> bool:
    """Whether a live run holds `run_dir`'s lock (training.hold_run_dir takes it exclusively)."""
    try:
        with open(run_dir / RUN_LOCK) as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)  # released as the file closes
            except BlockingIOError:
                return True
    except FileNotFoundError:
        pass
    return False


def _fresh_checkpoint_dir(cfg: Config) -> None:
    if not cfg.checkpoint.dir:
        return
    try:
        steps = sorted(i.base_name for i in checkpoint.subdirs(cfg.checkpoint.dir)
                       if checkpoint.STEP_RE.fullmatch(i.base_name))
    except checkpoint.CheckpointError as err:
        raise ConfigError(f"checkpoint.dir: {err}") from None
    if steps:
        raise ConfigError(
            f"checkpoint.dir: {cfg.checkpoint.dir} already holds checkpoints (the newest {steps[-1]}) that a "
            "new run would overwrite; continue them with --resume latest, or set another checkpoint.dir"
        )


def _no_newer_checkpoint(cfg: Config, resume: str) -> None:
    """A run resumed at step s writes checkpoints after s into checkpoint.dir: refused where that root
    holds an intact one newer than s (another timeline's, which it would overwrite on reaching that step).
    Broken ones (those `--resume latest` passes over, saying why) are no checkpoints to keep."""
    if not cfg.checkpoint.dir:
        return
    try:
        step = checkpoint.load_manifest(resume)["step"]
        saved = checkpoint.list_checkpoints(cfg.checkpoint.dir)
        newer = [uri for s, uri in saved if s > step and _intact(uri)]
    except checkpoint.CheckpointError as err:
        raise ConfigError(f"checkpoint.dir: {err}") from None
    if newer:
        raise ConfigError(
            f"checkpoint.dir: {newer[-1]} is newer than the step {step} resumed from {resume}, and the run "
            f"would overwrite it; resume from it (--resume latest), or set another checkpoint.dir"
        )


def _intact(uri: str) -> bool:
    try:
        checkpoint.verify(uri, 0)  # sizes and coverage (hashes are the resumed checkpoint's concern)
    except checkpoint.CheckpointError:
        return False
    return True
