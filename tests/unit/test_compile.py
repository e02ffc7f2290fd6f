"""`train.compile`: compiled blocks compute what eager ones do, at (dp, pp, tp) = (2, 2, 2) on thread ranks.

One tiny block per stage (n_layers = 2): the regions (raypar.core.model.compiled) are compiled once, by the
first test, for the shapes every later one reuses (one graph serves every block, mode and schedule), so the
suite pays inductor once: three small graphs, forward and backward.

Tolerance: the compiled regions only reorder fp32 sums and fuse roundings (inductor's C++ may contract
a*b+c into one FMA), as another layout does. The longest sum a region computes is the mean of squares over
d_model = 64, whose error is at most gamma_64 = 64 u ~ 3.8e-6 relative (u = 2^-24), and its backward sums
as many terms; rtol 1e-5 leaves room for those two compounding, while a region computing something else
(the control) moves the loss by far more than that.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from raypar.core.model import compiled
from raypar.core.model.compiled import Region, inductor_env, swiglu
from raypar.core.model.llama import LlamaStage, SwiGLU
from raypar.core.parallel.tp import copy_to_tp
from raypar.core.run_config import load_config
from tests.support.pipeline_threads import StepOutcome, assert_step_matches, run_step

RTOL = 1e-5  # the module docstring derives it
COMPILE_TIMEOUT_S = 600  # the first compiled run waits for inductor on a loaded 2-core machine


@pytest.fixture(autouse=True)
def one_compile_thread() -> Iterator[None]:
    """Compile in this process: inductor's default pool of compile processes costs more than it saves on
    three small graphs (what the worker gets by TORCHINDUCTOR_COMPILE_THREADS, see inductor_env)."""
    import torch._inductor.config

    with torch._inductor.config.patch(compile_threads=1):
        yield


def make_cfg(schedule: str):
    return load_config("examples/configs/tiny.toml", [
        "parallel.dp=2", "parallel.pp=2", "parallel.tp=2", f'parallel.schedule="{schedule}"',
        "parallel.microbatches=2", "model.n_layers=2", "train.global_batch=8",
    ])


def prepare(model: LlamaStage, coord, groups, recompute: str, compile_: bool) -> None:  # noqa: ANN001
    model.set_recompute(recompute)
    model.set_compile(compile_)


def step(schedule: str = "1f1b", recompute: str = "none", compile_: bool = True, hook=None) -> StepOutcome:  # noqa: ANN001
    hook = hook or functools.partial(prepare, recompute=recompute, compile_=compile_)
    return run_step(make_cfg(schedule), model_hook=hook, timeout_s=COMPILE_TIMEOUT_S)


@functools.cache
def eager() -> tuple[float, dict[str, torch.Tensor]]:
    """The eager step at (2, 2, 2), 1F1B: what every compiled mode is held to."""
    outcome = step(compile_=False)
    return outcome.loss, outcome.grads


@pytest.mark.parametrize(
    "schedule, recompute",
    [("1f1b", "none"), ("zb-h1", "none"), ("1f1b", "full"), ("1f1b", "selective")],
    ids=["1f1b", "zb-h1", "recompute-full", "recompute-selective"],
)
def test_compiled_step_matches_eager_at_222(schedule: str, recompute: str) -> None:
    assert_step_matches(step(schedule, recompute), eager(), rtol=RTOL)


class SwappedSwiGLU(SwiGLU):
    """A region wired wrong: silu of the up projection times the gate."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp(x, self.group)  # as SwiGLU does without sequence parallelism
        return self.w_down(self.region(swiglu)(self.w_up(x), self.w_gate(x)))


def test_a_region_fed_the_wrong_inputs_is_rejected() -> None:
    """Negative control: the compiled SwiGLU given (up, gate) for (gate, up). Same shapes, so the graphs
    compiled above serve it; same check, fails on the loss."""

    def swap(model: LlamaStage, coord, groups) -> None:  # noqa: ANN001
        model.set_compile(True)
        for module in model.modules():
            if type(module) is SwiGLU:
                module.__class__ = SwappedSwiGLU

    with pytest.raises(AssertionError, match="^loss"):
        assert_step_matches(step(hook=swap), eager(), rtol=RTOL)


class EagerRegion(Region):
    """A region whose calls run `fn` itself: the lock's bookkeeping without inductor."""

    def _run(self, args: tuple) -> torch.Tensor:
        return self.fn(*args)


def test_only_a_new_kind_of_input_takes_the_compile_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    taken = []

    @contextmanager
    def counted() -> Iterator[None]:
        taken.append(True)
        yield

    monkeypatch.setattr(compiled, "compile_lock", counted)
    region, a, b = EagerRegion(swiglu), torch.ones(2, 3), torch.ones(2, 4)
    region(a, a)
    region(a, a)
    assert len(taken) == 1
    region(b, b)  # another shape
    region(a.requires_grad_(), a)  # another autograd signature
    with torch.no_grad():  # grad mode: another graph
        region(a, a)
    assert len(taken) == 4


def test_the_compile_lock_excludes_other_holders(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    monkeypatch.setenv(compiled.CACHE_ENV, str(tmp_path))
    with compiled.compile_lock(), open(tmp_path / "raypar-compile.lock", "a") as other:
        # held: refused at once (LOCK_NB), not waited for
        with pytest.raises(BlockingIOError, match=f"\\[Errno {errno.EWOULDBLOCK}\\]"):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(tmp_path / "raypar-compile.lock", "a") as other:  # released on leaving
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_workers_share_a_node_local_cache_and_compile_on_their_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    assert inductor_env(False, 4) == {}
    monkeypatch.delenv(compiled.CACHE_ENV, raising=False)
    env = inductor_env(True, 4)
    assert env[compiled.THREADS_ENV] == "4"
    assert env[compiled.CACHE_ENV].startswith(tempfile.gettempdir())  # on each node, not the run's directory
    monkeypatch.setenv(compiled.CACHE_ENV, "/fast/disk/inductor")
    assert inductor_env(True, 1)[compiled.CACHE_ENV] == "/fast/disk/inductor"  # the driver's choice wins
