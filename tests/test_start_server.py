"""``start_server`` serves the tests the server it started: a port found free may be taken
by another test's server before the new one binds it, and that server's /health answers
200 (a strict-fields test once sent its requests to a lenient server that way)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from lifecycle.testing import pytest_plugin
from lifecycle.testing.pytest_plugin import start_server


class _Impostor(BaseHTTPRequestHandler):
    """Another process's server, as far as a health check can tell."""

    def do_GET(self) -> None:  # noqa: N802
        body = json.dumps({"frontend_pid": 1} if self.path == "/server_info" else {}).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def test_a_port_taken_by_another_server_is_left_for_a_new_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    impostor = ThreadingHTTPServer(("127.0.0.1", 0), _Impostor)
    threading.Thread(target=impostor.serve_forever, daemon=True).start()
    ports = iter([impostor.server_address[1]])
    real = pytest_plugin.free_port
    monkeypatch.setattr(pytest_plugin, "free_port", lambda: next(ports, None) or real())
    try:
        with start_server("--scripted-worker") as srv:
            assert srv.port != impostor.server_address[1]
            assert srv.info()["frontend_pid"] == srv.proc.pid
    finally:
        impostor.shutdown()
        impostor.server_close()
