"""The training actor's remote surface: every call the driver, the replica leaders and the neighbours make
on a worker, with the types of the answers. `actors.worker.Worker` implements all of it; the
controller's model-free stand-ins (tests, benchmarks) the part they answer, with the same signatures.

Calls go through `call(handle, WorkerEndpoints.method, *args)`: the endpoint is named by the Protocol's own
method, so a call names one that exists and its arguments are typed against it. Ray-specific options stay
on the implementation (`actors.task_events.per_step` on the per-step methods). The group endpoints
(`join_groups` and the rest) are `collectives.host.GroupHost`'s, called from the collectives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Concatenate, NamedTuple, ParamSpec, Protocol, TypeVar

from raypar.core.observe.hangs import ActorProbe
from raypar.core.observe.profile import ActorProfile
from raypar.core.observe.step_report import StepReport
from raypar.core.parallel.mesh import Coord, StageGroups

if TYPE_CHECKING:
    import torch

# One thread runs the step; on a replica's leader one more waits for its members (`fan_out`); the others
# take `deliver` (from both neighbours at once), `abort` and `where` while they do. `inspect` has a thread
# of its own (WORKER_GROUPS): every remote class of a Worker (subclass) declares it.
WORKER_THREADS = 6

# The concurrency group of `Worker.inspect` (a hang report's probe): a thread that no other call waits on.
INSPECT = "inspect"
WORKER_GROUPS = {INSPECT: 1}

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True)
class Placement:
    """Where an actor runs (`where`): also its liveness ping."""

    name: str
    node_id: str
    pid: int
    ip: str
    cuda: bool  # whether a CUDA device is visible to the process
    gpu_ids: list[str]  # Ray's ids of its GPUs: numbers, or UUIDs from a preset list
    visible: str | None  # CUDA_VISIBLE_DEVICES, which those ids index (actors.devices)


@dataclass(frozen=True)
class SetupInfo:
    params: int  # parameters of this actor's shard
    peak_flops: float | None  # of its device at the run's precision (None: not in the table)


class Peers(NamedTuple):
    """The actors a worker talks to directly: its neighbouring stages at its (tp, cp) rank (the
    `object_store` transport) and the holder of its in-memory copies (checkpoint.in_memory)."""

    prev: Any = None
    next: Any = None
    buddy: Any = None


@dataclass(frozen=True)
class Inventory:
    """Which (step, layout) snapshots an actor has of itself, and of each actor it holds copies for."""

    own: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)
    held: dict[str, list[tuple[int, tuple[int, ...]]]] = field(default_factory=dict)


@dataclass
class Snapshot:
    """An actor's state in host memory (checkpoint.in_memory, actors.buddy): its own, or a copy it holds for
    the actor it is the buddy of (`hold_copy`, `copy_of`)."""

    step: int  # the step to run next: every step before it is applied
    layout: tuple[int, ...]  # replica ids in dp-rank order when it was taken
    state: dict[str, Any]  # "dense", "experts" (owned_state tensors), "step_count", "loss_scaler", "rng"

    @property
    def nbytes(self) -> int:
        parts = (self.state["dense"], self.state["experts"])
        return sum(t.numel() * t.element_size() for part in parts for t in part.values())


@dataclass
class ReplicaAnswer:
    """What one leader says for its replica: each member's result, or the errors that ended the wait."""

    results: dict[Coord, Any] = field(default_factory=dict)
    errors: dict[Coord, BaseException] = field(default_factory=dict)


# A shard of a parameter: (local tensor on the CPU, global shape, offsets of the local part in it)
Shard = tuple["torch.Tensor", tuple[int, ...], tuple[int, ...]]


class WorkerEndpoints(Protocol):
    # -- set-up and membership
    def where(self) -> Placement: ...

    def setup(
        self, cfg: dict, groups: StageGroups, peers: Peers, epoch: int, keep_copies: bool = False
    ) -> SetupInfo: ...

    def rebind(self, groups: StageGroups, peers: Peers, epoch: int) -> None: ...

    def lead(self, members: dict[tuple[int, ...], Any], relays: dict[tuple[int, ...], Any]) -> None: ...

    def fan_out(self, endpoint: Callable[..., Any], args: tuple, timeout_s: float) -> ReplicaAnswer: ...

    # -- steps
    def train_step(self, step: int, commit: int | None = None) -> StepReport: ...

    def eval_step(self, step: int, commit: int | None = None) -> float | None: ...

    def apply_step(self, step: int) -> None: ...

    def abort(self, epoch: int, step: int) -> None: ...

    def take_profile(self) -> ActorProfile | None: ...

    def deliver(self, key: tuple[str, int, int, int, int], refs: list, dtype: str) -> None: ...

    def inspect(self) -> ActorProbe: ...

    # -- state
    def stash_state(self) -> None: ...

    def sync_state(self, src_dp_rank: int) -> None: ...

    def save_shard(self, staging: str) -> bool: ...

    def wait_shard(self) -> list[dict[str, Any]] | None: ...

    def load_state(self, ckpt_uri: str) -> int: ...

    def optimizer_state(self) -> dict[str, Any]: ...

    def rng_state(self) -> dict[str, str]: ...

    def parameters(self) -> dict[str, Shard]: ...

    def memory_inventory(self) -> Inventory: ...

    def restore_memory(self, step: int, source: Any = None) -> None: ...

    def hold_copy(self, owner: str, snap: Snapshot) -> None: ...

    def copy_of(self, owner: str, step: int) -> Snapshot: ...


def call(handle: Any, endpoint: Callable[Concatenate[Any, P], R], *args: P.args, **kwargs: P.kwargs) -> Any:
    """Submit `endpoint` (a `WorkerEndpoints` method) on the actor `handle`; returns the ObjectRef of its
    answer (an R). The one place a method of an actor is called by name."""
    return getattr(handle, endpoint.__name__).remote(*args, **kwargs)
