"""A one-machine autoscaling Ray cluster (Ray's `fake_multinode` provider) that starts and stops cleanly.

    with FakeCluster("examples/cluster-local.yaml") as cluster:
        subprocess.run([sys.executable, "driver.py"], env={**os.environ, **cluster.env})

What was learned getting here (Ray 2.60, Linux):
- `RAY_FAKE_CLUSTER=1 ray start --head --autoscaling-config=...` runs the v1 autoscaler (monitor.py),
  which reads the config as written: Ray's wheel lacks the fake provider's defaults file, so the
  config must list every key (file_mounts, setup_commands, ...), and `prepare_config` cannot be used.
- Fake workers are `ray._private.node.Node`s spawned by the monitor; they find the GCS at
  `provider.gcs_address`, default `<node ip>:6379`. Started on another port, the head needs that key,
  so the config is copied into the cluster's temp dir with it filled in.
- A fake node joined 4-12 s after a placement group asked for `GPU: 1` (2 cores, other tests running).
- `ray stop` ends every Ray process on the machine, including other people's. Instead the head runs
  as `ray start --block` in a new session: every process of the cluster (GCS, raylets, workers, the
  monitor and the fake nodes it spawns) stays in that session, even after being reparented, so the
  session id finds them all, by pid. They get SIGKILL at once: after SIGTERM the GCS, the raylets and
  `ray start` itself (whose atexit hook waits ~30 s to drain its node through a GCS that is already gone)
  were all still alive 10 s later, so a grace before SIGKILL was always waited out in full. Killed
  processes whose parent died become zombies of pid 1, which may reap them late: they count as gone.
- `ray start --head` with RAY_AUTH_MODE unset turns token auth on only if a token already exists
  (`~/.ray/auth_token`, e.g. left by a `ray.init()`); otherwise it warns and runs without. Here
  RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH give the cluster a token of its own, and leave
  `~/.ray` alone. A driver needs both to join: `FakeCluster.env` carries them and RAY_ADDRESS.
- With `--temp-dir` the `ray_current_cluster` file lands in that dir, so `ray.init(address="auto")`
  elsewhere on the machine never finds this cluster by accident.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

_STARTED_LINE = "Ray runtime started"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, session id, start time in clock ticks) of a live process, None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # Fields after "pid (comm)"; comm may itself contain spaces and parentheses.
    fields = raw[raw.rindex(")") + 2 :].split()
    state, session, start_ticks = fields[0], int(fields[3]), int(fields[19])
    if state in ("Z", "X"):  # a zombie has already exited; its parent reaps it
        return None
    return state, session, start_ticks


class FakeCluster:
    """Head + autoscaler on Ray's fake multinode provider, in a private temp dir, on free ports.
    Without a config (`config_path=None`): a plain head of `num_cpus` logical CPUs and no autoscaler, e.g.
    one Ray that a test module's subprocess drivers share; `head_env` is added to the head's environment
    (its raylet's, which its worker processes inherit); `dashboard=False` leaves out the dashboard (and the
    state API it serves), as a local `ray.init(include_dashboard=False)` does; `lean=True` starts the head as
    the session Rays start (tests/support/lean_ray.py: lean worker starts, no log monitor), for a long-lived
    head that many subprocess drivers share.

    On exit it ends only the processes it started (by pid, found through the session the head runs
    in), including the fake worker nodes the autoscaler launched, and removes its temp dir.
    """

    def __init__(
        self,
        config_path: str | os.PathLike[str] | None,
        *,
        num_cpus: int = 0,
        head_env: dict[str, str] | None = None,
        dashboard: bool = True,
        lean: bool = False,
        start_attempts: int = 1,
        start_timeout_s: float = 90.0,
        keep_temp_dir: bool = False,
    ) -> None:
        self.config_path = Path(config_path) if config_path is not None else None
        self.num_cpus = num_cpus
        self.head_env = dict(head_env or {})
        self.dashboard = dashboard
        self.lean = lean
        self.start_attempts = start_attempts
        self.start_timeout_s = start_timeout_s
        self.keep_temp_dir = keep_temp_dir
        self.temp_dir: Path | None = None
        self.address = ""
        self.env: dict[str, str] = {}
        self.seen_pids: set[int] = set()
        self._head: subprocess.Popen[bytes] | None = None
        # (session id, start time in clock ticks) of the head's session and of each node added by hand.
        self._sessions: list[tuple[int, int]] = []
        self._nodes: list[subprocess.Popen[bytes]] = []

    # -- lifecycle ------------------------------------------------------------------------------

    def __enter__(self) -> FakeCluster:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        """Start the head; up to `start_attempts` times when it times out during startup: `ray start` waits
        a fixed 30 s for its raylet to register with the GCS (ray._private.node), which a machine at load
        ~100 missed. A failed attempt's processes and temp dir are gone before the next (stop())."""
        for attempt in range(1, self.start_attempts + 1):
            try:
                self._start_once()
                return
            except RuntimeError as err:
                if "timed out during startup" not in str(err) or attempt == self.start_attempts:
                    raise

    def _start_once(self) -> None:
        if self._head is not None:
            raise RuntimeError("FakeCluster already started")
        # Short path: Ray's unix sockets live under it and must stay below ~107 characters.
        self.temp_dir = Path(tempfile.mkdtemp(prefix="raypar_fake_", dir="/tmp"))
        token = self.temp_dir / "auth_token"
        token.write_text(uuid.uuid4().hex)
        token.chmod(0o600)

        gcs_port = _free_port()
        self.address = f"127.0.0.1:{gcs_port}"
        head: dict[str, Any] = {"CPU": self.num_cpus, "GPU": 0}
        autoscaling: list[str] = []
        if self.config_path is not None:
            config: dict[str, Any] = yaml.safe_load(self.config_path.read_text())
            config["provider"]["gcs_address"] = self.address
            config_copy = self.temp_dir / "autoscaling.yaml"
            config_copy.write_text(yaml.safe_dump(config, sort_keys=False))
            head = config["available_node_types"][config["head_node_type"]]["resources"]
            autoscaling = [f"--autoscaling-config={config_copy}"]

        self.env = {
            "RAY_ADDRESS": self.address,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(token),
        }
        head_env = {**os.environ, **self.env, "RAY_USAGE_STATS_ENABLED": "0", **self.head_env}
        if self.config_path is not None:
            head_env["RAY_FAKE_CLUSTER"] = "1"
        head_env.pop("RAY_ADDRESS")  # `ray start --head` must not try to join anything
        cmd = [
            sys.executable, "-m", "tests.support.lean_ray" if self.lean else "ray.scripts.scripts",
            "start", "--head", "--block",
            f"--temp-dir={self.temp_dir}",
            f"--port={gcs_port}",
            *autoscaling,
            f"--num-cpus={head.get('CPU', 0)}",
            f"--num-gpus={head.get('GPU', 0)}",
            # Every fixed default port moved to a free one, so other Ray instances are not hit.
            f"--ray-client-server-port={_free_port()}",
            f"--dashboard-port={_free_port()}",
            f"--dashboard-agent-listen-port={_free_port()}",
            "--dashboard-host=127.0.0.1",
            *([] if self.dashboard else ["--include-dashboard=false"]),
            "--disable-usage-stats",
        ]  # fmt: skip
        # start_new_session: the session id then names every process of this cluster (see stop()).
        with open(self.temp_dir / "ray_start.log", "wb") as log:
            self._head = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=head_env, start_new_session=True
            )
        self._track(self._head)
        try:
            self._wait_started()
        except BaseException:
            self.stop()
            raise

    def _wait_started(self) -> None:
        assert self._head is not None and self.temp_dir is not None
        log = self.temp_dir / "ray_start.log"
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            text = log.read_text(errors="replace")
            if _STARTED_LINE in text:
                self.pids()
                return
            if self._head.poll() is not None:
                raise RuntimeError(f"ray start exited with {self._head.returncode}:\n{text[-3000:]}")
            time.sleep(0.2)
        raise TimeoutError(f"fake cluster not up after {self.start_timeout_s:.0f} s:\n{text[-3000:]}")

    def _track(self, proc: subprocess.Popen[bytes]) -> None:
        stat = _proc_stat(proc.pid)
        self._sessions.append((proc.pid, stat[2] if stat else 0))

    def pids(self) -> set[int]:
        """Live processes of this cluster (head services, nodes, workers); remembered in seen_pids."""
        found = set()
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            stat = _proc_stat(int(entry.name))
            # Start time guards against a foreign process that reuses a session id after we are gone.
            if stat and any(stat[1] == sid and stat[2] >= ticks for sid, ticks in self._sessions):
                found.add(int(entry.name))
        self.seen_pids |= found
        return found

    def add_node(self, num_cpus: int, wrap: list[str] | None = None, cwd: Path | None = None) -> None:
        """Start one more node (`ray start --address`) in a session of its own, its command run through
        `wrap` (e.g. `unshare -m ...`, which must end by executing its last arguments); wait until up."""
        assert self.temp_dir is not None
        log_path = self.temp_dir / f"node{len(self._nodes)}.log"
        env = {**os.environ, **self.env, "RAY_USAGE_STATS_ENABLED": "0"}
        env.pop("RAY_ADDRESS")
        cmd = [
            sys.executable, "-m", "ray.scripts.scripts", "start", "--block", f"--address={self.address}",
            f"--num-cpus={num_cpus}", "--num-gpus=0", "--disable-usage-stats",
        ]  # fmt: skip
        with open(log_path, "wb") as log:
            node = subprocess.Popen(
                [*(wrap or []), *cmd], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                start_new_session=True,
            )  # fmt: skip
        self._nodes.append(node)
        self._track(node)
        deadline = time.monotonic() + self.start_timeout_s
        while _STARTED_LINE not in (text := log_path.read_text(errors="replace")):
            if node.poll() is not None:
                raise RuntimeError(f"node exited with {node.returncode}:\n{text[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"node not up after {self.start_timeout_s:.0f} s:\n{text[-3000:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        """End every process of this cluster by pid with SIGKILL (see the module's docstring); a second round
        for any process started meanwhile."""
        if self._head is None:
            return
        for _ in range(2):
            alive = self.pids()
            if not alive:
                break
            for pid in alive:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 10.0
            while self.pids() and time.monotonic() < deadline:
                for child in (self._head, *self._nodes):
                    child.poll()  # reap our direct children so they do not linger as zombies
                time.sleep(0.1)
        for child in (self._head, *self._nodes):
            try:
                child.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        left = self.pids()
        self._head, self._nodes = None, []
        if self.temp_dir is not None and not self.keep_temp_dir and not left:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
        if left:
            raise RuntimeError(f"fake cluster processes survived SIGKILL: {sorted(left)}")

    # -- convenience ----------------------------------------------------------------------------

    def run_driver(self, code: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
        """Run `code` in a fresh Python process connected to this cluster (`ray.init()` finds it)."""
        return subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, **self.env},
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )

    def log_tail(self, name: str = "monitor.log", chars: int = 3000) -> str:
        """The end of one of the head's session logs (monitor.log shows the autoscaler's decisions)."""
        if self.temp_dir is None:
            return ""
        path = self.temp_dir / "session_latest" / "logs" / name
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def live_processes_mentioning(text: str) -> list[int]:
    """Live (not zombie) processes whose command line contains `text`: read from /proc, independently of
    a FakeCluster's own bookkeeping."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and text.encode() in (proc / "cmdline").read_bytes():
                if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    found.append(int(proc.name))
        except OSError:
            pass
    return found
