"""What a raylet runs to start each Python worker of the tests' session Rays, in place of Ray's own
`ray/_private/workers/setup_worker.py`.

Ray starts every worker process as `python setup_worker.py default_worker.py ...`: that script reads the
runtime env's context (environment variables, a command prefix, the Python to run), sets it up and exec's
`default_worker.py`. It imports all of Ray to do so (0.36 CPU-seconds on this 2-core machine) and the worker
it exec's imports Ray again: for the ~360 actor processes of the Ray tier, two minutes of CPU. This does
the same for the runtime envs the session Rays see (`env_vars` only: no conda, container or Java), with the
standard library alone. tests/unit/test_lean_setup_worker.py holds it to the pinned Ray's
`RuntimeEnvContext.exec_worker` (environment and command) on such contexts; anything else is handed to Ray's
script unchanged. The Rays that raypar's CLI starts in the cluster tier's subprocesses, and the fake
autoscaling clusters, keep Ray's own (tests/support/lean_ray.py says which Rays use this).

Where the tests switch it on, the worker is then not exec'd but forked from a process that imported it all
already (tests/support/worker_forkserver.py), and this process waits for it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys

if __package__:
    from tests.support import worker_forkserver
else:  # run by a raylet as a script: this folder is sys.path[0]
    import worker_forkserver

PYTHON = "PYTHON"  # ray.core.generated.common_pb2.Language.Name(Language.PYTHON)


def rays_script() -> str:
    """Ray's own setup_worker.py (found without importing Ray)."""
    import importlib.util

    spec = importlib.util.find_spec("ray")
    assert spec is not None and spec.origin is not None
    return os.path.join(os.path.dirname(spec.origin), "_private", "workers", "setup_worker.py")


def command(argv: list[str]) -> list[str] | None:
    """The `bash -c` argument list Ray's script would exec for `argv` (its arguments), with os.environ updated
    as it updates it; None, the environment untouched, where this does not cover the context (Ray's script
    then runs)."""
    worker = worker_command(argv)
    return None if worker is None else _bash(worker)


def _bash(worker: list[str]) -> list[str]:
    python, *args = worker
    return ["bash", "-c", " ".join(["exec", python, *(shlex.quote(a) for a in args)])]


def worker_command(argv: list[str]) -> list[str] | None:
    """The worker's Python and its arguments, as `command` runs them, os.environ updated; None where this does
    not cover the context."""
    context_json, language, rest = None, None, []
    args = iter(argv)
    for arg in args:
        if arg.startswith("--serialized-runtime-env-context="):
            context_json = arg.split("=", 1)[1]
        elif arg == "--serialized-runtime-env-context":
            context_json = next(args)
        elif arg.startswith("--language="):
            language = arg.split("=", 1)[1]
        elif arg == "--language":
            language = next(args)
        else:
            rest.append(arg)
    context = json.loads(context_json or "{}")
    if language != PYTHON or set(context) - {"command_prefix", "env_vars", "py_executable",
                                             "override_worker_entrypoint", "java_jars"}:
        return None
    if context.get("command_prefix") or context.get("java_jars") or context.get("override_worker_entrypoint"):
        return None
    for key, value in (context.get("env_vars") or {}).items():  # ray._private.utils.update_envs
        os.environ[key] = re.sub(r"\$\{[A-Z0-9_]+\}", "", os.path.expandvars(value))
    return [context.get("py_executable") or sys.executable, *rest]


def main() -> None:
    worker = worker_command(sys.argv[1:])
    if worker is None:
        os.execv(sys.executable, [sys.executable, rays_script(), *sys.argv[1:]])
    if worker[0] == sys.executable:  # a fork of the tests' worker fork server, where one serves
        code = worker_forkserver.run_forked(worker[1:])
        if code is not None:
            worker_forkserver.exit_as(code)
    os.execvp("bash", _bash(worker))


if __name__ == "__main__":
    main()
