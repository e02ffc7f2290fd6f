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
import fcntl
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray

from actors.control import RunControl, control_name
from actors.telemetry import StragglerGauges
from collectives.group import GroupError
from collectives.store_actor import home_node_strategy
from raypar.controller import capacity, drain, node_check, shared_paths, stopping
from raypar.controller.actor_calls import StepFailure, StepResult
from raypar.controller.actor_mesh import ActorMesh
from raypar.controller.checkpoint_schedule import RECOVERABLE, CheckpointFailed, CheckpointSchedule
from raypar.controller.connection import NAMESPACE, RunFailure, connect
from raypar.controller.hang_watch import HangWatch
from raypar.controller.mesh_recovery import NoIntactReplica
from raypar.controller.placement import check_device
from raypar.controller.run_log import RunLog
from raypar.controller.run_records import RUN_LOCK
from raypar.core import checkpoint, data
from raypar.core.config.errors import ConfigError
from raypar.core.config.schema import Config, to_toml
from raypar.core.observe import run_copy, trackers
from raypar.core.parallel.mesh import Mesh

# A heal or an auto growth is tried only where the free resources show room for it (_reachable_dp): its
# placement lands at once or lost a race, so it waits this long, not the whole placement budget, which
# would stall training for that long at every step the room stays taken.
HEAL_PLACEMENT_TIMEOUT_S = 10.0


class TrainingLoop:
    """One training run: its directory, actor mesh and control actor, and the loop that survives failures.
    What it records goes through its `log` (raypar.controller.run_log), its checkpoints through its
    `checkpoints` (raypar.controller.checkpoint_schedule)."""

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
        self.log = RunLog(cfg, name, run_dir, self.actor_mesh, progress)
        tokenizer = data.tokenizer_record(cfg.data)  # in every checkpoint, for `raypar generate`
        self.checkpoints = CheckpointSchedule(cfg, self.actor_mesh, self.event, tokenizer)
        self.auto = cfg.parallel.dp == "auto"
        self.target_dp = cfg.dp_fixed
        self.dps = cfg.valid_dps()
        self.restarts = 0
        # of the restarts, those restored from in-memory copies or (HSDP) shard copies in peers (no disk)
        self.memory_recoveries = 0
        self.departures = self.departures_class(self)

    def event(self, text: str) -> None:
        self.log.event(text)

    @property
    def events(self) -> list[str]:
        return self.log.events

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

    # -- failures ----------------------------------------------------------------------------------------
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
                self.checkpoints.drop_pending()
                self.memory_recoveries += 1
                self.event(f"recovered from memory: {what}")
                return resumed
            peers = bool(self.actor_mesh.shard_groups)  # HSDP: every shard has copies in the other groups
            self.event(self.actor_mesh.recover(failure))
            self.memory_recoveries += peers
        except NoIntactReplica as err:
            self.checkpoints.drop_pending()
            ckpt = self.checkpoints.latest()
            self.event(f"{err}; restarting all replicas from {ckpt or 'the initial state (no checkpoint)'}")
            dps = [d for d in self.dps if d <= self.target_dp]
            return self.actor_mesh.restart_all(dps, ckpt, self._heal_wait_s)
        usable = [d for d in self.dps if d <= self.actor_mesh.dp]
        if self.actor_mesh.dp not in self.dps and usable:  # shrink further to a dp the batch splits into
            self.event(self.actor_mesh.scale_to(max(usable), self.cfg.parallel.placement_wait_s))
        return step

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
            control = claim_run_name(self.name, self.dps)
            try:
                self.departures.start(control)
                self.log.announce_wait(control, verdict)
                self.cfg.log = trackers.resolved(self.cfg.log, self.run_dir, self.name)
                (self.run_dir / "config.toml").write_text(to_toml(self.cfg))
                self.log.open_trackers()
                wall = time.perf_counter()
                try:
                    self.actor_mesh.start(self.target_dp)
                    self.log.announce_wait(control, capacity.Verdict())
                    step = 0
                    if self.resume:
                        step = self.actor_mesh.load(self.resume)
                        self.checkpoints.last = self.resume
                        self.event(f"resumed from {self.resume} at step {step}")
                except (GroupError, checkpoint.CheckpointError, ray.exceptions.RayError) as err:
                    raise RunFailure(f"starting the actors failed: {err}") from None
                return self._loop(control, step, wall)
            finally:
                self.departures.stop()
                self.actor_mesh.shutdown()
                self.checkpoints.drop_pending()  # a stop or failure mid-write; after shutdown: no writer left
                ray.kill(control)
                self.log.fail_trackers()
                copied = run_copy.copy_run_dir(self.run_dir, self.cfg.checkpoint.dir, self.name)
                if copied:  # checkpoint.dir is a URI: the run's record goes next to its checkpoints
                    self.event(copied)

    def _loop(self, control: Any, step: int, wall: float) -> dict[str, Any]:
        from tqdm import tqdm

        cfg, actor_mesh, checkpoints = self.cfg, self.actor_mesh, self.checkpoints
        self.log.gauges = StragglerGauges(self.name)
        actor_mesh.hang_watch = HangWatch(
            cfg, self.run_dir, self.event,
            lambda late: control.update.remote({**self.log.status, "late": late}),
        )
        end = min(cfg.train.steps, self.stop_at) if self.stop_at is not None else cfg.train.steps
        first_loss = last = None
        start = step  # a resumed run's first step: its own tokens are those of the steps from here
        self.log.open_files(step)
        bar = tqdm(total=end, initial=step, disable=not self.progress, unit="step", dynamic_ncols=True)
        with bar:
            recovered = False
            checkpointed = step  # the state before `step` is on disk already (resumed) or is the seed's
            rewrite = False  # a checkpoint lost to dead actors (or the last one): write one at this boundary
            while True:
                stopping.check()  # a stop whose interrupt Ray swallowed ends the run here
                completed = None  # the step's result once it is done (its validation may still fail)
                try:  # everything that talks to the actors fails the same way and recovers the same way
                    if rewrite or (checkpointed != step and checkpoints.due(step, end)):
                        checkpoints.publish(wait=True)  # the one before: its failure cannot cost this one
                        checkpointed, rewrite = step, False
                        checkpoints.begin(step)
                    if step >= end:
                        actor_mesh.commit()  # the last update: the actors end holding the trained model
                        checkpoints.publish(wait=True)
                        break
                    checkpoints.publish(wait=False)
                    if not recovered:  # the failed step is redone by the survivors first, then the mesh heals
                        self.departures.leave(step)  # replicas on a draining node move before it goes
                        self._membership(control, step)
                    result = actor_mesh.step(step)
                    recovered, completed = False, result
                    val_loss = actor_mesh.evaluate(step) if _eval_due(cfg, step) else None
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
                    if checkpoints.drop_orphaned():  # written again at this boundary, by the survivors
                        rewrite = True
                    if redo < step:
                        self.log.open_files(redo)
                        bar.reset(total=end)
                        bar.update(redo)
                        checkpointed, rewrite = redo, False
                    step = redo
                    continue
                last = self._log_step(step, result, val_loss, control, bar)
                first_loss = result.loss if first_loss is None else first_loss
                step += 1
        self.log.close_files()
        self.log.finish_trackers()
        return {
            "run": self.name,
            "steps": step,
            "first_loss": first_loss,
            "final_loss": last and last["loss"],
            "tokens": last["tokens"] if last else 0,
            "run_tokens": self.cfg.tokens_per_step * max(step - start, 0),  # trained in this run's wall_s
            "wall_s": time.perf_counter() - wall,
            "run_dir": str(self.run_dir),
            "restarts": self.restarts,
            "memory_recoveries": self.memory_recoveries,
            "checkpoint": checkpoints.last,
        }

    def _log_step(
        self, step: int, result: StepResult, val_loss: float | None, control: Any, bar: Any
    ) -> dict[str, Any]:
        """A completed step, as the run's records and status show it (`log`); returns its record."""
        return self.log.step(
            step, result, val_loss, control, bar, restarts=self.restarts,
            memory_recoveries=self.memory_recoveries, draining=self.departures.status(),
        )

def claim_run_name(name: str, dps: list[int]) -> Any:
    """Create run `name`'s control actor, whose name the cluster holds once: a live run of the same name
    (another run directory, another driver) is refused here, before any of this run's actors starts
    and before their names (`raypar:<run>:dp0.pp0.tp0`, ...) collide in the middle of the start-up."""
    try:
        return RunControl.options(
            name=control_name(name), namespace=NAMESPACE, scheduling_strategy=home_node_strategy()
        ).remote(name, dps)
    except ray.exceptions.ActorAlreadyExistsError:
        raise ConfigError(
            f"--name: a run named {name} is live on this cluster (its actor "
            f"{control_name(name)} exists); wait for it to end or choose another name"
        ) from None



def _eval_due(cfg: Config, step: int) -> bool:
    every = cfg.train.eval_every
    return bool(every) and ((step + 1) % every == 0 or step + 1 == cfg.train.steps)


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
