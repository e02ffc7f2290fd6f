"""When a run checkpoints, and the one checkpoint in flight: snapshotted at a step boundary (the only
stall), written by the actors in the background, published once every shard is done.

`CheckpointSchedule` is the part of `raypar.controller.training.TrainingLoop` that owns checkpoints. A
checkpoint that fails to be written raises `CheckpointFailed` with its staging directory removed; the loop
decides what that costs (only itself, or a recovery when actors died with it).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from collectives.group import GroupError
from raypar.controller.connection import RunFailure
from raypar.core import checkpoint
from raypar.core.config.schema import Config
from raypar.core.parallel.mesh import Coord

# What can fail while the run talks to its actors and its storage; all of it is recovered the same way.
RECOVERABLE = (RunFailure, GroupError, checkpoint.CheckpointError, ray.exceptions.RayError)


class CheckpointFailed(RunFailure):
    """The checkpoint of `step` was not written; `dead`: actors found dead on the way (the mesh recovers)."""

    def __init__(self, step: int, cause: BaseException):
        super().__init__(f"checkpoint step {step} failed: {cause}")
        self.step, self.dead = step, set(getattr(cause, "dead", ()))


@dataclass
class PendingCheckpoint:
    staging: str
    step: int
    writes: dict[Any, Coord]
    meta: dict[str, Any]
    started: float
    stall_s: float


class CheckpointSchedule:
    """The checkpoints of a run of `cfg` on `actor_mesh` (an ActorMesh); `say` takes a line for the run's
    events; `tokenizer` (raypar.core.data's record of it) goes in every checkpoint, for `raypar generate`."""

    def __init__(
        self, cfg: Config, actor_mesh: Any, say: Callable[[str], None], tokenizer: dict[str, Any] | None
    ):
        self.cfg, self.actor_mesh, self.say, self.tokenizer = cfg, actor_mesh, say, tokenizer
        self.pending: PendingCheckpoint | None = None
        self.last: str | None = None  # the URI of the last one published (or resumed from)

    def due(self, step: int, end: int) -> bool:
        """Every `checkpoint.every` steps and after the last (also with `checkpoint.every = 0`, whenever
        `checkpoint.dir` is set); also when `--stop-at` ends the run early, so that it can be resumed."""
        every = self.cfg.checkpoint.every
        periodic = bool(every) and step % every == 0
        # the run's end (its last step, or --stop-at) whenever checkpoint.dir is set, with every = 0 too
        final = step == end and bool(self.cfg.checkpoint.dir)
        return step > 0 and (periodic or final)

    def latest(self) -> str | None:
        """The checkpoint a restart loads: the last this run published, else the newest in checkpoint.dir."""
        if self.last or not self.cfg.checkpoint.dir:
            return self.last
        try:
            return checkpoint.resolve(self.cfg.checkpoint.dir)
        except checkpoint.CheckpointError:
            return None

    def begin(self, next_step: int) -> None:
        """Snapshot the state before `next_step` and write it in the background; CheckpointFailed (staging
        removed) if that fails."""
        staging = None
        try:
            start = time.perf_counter()
            staging, writers = self.actor_mesh.begin_checkpoint(self.cfg.checkpoint.dir, next_step)
            meta = self._meta(next_step)
            stall = time.perf_counter() - start
            writes = self.actor_mesh.checkpoint_writes(writers)
        except BaseException as err:  # a failure, or a stop (SIGTERM, Ctrl-C): no staging directory stays
            if staging is not None:
                checkpoint.discard(staging)
            if isinstance(err, RECOVERABLE):
                raise CheckpointFailed(next_step, err) from None
            raise
        self.pending = PendingCheckpoint(staging, next_step, writes, meta, time.perf_counter(), stall)

    def _meta(self, next_step: int) -> dict[str, Any]:
        mesh = self.actor_mesh
        return {
            "tokens": next_step * self.cfg.tokens_per_step,
            "layout": {
                "dp": mesh.dp,
                "pp": mesh.pp,
                "tp": mesh.tp,
                "cp": mesh.cp,
                "ep": self.cfg.parallel.ep,
            },
            "model": dataclasses.asdict(self.cfg.model),
            **mesh.optimizer_state(),  # optimizer_steps (fewer after fp16 skips), loss_scaler
            "data": {
                "seed": self.cfg.train.seed,
                "next_step": next_step,
                "global_batch": self.cfg.train.global_batch,
            },
            "lr_schedule": {
                "next_step": next_step,
                **{k: getattr(self.cfg.train, k) for k in ("lr", "min_lr", "warmup_steps", "steps")},
            },
            "rng": mesh.rng_states(),
            "precision": self.cfg.train.precision,
            "zero": self.cfg.parallel.zero,
            "tokenizer": self.tokenizer,
        }

    def publish(self, wait: bool) -> None:
        """Publish the checkpoint being written in the background once its shards are done (checked
        without blocking at every step boundary; `wait` blocks, before the next one or at the end)."""
        if self.pending is None:
            return
        if (
            not wait
            and ray.wait(list(self.pending.writes), num_returns=len(self.pending.writes), timeout=0)[1]
        ):
            return
        pending = self.pending  # held until published: a stop meanwhile leaves it to drop_pending
        try:
            entries = self.actor_mesh.collect(pending.writes, "writing checkpoint shards")
            uri = checkpoint.publish(
                self.cfg.checkpoint.dir,
                pending.staging,
                pending.step,
                entries,
                pending.meta,
                keep=self.cfg.checkpoint.keep,
            )
        except RECOVERABLE as err:
            self.drop_pending()
            raise CheckpointFailed(pending.step, err) from None
        self.pending = None
        self.last = uri
        self.say(
            f"checkpoint step {pending.step} published: {uri} (training stalled "
            f"{pending.stall_s * 1000:.0f} ms for the snapshot; written in the background in "
            f"{time.perf_counter() - pending.started:.2f}s)"
        )

    def drop_orphaned(self) -> bool:
        """After a recovery that dropped replicas: a checkpoint being written by one of their actors cannot
        complete. Drop it (the last published one stands), rather than meet its failure later as a second
        one for the same lost actor (issue 45). True if one was dropped."""
        pending = self.pending
        if pending is None or all(c in self.actor_mesh.actors for c in pending.writes.values()):
            return False
        self.drop_pending()
        self.say(f"checkpoint step {pending.step} dropped with the replicas writing it; written again")
        return True

    def drop_pending(self) -> None:
        """The checkpoint being written is abandoned: the actors that write it are gone or set up afresh;
        the last published checkpoint stands."""
        if self.pending is not None:
            checkpoint.discard(self.pending.staging)
            self.pending = None
