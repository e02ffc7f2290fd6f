"""A run directory's files, copied next to the checkpoints when `checkpoint.dir` is a URI.

The run directory is local to the driver: under `ray job submit` on a cluster it is the head's disk, which
goes with the cluster. When the checkpoints live on storage that outlasts it (s3://, gs://, hdfs://), the
run's record goes there too at the end of the run, successful or not: metrics.jsonl, timeline.jsonl,
events.jsonl, config.toml, hang and profile reports, and the report's pictures (drawn first, so a failed
run, which the trackers do not draw, has them as well). They go to ``<checkpoint.dir>/runs/<run name>/``,
beside the ``step_*`` directories, which nothing there is mistaken for.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs

from raypar.core.observe.report import write_report

SKIP = frozenset({".lock"})  # the run directory's lock file: a live process's, meaningless elsewhere


def destination(checkpoint_dir: str, run: str) -> str | None:
    """Where the run's files go: under a URI `checkpoint.dir`, None for a local one (or none)."""
    if "://" not in checkpoint_dir:
        return None
    base, sep, query = checkpoint_dir.partition("?")  # s3://b/p?endpoint_override=...: options stay last
    return f"{base.rstrip('/')}/runs/{run}{sep}{query}"


def copy_run_dir(run_dir: Path, checkpoint_dir: str, run: str) -> str | None:
    """Draw the report and copy the run directory's files (top level: logs/ belongs to the trackers, which
    keep their own copies) next to the checkpoints. Returns a line saying what was done or what failed,
    None when `checkpoint.dir` is not a URI. Never raises: the run's own outcome is what the caller
    reports."""
    dest = destination(checkpoint_dir, run)
    if dest is None:
        return None
    try:
        write_report(run_dir)
    except (OSError, ValueError):  # a run that failed before its first step: copy what there is
        pass
    files = sorted(p for p in Path(run_dir).iterdir() if p.is_file() and p.name not in SKIP)
    try:
        fs, root = pafs.FileSystem.from_uri(dest)
        fs.create_dir(root, recursive=True)
        for path in files:  # streamed: a long run's timeline.jsonl is not small
            pafs.copy_files(
                str(path), f"{root.rstrip('/')}/{path.name}",
                source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs,
            )
    except (pa.ArrowException, OSError, ValueError) as err:
        return f"copying the run directory to {dest} failed ({err}); it stays in {run_dir}"
    return f"run directory ({len(files)} files) copied to {dest}"
