"""Helpers for tests that drive whole runs (raypar.controller.training.TrainingLoop) in the session's Ray."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from raypar.controller.actor_mesh import ActorMesh
from raypar.controller.training import TrainingLoop
from raypar.core.config.schema import Config
from raypar.core.parallel.mesh import Coord
from raypar.core.run_config import load_config
from tests.support.faults import FaultyActorMesh

TINY = Path(__file__).resolve().parents[2] / "examples" / "configs" / "tiny.toml"


class ActorsStarted(Exception):
    """Raised where the CLI would create the run's actors (the `no_actors` fixture): reaching it means every
    input check passed."""


ACTORS_START = "the run's actors would start here"  # ActorsStarted's message, for pytest.raises(match=)


def tiny(*overrides: str) -> Config:
    return load_config(TINY, ["parallel.timeout_s=15", *overrides])


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def losses(run_dir: Path) -> list[float]:
    return [m["loss"] for m in metrics(run_dir)]


def run(cfg: Config, name: str, run_dir: Path, loop: type = TrainingLoop, **kwargs: Any) -> dict[str, Any]:
    return loop(cfg, name, run_dir, progress=False, **kwargs).execute()


class Background:
    """A run in a thread, so the test can act on it (kill actors, scale) while it trains."""

    def __init__(self, cfg: Config, name: str, run_dir: Path, loop: type = TrainingLoop):
        self.run_dir = run_dir
        self.result: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, args=(cfg, name, run_dir, loop), daemon=True)
        self._thread.start()

    def _main(self, cfg: Config, name: str, run_dir: Path, loop: type) -> None:
        try:
            self.result = run(cfg, name, run_dir, loop)
        except BaseException as err:  # noqa: BLE001 - re-raised in join()
            self.error = err

    def wait_for_step(self, step: int, timeout_s: float = 120) -> None:
        """Block until metrics.jsonl records `step` (polling a file the run appends to, bounded)."""
        deadline = time.monotonic() + timeout_s
        while not any(m["step"] >= step for m in metrics(self.run_dir)):
            if not self._thread.is_alive():
                raise AssertionError(f"run ended before step {step}: {self.error or self.result}")
            if time.monotonic() > deadline:
                raise AssertionError(f"run did not reach step {step} within {timeout_s}s")
            time.sleep(0.05)

    def join(self, timeout_s: float = 300) -> dict[str, Any]:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise AssertionError(f"run did not finish within {timeout_s}s")
        if self.error is not None:
            raise self.error
        return self.result


@contextlib.contextmanager
def started(mesh: ActorMesh) -> Iterator[ActorMesh]:
    """`mesh` started, and shut down on the way out: the one set of actors of a module-scoped fixture."""
    try:
        mesh.start()
        yield mesh
    finally:
        mesh.shutdown()


class FaultyLoop(TrainingLoop):
    """A run whose actors carry `faults`; records the staging directories left when a checkpoint fails."""

    faults: dict[Coord, list[str]] = {}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{"progress": False, **kwargs})
        self.leftovers: list[list[str]] = []

    def mesh_class(self, cfg: Config, name: str) -> FaultyActorMesh:
        return FaultyActorMesh(cfg, name, self.faults)

    def event(self, text: str) -> None:
        if "abandoned" in text:
            root = Path(self.cfg.checkpoint.dir)
            self.leftovers.append(sorted(p.name for p in root.glob(".tmp-*")))
        super().event(text)


def with_faults(faults: dict[Coord, list[str]], base: type[FaultyLoop] = FaultyLoop) -> type[FaultyLoop]:
    """`base` with `faults` added to its own, as a new subclass: assigning `FaultyLoop.faults` instead would
    carry the faults into every later test of the session."""
    merged = {c: list(f) for c, f in base.faults.items()}
    for coord, names in faults.items():
        merged.setdefault(coord, []).extend(names)
    return type(f"{base.__name__}WithFaults", (base,), {"faults": merged})


def killing(at_step: int, *victims: Coord, base: type[FaultyLoop] = FaultyLoop) -> type[FaultyLoop]:
    """A run (`base`, with its faults) in which each of `victims` is killed with SIGKILL as it enters
    step `at_step` (the `kill_at_step` fault)."""
    return with_faults({victim: [f"kill_at_step:{at_step}"] for victim in victims}, base)
