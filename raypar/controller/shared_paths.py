"""Paths every actor must see as the driver sees them.

A relative path means the directory it is resolved in, and actors run elsewhere: in their raylet's
directory, on other nodes, and under `ray job submit` next to a per-node copy of the job's working_dir.
So the driver makes every local path of the config absolute before any actor gets it (`make_absolute`),
and, once connected, asks every other node of the cluster whether it sees the same files
(`check_nodes`): the datasets open there with the driver's number of samples, and a file the driver put
in checkpoint.dir is there, next to which the node can write. A node-local checkpoint.dir (/tmp on a
multi-node cluster, a disk only the head has) is refused before any actor starts, naming the node: each
node would write its own shards of every checkpoint into its own copy, and no copy would be whole.

Nodes that join later (an autoscaler, a heal) are asked the same when a replica's actors are first placed
on one, before those actors start (raypar.controller.node_check). On a cluster whose autoscaler adds nodes,
a checkpoint.dir on the driver's own disk is refused at the start (`check_node_local`): the nodes to come
cannot see it. The run directory stays on the driver's disk, never in a job's working_dir copy
(`check_run_dir`); see raypar.core.observe.run_copy for its copy next to URI checkpoints.
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs

from raypar.core import checkpoint, data
from raypar.core.config.errors import ConfigError
from raypar.core.config.schema import Config

DATA_KEYWORDS = ("synthetic", "stdlib")  # data.source values that are not paths
PROBE_TIMEOUT_S = 120.0  # a node's first task starts a Python worker; under load that takes seconds
# Ray unpacks a job's working_dir into every node's session directory, under this, and deletes the copy
# with the job: a checkpoint written there is per node and temporary.
_JOB_COPY = re.compile(r"/session_[^/]+/runtime_resources/")


def absolute(path: str) -> str:
    """`path` as every process means it: URIs as given, local paths absolute ("" stays unset)."""
    if not path or "://" in path:
        return path
    return os.path.abspath(os.path.expanduser(path))


def _absolute_source(source: str) -> str:
    """data.source or data.val_source with every path absolute: a keyword, a prepared directory, or
    comma-separated globs (a glob made absolute still matches the same files)."""
    if not source.strip() or source.strip() in DATA_KEYWORDS:
        return source
    return ",".join(absolute(part.strip()) for part in source.split(",") if part.strip())


def make_absolute(cfg: Config) -> None:
    """Resolve the config's local paths in the driver's directory, once, for every actor."""
    cfg.checkpoint.dir = absolute(cfg.checkpoint.dir)
    cfg.data.cache_dir = absolute(cfg.data.cache_dir)
    cfg.data.source = _absolute_source(cfg.data.source)
    cfg.data.val_source = _absolute_source(cfg.data.val_source)
    if _JOB_COPY.search(cfg.checkpoint.dir):
        raise ConfigError(
            f"checkpoint.dir: {cfg.checkpoint.dir} is inside the copy of the job's working_dir that Ray "
            "makes on each node and deletes with the job; give an absolute path on storage every node "
            "shares, or a URI such as s3://bucket/path"
        )


def check_run_dir(run_dir: str) -> None:
    """Refuse a run directory inside the job's working_dir copy (`ray job submit` runs the driver there, so
    the default runs/<name> lands in it): Ray deletes that copy with the job, and the run's metrics with it.
    The run directory is not moved under checkpoint.dir instead: it is written line by line all run long,
    which object storage cannot append to; with checkpoint.dir a URI, its files are copied there at the
    end (raypar.core.observe.run_copy)."""
    path = absolute(run_dir)
    if _JOB_COPY.search(path + "/"):
        raise ConfigError(
            f"--run-dir: {path} is inside the copy of the job's working_dir that Ray deletes with the job; "
            "give --run-dir an absolute path on a disk that stays (with checkpoint.dir a URI, the run's "
            "files are also copied there at the end)"
        )


# Filesystem types other machines mount as well: a checkpoint.dir there may be one every node sees (each
# node that hosts actors is probed anyway). "fuse.*" (s3fs, gcsfuse, mountpoint-s3, JuiceFS) counts too.
SHARED_FS = frozenset({"nfs", "nfs4", "cifs", "smb3", "lustre", "gpfs", "ceph", "glusterfs", "beegfs", "afs"})
MOUNTS = "/proc/self/mounts"


def filesystem_type(path: str, mounts: str) -> str:
    """The type of the filesystem holding absolute `path`, from the text of /proc/self/mounts (the mount
    with the longest mount point above it); "unknown" when none is listed."""
    best, kind = "", "unknown"
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")  # the table escapes spaces in mount points
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind


def check_node_local(checkpoint_dir: str, autoscaler: bool | None, mounts: str | None = None) -> None:
    """On a cluster whose autoscaler adds nodes (`autoscaler` True), refuse a checkpoint.dir that is a
    plain path on a filesystem of the driver's node alone: the nodes it adds later could not see it, and
    each would write its shards of every checkpoint to its own disk. `mounts`: the mount table's text
    (default: this process's)."""
    if not checkpoint_dir or "://" in checkpoint_dir or not autoscaler:
        return
    if mounts is None:
        try:
            mounts = Path(MOUNTS).read_text()
        except OSError:  # not Linux: nothing says the disk is shared
            mounts = ""
    kind = filesystem_type(os.path.realpath(checkpoint_dir), mounts)
    if kind in SHARED_FS or kind.startswith("fuse."):
        return
    raise ConfigError(
        f"checkpoint.dir: {checkpoint_dir} is on this node's own disk ({kind}), and this cluster's "
        "autoscaler adds nodes that cannot see it; use a URI such as s3://bucket/path, or storage every "
        "node mounts (NFS, EFS, Lustre)"
    )


def sample_counts(train: data.Dataset, val: data.Dataset | None) -> tuple[int, int]:
    """What the probe compares: the training and validation samples (0 without a validation set)."""
    return train.num_samples, val.num_samples if val is not None else 0


def _samples(cfg: Config) -> tuple[int, int]:
    return sample_counts(*data.open_datasets(cfg.data, cfg.model))


def _probe(cfg: Config, marker: str, samples: tuple[int, int]) -> str | None:
    """On one node: what it cannot see of what the driver sees, as "key: why", or None."""
    try:
        seen = _samples(cfg)
    except ConfigError as err:
        return str(err)
    except (OSError, ValueError) as err:
        return f"data.source: {err}"
    if seen != samples:
        return f"data.source: {seen[0]} training samples here, {samples[0]} on the driver (different files)"
    if not marker:
        return None
    fs, path = checkpoint.resolve_fs(marker)
    if fs.get_file_info(path).type != pafs.FileType.File:
        return (
            f"checkpoint.dir: {cfg.checkpoint.dir} is not shared with this node (a file the driver wrote "
            "there is not visible here); use storage every node mounts, or a URI such as s3://bucket/path"
        )
    mine = f"{path}.{uuid.uuid4().hex}"
    try:
        with fs.open_output_stream(mine) as out:
            out.write(b"raypar")
        fs.delete_file(mine)
    except (OSError, pa.ArrowException) as err:
        return f"checkpoint.dir: {cfg.checkpoint.dir} is not writable here: {err}"
    return None


def alive_nodes(exclude: str = "") -> dict[str, str]:
    """Alive nodes that can host an actor (CPUs or GPUs), id -> address, but `exclude` (the driver's)."""
    import ray

    return {
        n["NodeID"]: n["NodeManagerAddress"]
        for n in ray.nodes()
        if n["Alive"]
        and n["NodeID"] != exclude
        and (n["Resources"].get("CPU", 0) or n["Resources"].get("GPU", 0))
    }


def check_nodes(
    cfg: Config, samples: tuple[int, int] | None = None, timeout_s: float = PROBE_TIMEOUT_S
) -> set[str]:
    """Ask every other alive node that can host an actor whether it sees the config's inputs and
    checkpoint.dir as the driver does; a ConfigError naming the key and the node if one does not.
    `samples` are the driver's `sample_counts`, where it has opened the datasets already (the CLI's
    input check); else they are counted here. The driver's own node sees what the driver sees, so a
    one-node cluster costs nothing. Returns the ids of the nodes known good (the driver's among them):
    nodes that join later are probed when actors are placed there (raypar.controller.node_check)."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    nodes = alive_nodes(exclude=here)
    for why in ask_nodes(cfg, samples, nodes, timeout_s).values():
        raise ConfigError(why)
    return {here, *nodes}


def ask_nodes(
    cfg: Config, samples: tuple[int, int] | None, nodes: dict[str, str], timeout_s: float
) -> dict[str, str]:
    """Probe `nodes` (id -> address); returns id -> "key: on node <address>: why" for each node that does
    not see what the driver sees (a node gone since it was listed hosts no actor, and is left out)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from raypar.controller.connection import RunFailure

    if not nodes:
        return {}
    marker = ""
    if cfg.checkpoint.dir:
        marker = f"{cfg.checkpoint.dir.rstrip('/')}/.raypar-shared-{uuid.uuid4().hex}"
        fs, path = checkpoint.resolve_fs(marker)
        try:
            with fs.open_output_stream(path) as out:
                out.write(b"raypar")
        except (OSError, pa.ArrowException) as err:
            raise ConfigError(f"checkpoint.dir: cannot write {cfg.checkpoint.dir}: {err}") from None
    try:
        probe = ray.remote(num_cpus=0, max_retries=0)(_probe)
        if samples is None:
            samples = _samples(cfg)
        refs = {
            probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
                cfg, marker, samples
            ): node
            for node in nodes
        }
        done, missing = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        if missing:
            silent = ", ".join(nodes[refs[r]] for r in missing)
            raise RunFailure(f"node {silent} did not answer the shared-path check within {timeout_s:.0f} s")
        refused = {}
        for ref in done:
            try:
                why = ray.get(ref)
            except (ray.exceptions.NodeDiedError, ray.exceptions.TaskUnschedulableError):
                continue  # gone since it was listed: it hosts no actor
            if why:
                key, _, rest = why.partition(": ")
                refused[refs[ref]] = f"{key}: on node {nodes[refs[ref]]}: {rest}"
        return refused
    finally:
        if marker:
            _remove(marker)


def _remove(uri: str) -> None:
    fs, path = checkpoint.resolve_fs(uri)
    try:
        fs.delete_file(path)
    except (OSError, pa.ArrowException):
        pass  # a leftover probe file is harmless; the check's own error is the one to report
