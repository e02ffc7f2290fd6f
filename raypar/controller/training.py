"""What `raypar train` runs once the config is valid: the step loop and everything around it.

Per step: apply a pending scale request or heal toward the target dp, run the step, log it
(metrics.jsonl, timeline.jsonl, progress bar, the run's control actor), and checkpoint on schedule. A step
that fails because actors died is redone: by the intact replicas at once, or after restarting every
replica from the last checkpoint; with checkpoint.in_memory, after replacing the lost replica and
restoring every actor from host memory (its own snapshot, or its buddy's copy), falling back to the
checkpoint when the copies cannot do it. Because the global batch and sample order do not depend on dp,
none of this changes the loss curve.

Anything that fails between steps (an actor lost during a scale, a heal or a checkpoint snapshot, a
placement timeout, groups that do not form, storage errors) is recovered the same way and counts against
train.max_failures the same way; so does a failure during a recovery. A step is complete once its phase 1
finished everywhere: it is logged then, exactly once, and its update is applied by every intact replica
whatever fails next. A checkpoint whose writing fails costs only itself (its staging directory is removed)
and is not counted against train.max_failures; one lost to a dead actor, or the run's last one, is written
again (and counted).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import ray

from actors.control import RunControl, control_name
from actors.telemetry import StragglerGauges
from collectives.group import GroupError
from collectives.store_actor import home_node_strategy
from raypar.controller import capacity, drain, node_check, profiles, shared_paths, stopping
from raypar.controller.actor_calls import StepFailure
from raypar.controller.actor_mesh import ActorMesh, NoIntactReplica, StepResult
from raypar.controller.connection import NAMESPACE, RunFailure, connect
from raypar.controller.hang_watch import HangWatch
from raypar.controller.placement import check_device
from raypar.controller.run_records import RUN_LOCK
from raypar.core import checkpoint, data, plain_files
from raypar.core.config.errors import ConfigError
from raypar.core.config.schema import Config, to_toml
from raypar.core.observe import run_copy, step_report, stragglers, timeline, trackers
from raypar.core.observe.flops import mfu
from raypar.core.parallel.mesh import Coord, Mesh

# A heal or an auto growth is tried only where the free resources show room for it (_reachable_dp): its
# placement lands at once or lost a race, so it waits this long, not the whole placement budget, which
# would stall training for that long at every step the room stays taken.
HEAL_PLACEMENT_TIMEOUT_S = 10.0
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


class TrainingLoop:
    """One training run: its directory, actor mesh, control actor and checkpoint schedule."""

    mesh_class: Any = ActorMesh  # tests swap in a subclass that injects faults
    departures_class: Any = drain.Departures  # leaving draining nodes; tests swap in one that ignores them

    def __init__(
        self,
        cfg: Config,
        name: str,
        run_dir: Path,
        address: str | None = None,
        resume: str | None = None,
        stop_at: int | None = None,
        progress: bool = True,
        samples: tuple[int, int] | None = None,
    ):
        self.cfg, self.name, self.run_dir, self.address = cfg, name, run_dir, address
        self.resume, self.stop_at, self.progress = resume, stop_at, progress
        # the driver's dataset sizes where the CLI has counted them (None: the node check opens the data)
        self.samples = samples
        self.actor_mesh = self.mesh_class(cfg, name)
        self.tokens_per_step = cfg.train.global_batch * cfg.model.seq_len
        par = cfg.parallel
        self.auto = par.dp == "auto"
        self.target_dp = cfg.dp_fixed
        self.dps = cfg.valid_dps()
        self.restarts = 0
        # of the restarts, those restored from in-memory copies or (HSDP) shard copies in peers (no disk)
        self.memory_recoveries = 0
        self.pending: PendingCheckpoint | None = None
        self.last_checkpoint: str | None = None
        self.events: list[str] = []
        self.logs: dict[str, TextIO] = {}
        self.tokenizer = data.tokenizer_record(cfg.data)  # in every checkpoint, for `raypar generate`
        self.val_loss: float | None = None  # the latest, for the progress bar
        self.status: dict[str, Any] = {"run": name, "step": None}  # the last posted to the control actor
        self.trackers: trackers.TrackerSink | None = None  # [log] backends: fed what metrics.jsonl gets
        self.departures = self.departures_class(self)

    # -- log ---------------------------------------------------------------------------------------------
    def event(self, text: str) -> None:
        self.events.append(text)
        line = f"raypar: {text}"
        if self.progress:
            from tqdm import tqdm

            tqdm.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)
        with open(self.run_dir / "events.jsonl", "a") as f:
            f.write(json.dumps({"time": time.time(), "event": text}) + "\n")

    def _open_logs(self, start_step: int) -> None:
        """(Re)open metrics.jsonl and timeline.jsonl keeping only the records of steps before `start_step`:
        a resumed run continues its own files, and a run rolled back to a checkpoint logs each step once.
        The records of the steps redone are moved to <name>.rewound.jsonl, not dropped: nothing shortens
        the record of what ran. Rewritten aside and renamed into place (a crash keeps the old file)."""
        self._close_logs()
        for name in ("metrics.jsonl", "timeline.jsonl"):
            path = self.run_dir / name
            lines = _lines(path)
            kept = [line for line in lines if json.loads(line)["step"] < start_step]
            if len(kept) < len(lines):
                with open(path.with_suffix(".rewound.jsonl"), "a") as rewound:
                    rewound.writelines(line for line in lines if json.loads(line)["step"] >= start_step)
            plain_files.write_aside(path, "".join(kept).encode())
            self.logs[name] = open(path, "a")

    def _close_logs(self) -> None:
        for f in self.logs.values():
            f.close()
        self.logs.clear()

    # -- checkpoints -------------------------------------------------------------------------------------
    def _checkpoint(self, next_step: int) -> None:
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
        return {
            "tokens": next_step * self.tokens_per_step,
            "layout": {
                "dp": self.actor_mesh.dp,
                "pp": self.actor_mesh.pp,
                "tp": self.actor_mesh.tp,
                "cp": self.actor_mesh.cp,
                "ep": self.cfg.parallel.ep,
            },
            "model": dataclasses.asdict(self.cfg.model),
            **self.actor_mesh.optimizer_state(),  # optimizer_steps (fewer after fp16 skips), loss_scaler
            "data": {
                "seed": self.cfg.train.seed,
                "next_step": next_step,
                "global_batch": self.cfg.train.global_batch,
            },
            "lr_schedule": {
                "next_step": next_step,
                **{k: getattr(self.cfg.train, k) for k in ("lr", "min_lr", "warmup_steps", "steps")},
            },
            "rng": self.actor_mesh.rng_states(),
            "precision": self.cfg.train.precision,
            "zero": self.cfg.parallel.zero,
            "tokenizer": self.tokenizer,
        }

    def _publish(self, wait: bool) -> None:
        """Publish the checkpoint being written in the background once its shards are done (checked
        without blocking at every step boundary; `wait` blocks, before the next one or at the end)."""
        if self.pending is None:
            return
        if (
            not wait
            and ray.wait(list(self.pending.writes), num_returns=len(self.pending.writes), timeout=0)[1]
        ):
            return
        pending = self.pending  # held until published: a stop meanwhile leaves it to _drop_pending
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
            self._drop_pending()
            raise CheckpointFailed(pending.step, err) from None
        self.pending = None
        self.last_checkpoint = uri
        self.event(
            f"checkpoint step {pending.step} published: {uri} (training stalled "
            f"{pending.stall_s * 1000:.0f} ms for the snapshot; written in the background in "
            f"{time.perf_counter() - pending.started:.2f}s)"
        )

    # -- membership --------------------------------------------------------------------------------------
    def _membership(self, control: Any, step: int) -> None:
        mesh = self.actor_mesh
        requested = ray.get(control.take_request.remote(), timeout=30)
        if requested is not None and requested != self.target_dp:
            self.target_dp = requested
            start = time.perf_counter()
            self.event(
                self.actor_mesh.scale_to(requested, self.cfg.parallel.placement_wait_s)
                + f" (before step {step}, {time.perf_counter() - start:.1f}s)"
            )
        elif self.auto and (target := self._reachable_dp(max(self.dps))) > mesh.dp:
            self.event("auto: " + mesh.scale_to(target, self._heal_wait_s))
        elif (target := self._reachable_dp(self.target_dp)) > mesh.dp:
            self.event("healing: " + mesh.scale_to(target, self._heal_wait_s))

    @property
    def _heal_wait_s(self) -> float:
        """HEAL_PLACEMENT_TIMEOUT_S, and never more than parallel.placement_timeout_s: that key bounds every
        placement wait."""
        return min(HEAL_PLACEMENT_TIMEOUT_S, self.cfg.parallel.placement_wait_s)

    def _reachable_dp(self, limit: int) -> int:
        """The largest dp up to `limit` that the run accepts and that the free resources could hold now: a
        heal or growth aims there, not at a dp between valid ones (which scale_to would release again), and
        not while the room for the next valid dp is missing (which would cost a placement timeout a step)."""
        mesh = self.actor_mesh
        room = mesh.dp + _replicas_with_room(mesh, set(self.departures.draining()))
        return max([d for d in self.dps if d <= min(limit, room)], default=mesh.dp)

    def _recover(self, failure: BaseException, step: int) -> int:
        """Continue after `failure` (before `step` ran, or of `step` itself); returns the step to run next.
        Every failure counts against train.max_failures, including one during the recovery itself."""
        if isinstance(failure, StepFailure) and failure.step is not None and not failure.dead:
            raise failure  # a worker raised in its step, and nothing died: a bug, not a fault to recover
        while True:
            self.restarts += 1
            if self.restarts > self.cfg.train.max_failures:
                raise RunFailure(
                    f"giving up after {self.restarts} failures (train.max_failures="
                    f"{self.cfg.train.max_failures}); last: {failure}"
                )
            try:
                return self._recover_once(failure, step)
            except RECOVERABLE as again:
                failure = again

    def _recover_once(self, failure: BaseException, step: int) -> int:
        if isinstance(failure, CheckpointFailed) and not failure.dead:
            self.event(f"{failure}; abandoned, training goes on")
            return step
        when = "" if getattr(failure, "step", None) == step else f" (before step {step})"
        self.event(f"failure {self.restarts}{when}: {failure}; recovering")
        try:
            if self.cfg.checkpoint.in_memory:  # every replica rebuilt, its state from host memory
                resumed, what = self.actor_mesh.restore_from_memory(failure)
                self._drop_pending()
                self.memory_recoveries += 1
                self.event(f"recovered from memory: {what}")
                return resumed
            peers = bool(self.actor_mesh.shard_groups)  # HSDP: every shard has copies in the other groups
            self.event(self.actor_mesh.recover(failure))
            self.memory_recoveries += peers
        except NoIntactReplica as err:
            self._drop_pending()
            ckpt = self.last_checkpoint or _latest(self.cfg.checkpoint.dir)
            self.event(f"{err}; restarting all replicas from {ckpt or 'the initial state (no checkpoint)'}")
            dps = [d for d in self.dps if d <= self.target_dp]
            return self.actor_mesh.restart_all(dps, ckpt, self._heal_wait_s)
        usable = [d for d in self.dps if d <= self.actor_mesh.dp]
        if self.actor_mesh.dp not in self.dps and usable:  # shrink further to a dp the batch splits into
            self.event(self.actor_mesh.scale_to(max(usable), self.cfg.parallel.placement_wait_s))
        return step

    def _drop_orphaned_checkpoint(self) -> bool:
        """After a recovery that dropped replicas: a checkpoint being written by one of their actors cannot
        complete. Drop it (the last published one stands), rather than meet its failure later as a second
        one for the same lost actor (issue 45). True if one was dropped."""
        pending = self.pending
        if pending is None or all(c in self.actor_mesh.actors for c in pending.writes.values()):
            return False
        self._drop_pending()
        self.event(f"checkpoint step {pending.step} dropped with the replicas writing it; written again")
        return True

    def _drop_pending(self) -> None:
        """The checkpoint being written is abandoned: the actors that write it are gone or set up afresh;
        the last published checkpoint stands."""
        if self.pending is not None:
            checkpoint.discard(self.pending.staging)
            self.pending = None

    # -- the loop ----------------------------------------------------------------------------------------
    def execute(self) -> dict[str, Any]:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with hold_run_dir(self.run_dir):  # before anything is written there: a live run's files stay its own
            par = self.cfg.parallel
            cpus = local_ray_cpus(self.actor_mesh.mesh_at(self.target_dp), par.threads_per_actor)
            connect(self.address, num_cpus=cpus)
            stopping.install()  # again: ray.init installs a SIGTERM handler of its own
            check_device(par.device, par.gpus_per_actor)
            # before any actor: a node-local checkpoint.dir is refused, also one that nodes to come cannot see
            known = shared_paths.check_nodes(self.cfg, self.samples)
            node_check.check_autoscaled_storage(self.cfg, self.address, seen_elsewhere=len(known) > 1)
            self.actor_mesh.node_check = node_check.NodeCheck(self.cfg, self.samples, known)
            self.actor_mesh.say = self.event
            # and a layout no node (or node type) can hold; one that needs more nodes says so
            verdict = capacity.check(self.cfg, self.target_dp)
            control = self._claim_name()
            try:
                self.departures.start(control)
                self._announce_wait(control, verdict)
                self.cfg.log = trackers.resolved(self.cfg.log, self.run_dir, self.name)
                (self.run_dir / "config.toml").write_text(to_toml(self.cfg))
                self._open_trackers()
                wall = time.perf_counter()
                try:
                    self.actor_mesh.start(self.target_dp)
                    self._announce_wait(control, capacity.Verdict())
                    step = 0
                    if self.resume:
                        step = self.actor_mesh.load(self.resume)
                        self.last_checkpoint = self.resume
                        self.event(f"resumed from {self.resume} at step {step}")
                except (GroupError, checkpoint.CheckpointError, ray.exceptions.RayError) as err:
                    raise RunFailure(f"starting the actors failed: {err}") from None
                return self._loop(control, step, wall)
            finally:
                self.departures.stop()
                self.actor_mesh.shutdown()
                self._drop_pending()  # a stop or a failure mid-write; after shutdown, so no writer is left
                ray.kill(control)
                if self.trackers is not None:  # the run failed or was stopped: its tracker runs say so
                    self.trackers.close(ok=False)
                copied = run_copy.copy_run_dir(self.run_dir, self.cfg.checkpoint.dir, self.name)
                if copied:  # checkpoint.dir is a URI: the run's record goes next to its checkpoints
                    self.event(copied)

    def _announce_wait(self, control: Any, verdict: capacity.Verdict) -> None:
        """While the run waits for nodes the autoscaler adds, its line and `raypar status` say what for;
        once placed (a verdict that fits), status stops saying it."""
        if not verdict.fits_now:
            self.event(verdict.line(self.cfg.parallel.placement_wait_s))
            self.status = {**self.status, "waiting": verdict.describe()}
        elif "waiting" in self.status:
            self.status = {k: v for k, v in self.status.items() if k != "waiting"}
        else:
            return
        control.update.remote(self.status)

    def _open_trackers(self) -> None:
        if self.cfg.log.backends:
            try:
                self.trackers = trackers.TrackerSink(self.cfg, self.run_dir, self.name, self.event)
            except trackers.TrackerError as err:
                raise RunFailure(str(err)) from None

    def _claim_name(self) -> Any:
        """Create the run's control actor, whose name the cluster holds once: a live run of the same name
        (another run directory, another driver) is refused here, before any of this run's actors starts
        and before their names (`raypar:<run>:dp0.pp0.tp0`, ...) collide in the middle of the start-up."""
        try:
            return RunControl.options(
                name=control_name(self.name), namespace=NAMESPACE, scheduling_strategy=home_node_strategy()
            ).remote(self.name, self.dps)
        except ray.exceptions.ActorAlreadyExistsError:
            raise ConfigError(
                f"--name: a run named {self.name} is live on this cluster (its actor "
                f"{control_name(self.name)} exists); wait for it to end or choose another name"
            ) from None

    def _loop(self, control: Any, step: int, wall: float) -> dict[str, Any]:
        from tqdm import tqdm

        cfg, actor_mesh = self.cfg, self.actor_mesh
        self.gauges = StragglerGauges(self.name)
        actor_mesh.hang_watch = HangWatch(
            cfg, self.run_dir, self.event, lambda late: control.update.remote({**self.status, "late": late})
        )
        end = min(cfg.train.steps, self.stop_at) if self.stop_at is not None else cfg.train.steps
        first_loss = last = None
        start = step  # a resumed run's first step: its own tokens are those of the steps from here
        self._open_logs(step)
        bar = tqdm(total=end, initial=step, disable=not self.progress, unit="step", dynamic_ncols=True)
        with bar:
            recovered = False
            checkpointed = step  # the state before `step` is on disk already (resumed) or is the seed's
            rewrite = False  # a checkpoint lost to dead actors (or the last one): write one at this boundary
            while True:
                stopping.check()  # a stop whose interrupt Ray swallowed ends the run here
                completed = None  # the step's result once it is done (its validation may still fail)
                try:  # everything that talks to the actors fails the same way and recovers the same way
                    if rewrite or (checkpointed != step and self._checkpoint_due(step, end)):
                        self._publish(wait=True)  # the one before, so that its failure cannot cost this one
                        checkpointed, rewrite = step, False
                        self._checkpoint(step)
                    if step >= end:
                        actor_mesh.commit()  # the last update: the actors end holding the trained model
                        self._publish(wait=True)
                        break
                    self._publish(wait=False)
                    if not recovered:  # the failed step is redone by the survivors first, then the mesh heals
                        self.departures.leave(step)  # replicas on a draining node move before it goes
                        self._membership(control, step)
                    result = actor_mesh.step(step)
                    recovered, completed = False, result
                    val_loss = actor_mesh.evaluate(step) if self._eval_due(step) else None
                except RECOVERABLE as failure:
                    recovered = True
                    if completed is not None:  # only the validation after it failed: the step stands
                        last = self._log_step(step, completed, None, control, bar)
                        first_loss = completed.loss if first_loss is None else first_loss
                        step, completed = step + 1, None
                    if isinstance(failure, CheckpointFailed) and (failure.dead or failure.step == end):
                        rewrite = True
                    elif isinstance(failure, CheckpointFailed):
                        # A write that failed (a full disk, storage refusing) costs that checkpoint only,
                        # not one of train.max_failures: a disk full for many checkpoints would end the run.
                        # Only the run's last checkpoint, written again until it lands, counts.
                        self.event(f"{failure}; abandoned, training goes on")
                        continue
                    redo = self._recover(failure, step)
                    if self._drop_orphaned_checkpoint():  # written again at this boundary, by the survivors
                        rewrite = True
                    if redo < step:
                        self._open_logs(redo)
                        bar.reset(total=end)
                        bar.update(redo)
                        checkpointed, rewrite = redo, False
                    step = redo
                    continue
                last = self._log_step(step, result, val_loss, control, bar)
                first_loss = result.loss if first_loss is None else first_loss
                step += 1
        self._close_logs()
        if self.trackers is not None:  # the report's pictures as artifacts, and the tracker runs end
            self.trackers.finish(self.run_dir)
            self.trackers = None
        return {
            "run": self.name,
            "steps": step,
            "first_loss": first_loss,
            "final_loss": last and last["loss"],
            "tokens": last["tokens"] if last else 0,
            "run_tokens": self.tokens_per_step * max(step - start, 0),  # trained in this run's wall_s
            "wall_s": time.perf_counter() - wall,
            "run_dir": str(self.run_dir),
            "restarts": self.restarts,
            "memory_recoveries": self.memory_recoveries,
            "checkpoint": self.last_checkpoint,
        }

    def _log_step(
        self, step: int, result: StepResult, val_loss: float | None, control: Any, bar: Any
    ) -> dict[str, Any]:
        """metrics.jsonl, timeline.jsonl, the control actor and the progress bar for a completed step."""
        rows = timeline.timeline_rows(step, result.per_actor)
        slowest, lags = stragglers.straggler(result.per_actor)
        # a model-free stand-in reports none: every token a target
        counted = (r.target_tokens for r in result.per_actor.values())
        target_tokens = max(counted, default=0) or self.tokens_per_step
        record = {
            "step": step,
            "loss": result.loss,
            "grad_norm": result.grad_norm,
            "lr": result.lr,
            "tokens": self.tokens_per_step * (step + 1),
            "step_time_s": result.step_time_s,
            "tokens_per_s": self.tokens_per_step / result.step_time_s,
            # the tokens trained on (fine-tuning: assistant / completion tokens; raypar.core.data.documents)
            "target_tokens": target_tokens,
            "target_tokens_per_s": target_tokens / result.step_time_s,
            "dp": self.actor_mesh.dp,
            "pp": self.actor_mesh.pp,
            "tp": self.actor_mesh.tp,
            "cp": self.actor_mesh.cp,
            "restarts": self.restarts,
            "memory_recoveries": self.memory_recoveries,
            "val_loss": val_loss,
            "model_state_bytes": max(r.memory.model_state_bytes for r in result.per_actor.values()),
            "dp_bytes": sum(r.reduce_bytes + r.gather_bytes for r in result.per_actor.values()),
            # the slowest actor's host update (train.offload = "cpu"; 0 otherwise), the previous step's
            "offload_update_s": max(r.offload_update_s for r in result.per_actor.values()),
            "bubble_fraction": timeline.measured_bubble(rows),
            "mfu": mfu(self.tokens_per_step / result.step_time_s, self.cfg.model, self.actor_mesh.peak_flops)
            if self.actor_mesh.peak_flops
            else None,
            "loss_scale": result.loss_scale,
            "skipped": result.skipped,
            # the actor computing longest over its stage peers' median (None: no actor lags its peers)
            "straggler": slowest and self.actor_mesh.name(slowest),
            "straggler_lag_s": lags[slowest] if slowest else 0.0,
            **step_report.worst(r.memory for r in result.per_actor.values()),
        }
        if result.moe is not None:  # aux_loss, dropped_tokens, expert_load (layer -> per expert)
            record.update(result.moe)
        self.logs["metrics.jsonl"].write(json.dumps(record) + "\n")
        self.logs["metrics.jsonl"].flush()
        self.logs["timeline.jsonl"].writelines(json.dumps(r) + "\n" for r in rows)
        if self.trackers is not None:
            self.trackers.log(record)
        if (profiled := self.cfg.train.profiled) and step == profiled[1]:
            self.event(profiles.write(self.actor_mesh, self.run_dir))
        self.status = self._status(record, lags)
        control.update.remote(self.status)
        self.gauges.record(lags, record["straggler"], record["straggler_lag_s"])
        if val_loss is not None:
            self.val_loss = val_loss
        shown = {} if self.val_loss is None else {"val": f"{self.val_loss:.4f}"}
        tok_s = f"{record['tokens_per_s']:.0f}"
        bar.set_postfix(loss=f"{result.loss:.4f}", **shown, tok_s=tok_s, dp=self.actor_mesh.dp)
        bar.update(1)
        return record

    def _eval_due(self, step: int) -> bool:
        every = self.cfg.train.eval_every
        return bool(every) and ((step + 1) % every == 0 or step + 1 == self.cfg.train.steps)

    def _checkpoint_due(self, step: int, end: int) -> bool:
        """Every `checkpoint.every` steps and after the last (also with `checkpoint.every = 0`, whenever
        `checkpoint.dir` is set); also when `--stop-at` ends the run early, so that it can be resumed."""
        every = self.cfg.checkpoint.every
        periodic = bool(every) and step % every == 0
        # the run's end (its last step, or --stop-at) whenever checkpoint.dir is set, with every = 0 too
        final = step == end and bool(self.cfg.checkpoint.dir)
        return step > 0 and (periodic or final)

    def _status(self, record: dict[str, Any], lags: dict[Coord, float]) -> dict[str, Any]:
        placed = self.actor_mesh.nodes
        return {
            "run": self.name,
            "step": record["step"],
            "steps": self.cfg.train.steps,
            "loss": record["loss"],
            "tokens_per_s": record["tokens_per_s"],
            "dp": record["dp"],
            "pp": record["pp"],
            "tp": record["tp"],
            "cp": record["cp"],
            "restarts": self.restarts,
            "run_dir": str(self.run_dir),
            "draining": self.departures.status(),
            "actors": {
                self.actor_mesh.name(c): {**dataclasses.asdict(w), "lag_s": lags.get(c)}
                for c, w in sorted(placed.items())
            },
        }


@contextlib.contextmanager
def hold_run_dir(run_dir: Path) -> Iterator[None]:
    """Hold `run_dir` for one run: an exclusive flock on its lock file while the block runs, so a second run
    there (the same --name or --run-dir, from any process on this machine or one sharing the directory) is
    refused with ConfigError instead of overwriting config.toml and truncating or interleaving
    metrics.jsonl. The kernel drops the lock when its holder exits, even by kill -9: a finished or killed
    run's directory is free again (to --resume into, or to reuse)."""
    path = run_dir / RUN_LOCK
    with open(path, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            raise ConfigError(
                f"--run-dir: {run_dir} is in use by another run ({holder} holds {path}); wait for it to end "
                "or choose another --name or --run-dir"
            ) from None
        lock.truncate(0)  # who holds it, for the message above
        lock.write(f"pid {os.getpid()} on {socket.gethostname()}")
        lock.flush()
        yield


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines(keepends=True) if path.exists() else []


def _latest(root: str) -> str | None:
    if not root:
        return None
    try:
        return checkpoint.resolve(root)
    except checkpoint.CheckpointError:
        return None


def local_ray_cpus(mesh: Mesh, threads_per_actor: int) -> int:
    """The CPUs a new local Ray offers: this machine's, or more where the run's actors (all of `mesh`'s, each
    `threads_per_actor` CPUs) need more; fewer would leave their placement groups waiting for room."""
    return max(os.cpu_count() or 1, mesh.world_size * threads_per_actor)


def _replicas_with_room(actor_mesh: ActorMesh, draining: set[str] | frozenset[str] = frozenset()) -> int:
    """How many more replicas the free resources could hold (the placement itself decides for sure). Not
    on nodes the run refused (node_check.NodeCheck: they cannot see its storage): a heal would land there,
    be released again, and say so at every step while they stay free; nor on `draining` nodes, where Ray
    places nothing (a heal would wait out its placement timeout at every step)."""
    per_replica = actor_mesh.mesh.replica_size
    free = dict(ray.available_resources())
    refused = actor_mesh.node_check.refused if actor_mesh.node_check is not None else {}
    avoided = set(refused) | draining
    for node in ray.nodes() if avoided else ():
        if node["NodeID"] in avoided and node["Alive"]:
            for key, total in node["Resources"].items():
                free[key] = max(0.0, free.get(key, 0.0) - total)
    res = actor_mesh.resources
    fits = int(free.get("CPU", 0) // (per_replica * res.cpus))
    if res.gpus:
        fits = min(fits, int(free.get("GPU", 0) // (per_replica * res.gpus)))
    return fits
