"""A stand-in for the EC2 instance metadata service on 127.0.0.1 (IMDSv2: a PUT for a session token, then
GETs carrying it): what `parallel.spot_endpoint` points the spot watchers at in tests."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class _Handler(http.server.BaseHTTPRequestHandler):
    answer: tuple[int, bytes] = (404, b"")  # what the notice path answers now (the test sets it)

    def do_PUT(self) -> None:  # IMDSv2's session token
        self._send(200, b"token")

    def do_GET(self) -> None:
        if self.headers["X-aws-ec2-metadata-token"] != "token":
            self._send(401, b"")
            return
        self._send(*type(self).answer)

    def _send(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def metadata_stub() -> Iterator[tuple[str, type[_Handler]]]:
    """The stub's endpoint and its handler class, whose `answer` sets what the notice path returns."""
    handler = type("Stub", (_Handler,), {})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", handler
    finally:
        server.shutdown()
        server.server_close()
