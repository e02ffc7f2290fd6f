"""The drain watch and the spot watcher in one process: a fake GCS table, a stub metadata service on
127.0.0.1 (no Ray: the watcher's drain request is recorded by a test subclass)."""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from actors.spot_watch import SpotWatch, parse_notice
from raypar.controller import cli, drain
from raypar.core.parallel.mesh import Coord

NODE = "ab" * 28


def test_watch_says_each_new_drain_once_and_survives_a_failing_read():
    """A node seen draining is noticed once however many polls see it; a read that raises (the GCS busy)
    keeps the last answer instead of ending the thread."""
    draining = {NODE: drain.Drain(NODE, time.time() + 60)}
    answers: list[dict[str, drain.Drain] | Exception] = [{}, RuntimeError("GCS busy"), draining]
    seen, polls, enough = [], [], threading.Event()

    def read() -> dict[str, drain.Drain]:
        polls.append(1)
        if len(polls) >= 10:  # the same drain seen by 7 more polls
            enough.set()
        answer = answers.pop(0) if answers else draining
        if isinstance(answer, Exception):
            raise answer
        return answer

    watch = drain.DrainWatch(seen.append, read=read, period_s=0.001).start()
    assert enough.wait(timeout=30), "the watch stopped polling"
    watch.stop()
    assert [d.node_id for d in seen] == [NODE], seen
    assert set(watch.current()) == {NODE}


def test_status_and_line_name_the_replicas_on_the_node():
    nodes = {
        Coord(0, 0, 0, 0): SimpleNamespace(node_id="cd" * 28),
        Coord(1, 1, 0, 0): SimpleNamespace(node_id=NODE),
    }
    assert drain.on_nodes(nodes, {NODE}) == {1}
    run = {"run": "r", "step": 3, "steps": 8, "loss": 5.0, "tokens_per_s": 1.0, "dp": 2, "pp": 2, "tp": 1,
           "cp": 1, "restarts": 0, "run_dir": "/x", "actors": {},
           "draining": {NODE: {"deadline": time.time() + 60.4, "replicas": [1]}}}  # fmt: skip
    assert f"  draining: node {NODE[:12]} (deadline in 60 s) holds replica(s) [1]" in cli.status_lines([run])


class _Recorded(SpotWatch):
    """Records the drain it would ask Ray for."""

    def drain(self, deadline: float) -> str:
        self.asked = deadline
        return f"drain by {deadline:.0f}"


class _Stub(http.server.BaseHTTPRequestHandler):
    answer: tuple[int, bytes] = (404, b"")

    def do_PUT(self) -> None:  # IMDSv2's session token
        self._send(200, b"token")

    def do_GET(self) -> None:
        assert self.headers["X-aws-ec2-metadata-token"] == "token"
        self._send(*self.answer)

    def _send(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def stub() -> Iterator[str]:
    server = http.server.HTTPServer(("127.0.0.1", 0), _Stub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def test_spot_notice_becomes_a_drain_and_garbage_or_silence_is_said_once(stub):
    watch = _Recorded(stub, NODE)
    _Stub.answer = (404, b"")
    assert watch.check() is None and not hasattr(watch, "asked")  # no notice: nothing
    for body in (b"<html>nope", b'{"action": "terminate"}', b'{"action": "reboot", "time": "x"}'):
        _Stub.answer = (200, body)
        line = watch.check()
        assert line is None or "answered something that is no notice" in line, line
    assert len(watch.said) == 1 and not hasattr(watch, "asked")  # one line for every kind of garbage
    _Stub.answer = (500, b"")
    assert "answered HTTP 500; ignored" in watch.check()
    silent = _Recorded("http://127.0.0.1:9", NODE)  # the discard port: refused
    assert "did not answer" in silent.check() and silent.check() is None
    _Stub.answer = (200, json.dumps({"action": "terminate", "time": "2030-01-01T00:02:00Z"}).encode())
    assert watch.check() == "drain by 1893456120"
    assert watch.asked == parse_notice(_Stub.answer[1]) and watch.check() is None  # once
