"""The tests' worker fork server (tests/support/worker_forkserver.py), without Ray: a launcher
(tests/support/lean_setup_worker.py, as a raylet runs it) hands a script to the server for its environment,
and the script runs as a fork of the server with the launcher's environment, directory and stdio; its exit,
or its death by a signal, is the launcher's; a killed launcher takes its fork along. A launcher whose
import-time environment has no server yet starts its script afresh, and a server for it, which ends with
its raylet (here a stand-in process)."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import lean_setup_worker, worker_forkserver

REPO = Path(__file__).resolve().parents[2]
SCRIPT = """
import os, sys
print(os.getpid(), os.getppid(), os.getcwd(), os.environ.get("PROBE"), "torch" in sys.modules, flush=True)
if sys.argv[1] == "kill":
    os.kill(os.getpid(), 9)
if sys.argv[1] == "wait":
    sys.stdin.read()
sys.exit(int(sys.argv[1]) if sys.argv[1].isdigit() else 0)
"""


def readable(fd: int, timeout_s: float) -> bool:
    """Whether `fd` (a pipe, or a pidfd: readable once its process ended) is readable within `timeout_s`.
    By poll: a pytest worker that ran many tests holds descriptors past select's 1024."""
    poll = select.poll()
    poll.register(fd, select.POLLIN)
    return bool(poll.poll(timeout_s * 1000))


def fake_raylet() -> subprocess.Popen:
    """A process that lives until its stdin closes: the raylet a server watches."""
    return subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)


def launcher_env(raylet: subprocess.Popen, **extra: str) -> dict[str, str]:
    return {**os.environ, worker_forkserver.SWITCH_ENV: "1", "RAY_RAYLET_PID": str(raylet.pid), **extra}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, str], int, str]]:
    """A server started as a launcher would start it, for the launchers' environment; the stand-in raylet
    ended at the end, and the server with it."""
    raylet = fake_raylet()
    env = launcher_env(raylet)
    command = [*worker_forkserver.interpreter(), "-m", "tests.support.worker_forkserver",
               worker_forkserver.name(env)]
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    ready = readable(process.stdout.fileno(), 120) and process.stdout.readline().startswith("listening")
    assert ready, "no fork server within 120 s"
    script = tmp_path_factory.mktemp("forkserver") / "probe.py"
    script.write_text(SCRIPT)
    yield env, process.pid, str(script)
    raylet.communicate(timeout=60)
    assert process.wait(timeout=120) == 0


def launch(env: dict[str, str], script: str, arg: str, tmp_path: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, lean_setup_worker.__file__, script, arg, "--language=PYTHON"],
        env={**env, "PROBE": "launcher's"}, cwd=tmp_path,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def processes_with(word: str) -> list[int]:
    """The pids whose command line holds `word`."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if word.encode() in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
        except OSError:
            pass  # ended meanwhile
    return found


def report(line: str) -> tuple[int, int, str, str, bool]:
    pid, parent, cwd, probe, torch = line.split()
    return int(pid), int(parent), cwd, probe, torch == "True"


def test_a_worker_runs_as_a_fork_with_the_launchers_environment_and_exit(server, tmp_path):
    env, server_pid, script = server
    launcher = launch(env, script, "3", tmp_path)
    out, err = launcher.communicate(timeout=120)
    pid, parent, cwd, probe, torch = report(out)
    assert launcher.returncode == 3, err
    assert (parent, torch) == (server_pid, True), "not a fork of the server (torch imported there)"
    assert (cwd, probe) == (str(tmp_path), "launcher's")
    assert pid != launcher.pid


def test_a_worker_killed_by_a_signal_is_a_launcher_killed_by_it(server, tmp_path):
    env, _, script = server
    launcher = launch(env, script, "kill", tmp_path)
    launcher.communicate(timeout=120)
    assert launcher.returncode == -signal.SIGKILL


def test_a_killed_launcher_takes_its_worker_along(server, tmp_path):
    env, server_pid, script = server
    launcher = launch(env, script, "wait", tmp_path)
    pid, parent, *_ = report(launcher.stdout.readline())
    assert parent == server_pid
    worker = os.pidfd_open(pid)
    launcher.kill()
    launcher.wait(timeout=60)
    assert readable(worker, 60), f"the fork {pid} outlived its killed launcher by 60 s"
    os.close(worker)


def test_a_worker_of_another_import_time_environment_starts_afresh_and_starts_its_server(server, tmp_path):
    """The control: a worker whose torch would pick another instruction set is no fork of the server; its
    launcher starts a server for that environment, which ends when its raylet does."""
    _, _, script = server
    raylet = fake_raylet()
    env = launcher_env(raylet, ATEN_CPU_CAPABILITY="avx2")
    launcher = launch(env, script, "0", tmp_path)
    out, err = launcher.communicate(timeout=120)
    pid, parent, _, probe, torch = report(out)
    assert launcher.returncode == 0, err
    assert (pid, parent, torch, probe) == (launcher.pid, os.getpid(), False, "launcher's")
    spawned = processes_with(worker_forkserver.name(env))  # started before the launcher exec'd its worker
    assert len(spawned) == 1, f"{len(spawned)} servers for the worker's environment"
    new_server = os.pidfd_open(spawned[0])
    raylet.communicate(timeout=60)
    assert readable(new_server, 120), "the server outlived its raylet by 120 s"
    os.close(new_server)


def test_a_server_that_cannot_serve_holds_its_name_until_its_raylet_ends(server, tmp_path):
    """A server whose imports fail serves no worker, and keeps its name taken, so that launchers start their
    workers afresh instead of each starting a server that imports all again."""
    _, _, script = server
    raylet = fake_raylet()
    env = launcher_env(raylet, PROBE_SERVER="broken")
    broken = ("import sys; from tests.support import worker_forkserver as w; "
              "w.preload = lambda: 1 / 0; w.serve(sys.argv[1])")
    held = subprocess.Popen([sys.executable, "-c", broken, worker_forkserver.name(env)], cwd=REPO, env=env,
                            stderr=subprocess.PIPE)
    said = ""
    while "not serving" not in said:  # the traceback, then the line
        assert readable(held.stderr.fileno(), 120), f"the broken server said only {said!r} in 120 s"
        chunk = os.read(held.stderr.fileno(), 1 << 16).decode()
        assert chunk, f"the broken server ended, having said {said!r}"
        said += chunk
    assert "ZeroDivisionError" in said, said
    launcher = launch(env, script, "0", tmp_path)
    out, err = launcher.communicate(timeout=120)
    pid, parent, *_ = report(out)
    assert launcher.returncode == 0, err
    assert (pid, parent) == (launcher.pid, os.getpid()), "a worker of a server that cannot serve"
    assert held.poll() is None, "the broken server let its name go before its raylet ended"
    raylet.communicate(timeout=60)
    assert held.wait(timeout=60) == 0


def test_the_server_is_named_by_what_a_fork_keeps():
    """A launcher reaches only the server whose environment a fork of it keeps: a variable read at run time
    may differ, one read at start-up or import (the control) may not."""
    env = {"PATH": "/bin", "OMP_NUM_THREADS": "1", "RAY_JOB_ID": "01000000"}
    assert worker_forkserver.name({**env, "PROBE": "x"}) == worker_forkserver.name(env)
    for key, value in (("OMP_NUM_THREADS", "2"), ("RAY_JOB_ID", "02000000"), ("GLIBC_TUNABLES", "a=1")):
        assert worker_forkserver.name({**env, key: value}) != worker_forkserver.name(env), key


def test_the_server_knows_who_connects():
    """The server forks only for its own user (an abstract socket has no file mode to keep others out): the
    peer's uid, here this process's own, and another's after setuid (root only: the control)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    assert worker_forkserver.peer_uid(ours) == os.getuid()
    ours.close()
    theirs.close()
    if os.getuid() != 0:
        return
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind("\0raypar-test-peer-uid-" + str(os.getpid()))
    listener.listen(1)
    listener.settimeout(60)
    nobody = os.fork()
    if nobody == 0:  # as user `nobody`, connect and wait for the server's close
        try:
            os.setuid(65534)
            peer = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            peer.connect(listener.getsockname())
            peer.recv(1)
        finally:
            os._exit(0)
    connection, _ = listener.accept()
    assert worker_forkserver.peer_uid(connection) == 65534
    connection.close()
    listener.close()
    os.waitpid(nobody, 0)


def test_forks_of_the_preloaded_server_draw_their_own_ids():
    """Ray's C++ id generator is seeded at its first draw: after `preload` no id has been drawn, so each fork
    seeds its own. The control: importing raypar's `actors` (whose `ray.remote` classes draw an id) seeds it
    before the fork, and the same check finds the forks drawing the same ids."""
    probe = ("from tests.support import worker_forkserver as w; w.preload(); before = w.forks_draw_apart(); "
             "import actors.worker; print(before, w.forks_draw_apart())")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["True", "False"], out.stderr
