"""tests/support/lean_setup_worker.py, the tests' stand-in for Ray's setup_worker.py, against the pinned Ray's
own: for the same arguments it must leave the same environment and exec the same command, or hand the
context to Ray's script."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

from tests.support import lean_setup_worker

# What a raylet passes (services.start_raylet's python_worker_command, then the runtime env's context and the
# worker's dynamic options), with a few runtime env contexts of the kind the session Rays see.
WORKER = ["/venv/lib/ray/_private/workers/default_worker.py", "--node-ip-address=10.0.0.1",
          "--node-manager-port=41000", "--object-store-name=/tmp/ray/s/plasma",
          "--raylet-name=/tmp/ray/s/raylet",
          "--redis-address=None", "--temp-dir=/tmp/ray", "--webui=", "--startup-token", "12",
          "--worker-launch-time-ms=1765000000000"]  # fmt: skip
CONTEXTS = {
    "none": '{"command_prefix": [], "env_vars": {}, "py_executable": null}',
    "env_vars": '{"env_vars": {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "A": "x y$z"}}',
    "expanded": '{"env_vars": {"P": "${HOME_OF_TEST}/bin:${UNSET_OF_TEST}"}, '
                '"py_executable": "/usr/bin/python3"}',
    "quoted": '{"env_vars": {"Q": "it\'s"}}',
}


def _environ(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """A fresh os.environ for one side of the comparison (both read and write it)."""
    env = {"HOME_OF_TEST": "/home/t", "PATH": "/bin"}
    monkeypatch.setattr(os, "environ", env)
    return env


def rays(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, str], list[str]]:
    """The environment and `os.execvp` arguments of Ray's setup_worker.py given `argv`."""
    from ray._private.runtime_env.context import RuntimeEnvContext
    from ray._private.workers import setup_worker
    from ray.core.generated.common_pb2 import Language

    env = _environ(monkeypatch)
    execed: list[Any] = []
    monkeypatch.setattr(os, "execvp", lambda file, args: execed.append([file, *args]))
    args, remaining = setup_worker.parser.parse_known_args(argv)
    context = RuntimeEnvContext.deserialize(args.serialized_runtime_env_context or "{}")
    context.exec_worker(remaining, Language.Value(args.language))
    (call,) = execed
    return dict(env), call[1:]


def ours(argv: list[str], monkeypatch: pytest.MonkeyPatch, command: Callable[..., Any]
         ) -> tuple[dict[str, str], list[str] | None]:
    env = _environ(monkeypatch)
    cmd = command(argv)
    return dict(env), cmd


def check_same(argv: list[str], monkeypatch: pytest.MonkeyPatch, command: Callable[..., Any]) -> None:
    want_env, want_cmd = rays(argv, monkeypatch)
    got_env, got_cmd = ours(argv, monkeypatch, command)
    assert got_env == want_env, f"environment differs: {got_env} vs Ray's {want_env}"
    assert got_cmd == want_cmd, f"command differs: {got_cmd} vs Ray's {want_cmd}"


@pytest.mark.parametrize("name", CONTEXTS)
@pytest.mark.parametrize("form", ["joined", "split"])
def test_the_same_environment_and_command_as_rays_script(name, form, monkeypatch):
    context = CONTEXTS[name]
    flags = ([f"--serialized-runtime-env-context={context}", "--language=PYTHON"] if form == "joined"
             else ["--serialized-runtime-env-context", context, "--language", "PYTHON"])  # fmt: skip
    check_same([*WORKER[:4], *flags, *WORKER[4:]], monkeypatch, lean_setup_worker.command)


def test_control_unexpanded_variables_are_caught(monkeypatch):
    """Negative control: a stand-in that copies `env_vars` as they are (no ${X} expansion) is rejected."""

    def verbatim(argv: list[str]) -> list[str] | None:
        cmd = lean_setup_worker.command(argv)
        os.environ["P"] = "${HOME_OF_TEST}/bin:${UNSET_OF_TEST}"
        return cmd

    argv = [*WORKER, f"--serialized-runtime-env-context={CONTEXTS['expanded']}", "--language=PYTHON"]
    with pytest.raises(AssertionError, match="environment differs"):
        check_same(argv, monkeypatch, verbatim)


@pytest.mark.parametrize("context", [
    '{"command_prefix": ["conda", "run"]}', '{"override_worker_entrypoint": "/x.py"}', '{"container": {}}',
])  # fmt: skip
def test_what_it_does_not_cover_goes_to_rays_script(context):
    argv = [*WORKER, f"--serialized-runtime-env-context={context}", "--language=PYTHON"]
    assert lean_setup_worker.command(argv) is None
    assert lean_setup_worker.command([*WORKER, "--language=JAVA"]) is None
