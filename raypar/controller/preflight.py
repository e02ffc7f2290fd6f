"""The checks `raypar train` makes before any actor starts, each failing with a ConfigError that names the
key (the CLI prints it in one line and exits 2): the data opens, the outputs are writable, the compile cache
is this user's, the layout fits the GPU, and the checkpoint to resume from is intact and matches the model.
Ray is not imported here: a typo costs a second, not a cluster start-up."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

from raypar.core.config.errors import ConfigError
from raypar.core.config.schema import Config


def check_data(cfg: Config) -> tuple[int, int]:
    """Open the dataset once here: its errors are config errors, and the stdlib corpus is prepared once.
    Returns its sample counts, which the other nodes' shared-path probe compares with theirs."""
    from raypar.controller import shared_paths
    from raypar.core import data
    from raypar.core.data import documents

    try:
        dataset, val = data.open_datasets(cfg.data, cfg.model, VERIFY_HASHES_BYTES)
        data.tokenizer_record(cfg.data)  # what every checkpoint will record: checked to be the tokenizer
        data.GlobalSampler(dataset.num_samples, cfg.train.global_batch, cfg.train.seed)
    except ConfigError:
        raise
    except (OSError, ValueError) as err:  # a broken prepared directory or an unreadable source file
        raise ConfigError(f"data.source: {err}") from None
    if cfg.data.document_masking is True and not documents.has_documents(dataset):
        raise ConfigError(
            f"data.document_masking: data.source {cfg.data.source!r} records no document boundaries (prepare "
            "it with --format chat, --format prompt-completion or --pack documents)"
        )
    masked = [documents.masked(cfg.data.document_masking, d) for d in (dataset, val) if d is not None]
    if cfg.model.dropout and any(masked):
        raise ConfigError(  # "auto" on data with boundaries; true was refused with dropout by the rules
            f"data.document_masking: \"auto\" masks the documents the data records and needs model.dropout "
            f"= 0 (masked attention has none), got {cfg.model.dropout}; set it false to train with dropout"
        )
    if cfg.train.eval_every:
        data.check_eval(val, cfg.train.eval_batches, cfg.train.global_batch)
    return shared_paths.sample_counts(dataset, val)


def writable_dir(path: Path, what: str) -> None:
    """`path` is, or can be made, a directory this process writes into; else a ConfigError naming `what`."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{what}: {path} exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"{what}: cannot create {path}: {err.strerror or err}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{what}: {path} is not writable")


def check_outputs(cfg: Config, run_dir: Path) -> None:
    """Where the run writes: its directory and a local checkpoint.dir (other URIs are checked on first
    use). Checked before Ray starts, so a typo costs a second, not a cluster start-up."""
    writable_dir(run_dir, "--run-dir")
    if cfg.checkpoint.dir:
        import pyarrow.fs as pafs

        from raypar.core import checkpoint

        try:
            fs, path = checkpoint.resolve_fs(cfg.checkpoint.dir)
        except checkpoint.CheckpointError as err:
            raise ConfigError(f"checkpoint.dir: {err}") from None
        if isinstance(fs, pafs.LocalFileSystem):
            writable_dir(Path(path), "checkpoint.dir")
    if cfg.log.backends:  # where the trackers write (issue 45: refused before the actors, not at step 0)
        from raypar.core.observe import tracker_backends, trackers

        writable_dir(Path(trackers.resolved(cfg.log, run_dir, "").dir), "log.dir")
        if "mlflow" in cfg.log.backends and cfg.log.mlflow_uri:
            tracker_backends.check_mlflow_uri(cfg.log.mlflow_uri)


# Resuming reads every shard's bytes up front (sha256) when the checkpoint is at most this big; above it
# only sizes (the actors verify hashes as they load). So does opening a local prepared dataset (sha256 and
# token ids up to it; sizes always): a start-up bounded to ~1 s of reading.
VERIFY_HASHES_BYTES = 2**30


def check_compile_cache(cfg: Config) -> None:
    """train.compile: the inductor cache this node's actors will load kernels from is this user's alone
    (created 0700 here); other nodes' actors check theirs before they compile."""
    if not cfg.train.compile:
        return
    from raypar.core.model import compiled

    try:
        compiled.own_cache_dir(compiled.inductor_cache_dir())
    except OSError as err:
        raise ConfigError(f"train.compile: {err}") from None


def check_fits(cfg: Config) -> None:
    """On GPUs, refuse a layout the planner predicts will not fit (ConfigError naming the knob to turn).
    The driver's GPU stands for the workers': a driver without one cannot tell, and checks nothing."""
    import torch

    if cfg.parallel.device == "cpu" or not torch.cuda.is_available():
        return
    from raypar.core import planner

    props = torch.cuda.get_device_properties(0)
    planner.check_fits(cfg, props.total_memory, planner.device_named(props.name), props.name)


def resolve_resume(cfg: Config, which: str) -> str | None:
    """The checkpoint to resume from, checked before any actor starts: a step directory must be intact
    (exit 2 naming the bad file); under a root (or `latest`), the newest intact one is taken, and every
    newer one passed over is named with the reason. `latest` under a checkpoint.dir with no step directory
    yet: None, the run starts at step 0 (a job submitted again and again, as KubeRay's RayJob does, keeps
    one command line); damaged step directories only are still refused."""
    import pyarrow.fs as pafs

    from raypar.core import checkpoint

    if which == "latest" and not cfg.checkpoint.dir:
        raise ConfigError("--resume latest: checkpoint.dir is not set")
    where = cfg.checkpoint.dir if which == "latest" else which
    try:
        if which == "latest" and not any(
            checkpoint.STEP_RE.fullmatch(d.base_name) for d in checkpoint.subdirs(where)
        ):
            print(f"raypar: --resume latest: no checkpoint under {where} yet; from step 0", file=sys.stderr)
            return None
        fs, path = checkpoint.resolve_fs(where)
        if fs.get_file_info(f"{path}/{checkpoint.MANIFEST}").type == pafs.FileType.File:
            uri = where
            checkpoint.verify(uri, VERIFY_HASHES_BYTES)
        else:
            uri, notes = checkpoint.newest_intact(where, VERIFY_HASHES_BYTES)
            for note in notes:
                print(f"raypar: --resume: {note}", file=sys.stderr)
            if notes:
                print(f"raypar: --resume: using {uri}, the newest intact checkpoint", file=sys.stderr)
        manifest = checkpoint.load_manifest(uri)
    except (checkpoint.CheckpointError, *checkpoint.FS_ERRORS) as err:  # FS_ERRORS: OSError, Arrow's
        raise ConfigError(f"--resume: {err}") from None
    saved = manifest["meta"].get("model", {})
    if manifest["step"] > cfg.train.steps:  # the run would train nothing and end "done"
        raise ConfigError(
            f"--resume: {uri} is at step {manifest['step']}, past train.steps={cfg.train.steps}: nothing "
            "to train (set train.steps above the checkpoint's step)"
        )
    mine = dataclasses.asdict(cfg.model)
    diff = [k for k in mine if k != "preset" and k in saved and saved[k] != mine[k]]
    if diff:
        raise ConfigError(
            f"--resume: {uri}/manifest.json does not match the model: "
            + ", ".join(f"model.{k}={mine[k]} vs {saved[k]}" for k in diff)
        )
    return uri
