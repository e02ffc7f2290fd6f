"""A fork server for the tests' Ray worker processes: each starts as a fork of a process that has imported
Ray, torch and raypar's modules already, instead of a new interpreter that imports them again.

Every actor is a new Python process, and ~2.8 of the ~2.9 CPU-seconds one costs on a 2-core machine are
imports (torch, Ray, raypar); `make test` starts ~550 of them. Ray has no fork server of its own
(`--worker-preload-modules` imports in each new process), so the tests have this one, switched on by
SWITCH_ENV (tests/conftest.py sets it, so every Ray the tests start inherits it):

- the raylet starts `tests/support/lean_setup_worker.py` for each worker whose actor has a runtime env
  (every raypar actor: its environment variables). That launcher asks the server for its worker
  (`run_forked`): it hands over its argv, environment, working directory and stdin/stdout/stderr, and the
  server forks a child that becomes `default_worker.py` with exactly those. The launcher waits for the child,
  forwards the signals it gets and exits as the child did. Ray knows a worker's process by the worker's own
  registration (its pid, matched to the launcher by the startup token), so the raylet's kills, the state
  API's pids and the tests' `os.kill` all reach the child;
- one server per raylet, job and environment: a fork keeps the server's environment as it was when the
  server started and imported, so only the variables read later may differ (`IMPORT_TIME` lists what may
  not: glibc's malloc tunables, torch's instruction set and threads, the Python path, and every `RAY_*`
  variable, since importing Ray builds its C++ configuration from them once, RAY_JOB_ID included). The
  server's name (an abstract Unix socket) is a digest of exactly those, so a launcher finds the server for
  its worker or none; with none, it starts one (`spawn`) and its own worker the usual way;
- a launcher that is killed closes its connection, and the server kills its child; a server that dies
  closes every connection, and each launcher kills its child; a server ends with its raylet, or when it has
  had no worker for IDLE_S.

tests/unit/test_worker_forkserver.py holds these rules; the Ray tiers run on it.
"""

from __future__ import annotations

import ast
import errno
import hashlib
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import struct
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path

SWITCH_ENV = "RAYPAR_TEST_WORKER_FORKSERVER"  # "1": launchers ask a fork server for their workers
# Environment variables read as a process starts or as the server's modules import (a fork keeps the
# server's values): prefixes.
IMPORT_TIME = ("PYTHON", "LD_", "GLIBC_", "MALLOC", "ATEN_", "ONEDNN_", "DNNL_", "TORCH", "OMP_", "MKL_",
               "KMP_", "OPENBLAS_", "GOTO", "JE_", "ARROW_", "CUDA", "NCCL", "GRPC_", "RAY_")
MAX_MESSAGE = 1 << 20
IDLE_S = 120.0
REPO = Path(__file__).resolve().parents[2]


def preload() -> None:
    """What every worker imports: Ray's worker entry point's modules, torch, and what raypar's `actors`
    modules import. Not `actors` itself: `ray.remote` on a class draws a random id, and Ray's C++ generator,
    seeded at its first draw, would then be the same in every fork, and so would the ids the workers draw
    (two workers' `ray.put`s made one object id; `serve` checks that forks draw apart)."""
    import ray._private.node  # noqa: F401
    import ray._private.worker  # noqa: F401
    import ray.actor  # noqa: F401
    import torch  # noqa: F401

    for module in imports_of(REPO / "actors"):
        importlib.import_module(module)


def imports_of(package: Path) -> list[str]:
    """The modules that the files of `package` import at their top level, from outside it."""
    found: list[str] = []
    for file in sorted(package.glob("*.py")):
        for node in ast.parse(file.read_text()).body:
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            found += [name for name in names if name.split(".")[0] != package.name and name not in found]
    return found


def forks_draw_apart() -> bool:
    """Whether two forks of this process draw different random ids from Ray."""
    from ray._raylet import ObjectID

    drawn = set()
    for _ in range(2):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(write, ObjectID.from_random().binary())
            os._exit(0)
        os.close(write)
        os.waitpid(pid, 0)
        drawn.add(os.read(read, 64))
        os.close(read)
    return len(drawn) == 2


def interpreter() -> list[str]:
    """This Python and the flags that change what it imports (as Ray passes them on to its workers)."""
    flags = (("-S", sys.flags.no_site), ("-s", sys.flags.no_user_site))
    return [sys.executable, *(flag for flag, on in flags if on)]


def name(env: dict[str, str]) -> str:
    """The server (an abstract Unix socket) for workers with environment `env`: a digest of what a fork
    would keep."""
    kept = [interpreter(), sorted((key, value) for key, value in env.items() if key.startswith(IMPORT_TIME))]
    return "raypar-worker-forkserver-" + hashlib.sha256(json.dumps(kept).encode()).hexdigest()[:32]


def peer_uid(connection: socket.socket) -> int:
    """The user id of the process at the other end of a Unix socket (SO_PEERCRED)."""
    creds = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


@dataclass
class _Child:
    pid: int
    pidfd: int
    connection: socket.socket
    launcher_alive: bool = True


@dataclass
class Server:
    """The accept loop: one connection per launcher, one child per connection."""

    listener: socket.socket
    imported: dict[str, str]  # what its imports set in it (a new process's imports set them too)
    selector: selectors.BaseSelector = field(default_factory=selectors.DefaultSelector)

    children: int = 0

    def run(self, raylet: int) -> None:
        """Serve until the raylet `raylet` (a pidfd) ends, or no worker has run for IDLE_S."""
        ended = False

        def raylet_ended(_: object) -> None:
            nonlocal ended
            ended = True

        self.selector.register(self.listener, selectors.EVENT_READ, self._accept)
        self.selector.register(raylet, selectors.EVENT_READ, raylet_ended)
        while not ended:
            events = self.selector.select(timeout=IDLE_S)
            if not events and not self.children:
                return
            for key, _ in events:
                key.data(key.fileobj)

    def _accept(self, listener: socket.socket) -> None:
        connection, _ = listener.accept()
        if peer_uid(connection) != os.getuid():  # an abstract socket has no file mode: any local user may
            connection.close()  # connect, and a fork runs the script it names as this user
            return
        try:
            message, fds, _, _ = socket.recv_fds(connection, MAX_MESSAGE, 3)
            request = json.loads(message)
            refusal = None if len(fds) == 3 else "stdin, stdout and stderr not sent"
        except (OSError, ValueError, KeyError, TypeError) as err:
            fds, refusal = [], f"the request was unreadable ({err!r})"
        if refusal is not None:
            for fd in fds:
                os.close(fd)
            _send(connection, {"refused": refusal})
            connection.close()
            return
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _become_worker({**request, "env": {**request["env"], **self.imported}}, fds)  # never returns
        for fd in fds:
            os.close(fd)
        self.children += 1
        child = _Child(pid, os.pidfd_open(pid), connection)
        self.selector.register(connection, selectors.EVENT_READ, lambda _: self._launcher_gone(child))
        self.selector.register(child.pidfd, selectors.EVENT_READ, lambda _: self._child_exited(child))
        _send(connection, {"pid": pid})

    def _launcher_gone(self, child: _Child) -> None:
        """The launcher's connection closed (the raylet killed it): its worker goes too. By pidfd: the pid
        may already name another process once the child is reaped."""
        self.selector.unregister(child.connection)
        child.launcher_alive = False
        try:
            signal.pidfd_send_signal(child.pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _child_exited(self, child: _Child) -> None:
        _, status = os.waitpid(child.pid, 0)
        self.children -= 1
        self.selector.unregister(child.pidfd)
        os.close(child.pidfd)
        if child.launcher_alive:
            self.selector.unregister(child.connection)
            _send(child.connection, {"exit": os.waitstatus_to_exitcode(status)})
        child.connection.close()


def _send(connection: socket.socket, message: dict) -> None:
    try:
        connection.sendall(json.dumps(message).encode())
    except OSError:
        pass  # the launcher is gone


def _become_worker(request: dict, fds: list[int]) -> None:
    """In the forked child: take the launcher's stdio, environment and directory, close every descriptor of
    the server's (a child holding another launcher's connection would keep it open after that launcher
    dies), and run `default_worker.py` as the launcher's exec would."""
    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in [int(name) for name in os.listdir("/proc/self/fd")]:
            if fd > 2:
                try:
                    os.close(fd)
                except OSError:
                    pass  # the listing's own descriptor, closed already
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(signum, signal.SIG_DFL)
        os.setsid()  # out of the server's process group: a signal to that group is not the worker's
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        script, *_ = sys.argv = list(request["argv"])
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:  # noqa: BLE001 - whatever the worker raised is printed, as Python would
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001, S110 - a stream closed at exit
                pass
        os._exit(code)


def run_forked(argv: list[str]) -> int | None:
    """In a launcher: run the worker `argv` (`default_worker.py` and its arguments) as a fork of its
    server, and return its exit code (-N: killed by signal N); None where the switch is off, or no server
    serves it yet (one is started: the launcher starts this worker itself) or it refused."""
    if os.environ.get(SWITCH_ENV) != "1" or "RAY_RAYLET_PID" not in os.environ or argv[0].startswith("-"):
        return None  # off, not a raylet's worker, or interpreter flags for the worker
    server = name(dict(os.environ))
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        connection.connect("\0" + server)
    except OSError:
        connection.close()
        spawn(server)
        return None
    request = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}
    socket.send_fds(connection, [json.dumps(request).encode()], [0, 1, 2])
    reply = json.loads(connection.recv(MAX_MESSAGE) or b'{"refused": "the server closed the connection"}')
    if "refused" in reply:
        print(f"worker fork server: {reply['refused']}; the worker starts afresh", file=sys.stderr)
        return None
    pid = reply["pid"]

    def forward(signum: int, _frame: object) -> None:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward)
    message = connection.recv(MAX_MESSAGE)
    if not message:
        print("worker fork server: gone before the worker exited; the worker is killed", file=sys.stderr)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return -signal.SIGKILL
    return json.loads(message)["exit"]


def exit_as(code: int) -> None:
    """Exit as a process that ended with `code` did: by its signal where it was killed by one."""
    if code < 0:
        if -code != signal.SIGKILL:  # which has no handler to reset
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


def spawn(server: str) -> None:
    """Start server `server` with this process's environment, detached: in a session of its own, with no
    stdio of the launcher's (it would hold the worker's log, or a pipe, open), and a child of no launcher
    (a launcher becomes its worker, which would leave the server's exit unreaped); its first fork exits at
    once. What it would say is in tests/unit/test_worker_forkserver.py's server, which keeps its stderr."""
    command = [*interpreter(), "-m", "tests.support.worker_forkserver", server]
    first = os.fork()
    if first == 0:
        try:
            os.setsid()
            if os.fork() == 0:
                devnull = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(devnull, fd)
                os.chdir(REPO)
                os.execv(command[0], command)
        finally:
            os._exit(0)
    os.waitpid(first, 0)


def serve(server: str) -> None:
    """Claim the name first (of servers started at once for one name, the others end at once), then import,
    then accept. Prints `listening` once it accepts."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        listener.bind("\0" + server)
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            return  # another launcher's server has it
        raise
    try:
        raylet = os.pidfd_open(int(os.environ["RAY_RAYLET_PID"]))
    except ProcessLookupError:
        return  # its raylet ended already
    env = dict(os.environ)
    try:
        preload()
        apart = forks_draw_apart()
    except Exception:  # noqa: BLE001 - whatever stops it serving is printed, and it serves no worker
        traceback.print_exc()
        apart = False
    if not apart:
        # Holding the name unserved until the raylet ends, so that the launchers' servers end at once (the
        # name is taken) instead of each importing all again: their workers start afresh.
        print("worker fork server: Ray's random ids are seeded before the fork (a module that preload() "
              "imports drew one), or the imports failed: not serving", file=sys.stderr, flush=True)
        waiting = selectors.DefaultSelector()
        waiting.register(raylet, selectors.EVENT_READ)
        waiting.select()  # until the raylet ends
        return
    imported = {key: value for key, value in os.environ.items() if env.get(key) != value}
    listener.listen(64)
    print(f"listening as {server}", flush=True)
    Server(listener, imported).run(raylet)


if __name__ == "__main__":
    serve(sys.argv[1])
