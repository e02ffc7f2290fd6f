"""What a user of each tracker would see, read back through its own library, and the check that it is
metrics.jsonl: every numeric field at every step, once.

TensorBoard: `EventAccumulator` over the event files (orphan purging off, so a step sent twice stays
visible). MLflow: `MlflowClient` on the store. W&B offline: the run files are LevelDB-style logs of the
library's `Record` protobufs; W&B 0.31 reads them only in its Go core, so the block framing is undone here
(40 lines of the published format) and each record parsed by `wandb.proto`.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from raypar.core.observe.trackers import scalars

Series = dict[str, list[tuple[int, float]]]  # key -> [(step, value)] in the order the tracker holds them


def read_tensorboard(log_dir: str | Path) -> Series:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(Path(log_dir) / "tensorboard"), size_guidance={"scalars": 0},
                              purge_orphaned_data=False)
    events.Reload()
    return {tag: _by_step((e.step, e.value) for e in events.Scalars(tag)) for tag in events.Tags()["scalars"]}


def _by_step(points: Iterable[tuple[int, float]]) -> list[tuple[int, float]]:
    return sorted(points, key=lambda point: point[0])  # stable: a step sent twice stays twice


def read_mlflow(uri: str, project: str) -> tuple[list[str], Series]:
    """The experiment's run ids and the metrics of its (only) run."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(project)
    runs = client.search_runs([experiment.experiment_id])
    run = runs[0]
    series = {
        key: _by_step((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        for key in run.data.metrics
    }
    return [r.info.run_id for r in runs], series


_BLOCK, _HEADER = 32768, 7
_FULL, _LAST = 1, 4


def _wandb_records(path: Path) -> Iterator[Any]:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:_HEADER])
    assert (ident, magic) == (b":W&B", 0xBEE1), f"{path}: not a W&B run file"
    pos, pending = _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        chunk = data[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        if kind == 0:
            continue
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"{path}: bad checksum"
        pending += chunk
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def read_wandb(log_dir: str | Path) -> tuple[set[str], Series, list[str]]:
    """Run ids of every offline run under `log_dir`, their history in file order, and the files saved."""
    ids, series, files = set(), {}, []
    for path in sorted(Path(log_dir).glob("wandb/offline-run-*/run-*.wandb")):
        for record in _wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add(record.run.run_id)
            elif kind == "files":
                files += [f.path for f in record.files.files]
            elif kind == "history":
                for item in record.history.item:
                    key, value = item.key or "/".join(item.nested_key), json.loads(item.value_json)
                    if not key.startswith("_"):
                        series.setdefault(key, []).append((record.history.step.num, float(value)))
    return ids, {key: _by_step(points) for key, points in series.items()}, files


def assert_one_run(ids: Iterable[str], what: str) -> None:
    """A resumed run went on in the tracker run it started (one run id, not one per driver)."""
    ids = sorted(ids)
    assert len(ids) == 1, f"{what}: {len(ids)} tracker runs {ids}, expected the one run resumed"


def expected_series(metrics: list[dict[str, Any]]) -> Series:
    """What a tracker should hold for these metrics.jsonl records: each numeric field (flattened by
    trackers.scalars, as the sink sends it) at its step. tests/unit/test_trackers.py checks it against keys
    listed by hand, so a flattening bug in scalars is not taken for the expectation."""
    expected: Series = {}
    for record in metrics:
        for key, value in scalars(record).items():
            expected.setdefault(key, []).append((record["step"], value))
    return expected


def assert_matches_metrics(series: Series, metrics: list[dict[str, Any]], rel_tol: float, what: str) -> None:
    """`series` holds every numeric field of every metrics.jsonl record at its step, each step once, each
    value within `rel_tol` (nan where the record has nan)."""
    expected = expected_series(metrics)
    assert set(series) == set(expected), f"{what}: keys differ: {set(series) ^ set(expected)}"
    for key, points in expected.items():
        steps = [s for s, _ in series[key]]
        twice = sorted({s for s in steps if steps.count(s) > 1})
        assert not twice, f"{what}: {key} logged twice at steps {twice}"
        want_steps = [s for s, _ in points]
        assert steps == want_steps, f"{what}: {key} has steps {steps}, expected {want_steps}"
        for (step, got), (_, want) in zip(series[key], points, strict=True):
            same = math.isnan(got) if math.isnan(want) else math.isclose(got, want, rel_tol=rel_tol)
            assert same, f"{what}: {key} at step {step} is {got}, metrics.jsonl has {want}"
