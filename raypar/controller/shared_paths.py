"""Paths every actor must see as the driver sees them.

A relative path means the directory it is resolved in, and actors run elsewhere: in their raylet's
directory, on other nodes, and under `ray job submit` next to a per-node copy of the job's working_dir.
So the driver makes every local path of the config absolute before any actor gets it (`make_absolute`),
and, once connected, asks every other node of the cluster whether it sees the same files
(`check_nodes`): the datasets open there with the driver's number of samples, and a file the driver put
in checkpoint.dir is there, next to which the node can write. A node-local checkpoint.dir (/tmp on a
multi-node cluster, a disk only the head has) is refused before any actor starts, naming the node: each
node would write its own shards of every checkpoint into its own copy, and no copy would be whole.

Nodes that join later (an autoscaler, a heal) are not asked; a shard they write where the driver cannot
see it fails that checkpoint's publish (the sizes are checked), and the run goes on.
"""

from __future__ import annotations

import os
import re
import uuid

import pyarrow as pa

from raypar.core.checkpoint import format as checkpoint
from raypar.core.config.errors import ConfigError
from raypar.core.config.schema import Config
from raypar.core.data import datasets as data

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
    if fs.get_file_info(path).type != checkpoint.pafs.FileType.File:
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


def check_nodes(
    cfg: Config, samples: tuple[int, int] | None = None, timeout_s: float = PROBE_TIMEOUT_S
) -> None:
    """Ask every other alive node that can host an actor whether it sees the config's inputs and
    checkpoint.dir as the driver does; a ConfigError naming the key and the node if one does not.
    `samples` are the driver's `sample_counts`, where it has opened the datasets already (the CLI's
    input check); else they are counted here. The driver's own node sees what the driver sees, so a
    one-node cluster costs nothing."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from raypar.controller.connection import RunFailure

    here = ray.get_runtime_context().get_node_id()
    nodes = {
        n["NodeID"]: n["NodeManagerAddress"]
        for n in ray.nodes()
        if n["Alive"]
        and n["NodeID"] != here
        and (n["Resources"].get("CPU", 0) or n["Resources"].get("GPU", 0))
    }
    if not nodes:
        return
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
        for ref in done:
            try:
                why = ray.get(ref)
            except (ray.exceptions.NodeDiedError, ray.exceptions.TaskUnschedulableError):
                continue  # gone since it was listed: it hosts no actor
            if why:
                key, _, rest = why.partition(": ")
                raise ConfigError(f"{key}: on node {nodes[refs[ref]]}: {rest}")
    finally:
        if marker:
            _remove(marker)


def _remove(uri: str) -> None:
    fs, path = checkpoint.resolve_fs(uri)
    try:
        fs.delete_file(path)
    except (OSError, pa.ArrowException):
        pass  # a leftover probe file is harmless; the check's own error is the one to report
