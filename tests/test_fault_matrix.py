"""The fault matrix: fault x lifecycle state x (unary, SSE), against a real server process
and a real scripted worker process. Each case drives one request to a lifecycle state,
injects the fault there, and checks the exact response the client saw and the release
invariants once the server has recovered.

Faults: the client hangs up; the worker is killed (SIGKILL); the worker hangs (SIGSTOP:
alive, silent); a corrupt frame reaches the frontend (``frontend.frame_recv`` corrupt,
injected through ``wire.faults`` by reloading the live frontend's plan).
States: ``queued`` (admitted, waiting for worker credits in the frontend), ``running``
(dispatched, no token yet: the worker's prefill step takes 0.3 s), ``streaming``.

Modes: unary ``POST /generate``, SSE, and a generation on the WebSocket ``/v1/stream``
(``specs/websocket.md``).

``make test`` runs 12 of the 36 cases (~16 s): every fault in every state, the mode turning
with the state, so each fault meets each mode and each state each mode too; the other 24
are marked slow (``make test-full``). The deterministic simulation (``tests/test_dsim.py``)
crosses the same faults with states and client kinds a thousand times beside it.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from websockets.sync.client import ClientConnection, connect

from lifecycle.testing.pytest_plugin import LiveServer, RawClients, start_server
from wire.faults import FaultRule

SERVER_ARGS = (
    "--scripted-worker",
    "--max-pending",
    "2",
    "--max-running",
    "2",
    "--worker-args",
    "--step-delay 0.02 --prefill-delay 0.3",
    "--hung-timeout",
    "1",
    "--restart-backoff",
    "0.1",
)
LONG = {"sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
SLOW = pytest.mark.slow
FAULTS = ("disconnect", "worker_kill", "worker_hang", "frame_corrupt")
STATES = ("queued", "running", "streaming")
MODES = ("unary", "sse", "ws")
CASES = [
    pytest.param(
        f, s, m, marks=() if MODES.index(m) == (FAULTS.index(f) + STATES.index(s)) % 3 else SLOW
    )
    for f in FAULTS
    for s in STATES
    for m in MODES
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    plan = tmp_path_factory.mktemp("matrix") / "plan.json"
    plan.write_text("[]")
    with start_server(*SERVER_ARGS, faults=str(plan)) as srv:
        yield srv


class _Client(threading.Thread):
    """The request under test, unary or SSE; records what the client saw."""

    def __init__(self, srv: LiveServer, mode: str) -> None:
        super().__init__(daemon=True)
        self.srv, self.mode = srv, mode
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.body: Any = None
        self.events: list[Any] = []

    def run(self) -> None:
        body = {"input_ids": [11, 12, 13], "stream": self.mode == "sse", **LONG}
        if self.mode == "ws":
            with _ws_generate(self.srv, body) as ws:
                while True:
                    msg = json.loads(ws.recv(timeout=30))
                    self.events.append(msg)
                    if msg["type"] in ("done", "error"):
                        return
        with httpx.stream("POST", self.srv.url + "/generate", json=body, timeout=30) as r:
            self.status, self.headers = r.status_code, dict(r.headers)
            if self.mode == "unary":
                self.body = json.loads(r.read())
                return
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line[6:]
                    self.events.append(data if data == "[DONE]" else json.loads(data))


@contextmanager
def _ws_generate(srv: LiveServer, body: dict[str, Any]) -> Iterator[ClientConnection]:
    with connect(srv.url.replace("http://", "ws://") + "/v1/stream") as ws:
        ws.send(json.dumps({"type": "generate", "id": "g", "body": body}))
        yield ws


def _inject(srv: LiveServer, fault: str) -> None:
    pid = srv.worker()["pid"]
    if fault == "worker_kill":
        os.kill(pid, signal.SIGKILL)
    elif fault == "worker_hang":
        os.kill(pid, signal.SIGSTOP)  # the watchdog kills it; SIGKILL ends a stopped one
    elif fault == "frame_corrupt":
        srv.replan_frontend([FaultRule("frontend.frame_recv", "corrupt")])


def _assert_worker_lost(c: _Client) -> None:
    if c.mode == "ws":
        last = c.events[-1]
        assert last["type"] == "error" and last["id"] == "g"
        err = last["error"]
        assert err["code"] == 503 and err["type"] == "server_error" and err["retryable"] is True
        assert err["message"].startswith("worker lost: ")
        assert all(e["type"] == "delta" for e in c.events[:-1])
        assert all(e["meta_info"]["finish_reason"] is None for e in c.events[:-1])
        return
    if c.mode == "unary":
        assert c.status == 503 and c.headers["retry-after"] == "2"
        assert c.body["error"]["message"].startswith("worker lost: ")
        return
    assert c.status == 200 and c.events[-1] == "[DONE]"
    err = c.events[-2]["error"]
    assert err["code"] == 503 and err["type"] == "server_error" and err["retryable"] is True
    assert err["message"].startswith("worker lost: ")
    assert all(e["meta_info"]["finish_reason"] is None for e in c.events[:-2])


@pytest.mark.parametrize(("fault", "state", "mode"), CASES)
def test_fault_matrix(server: LiveServer, fault: str, state: str, mode: str) -> None:
    srv = server
    srv.wait_ready()
    before = srv.info()
    raw = RawClients(srv)
    try:
        if state == "queued":  # both credits taken: the next request waits in the frontend
            for i in range(2):
                raw.open({"input_ids": [100 + i], "stream": True, **LONG})
            srv.wait_state("streaming", 2)
        if fault == "disconnect":
            body = {"input_ids": [11, 12, 13], "stream": mode == "sse", **LONG}
            if mode == "ws":
                with _ws_generate(srv, body):
                    srv.wait_state(state)  # leaving the block closes the socket
            else:
                sock = raw.open(body)
                srv.wait_state(state)
                sock.close()
            raw.close()
            info = srv.assert_invariants()
            assert info["failed_requests"]["client_gone"] > before["failed_requests"].get(
                "client_gone", 0
            )
            return
        client = _Client(srv, mode)
        client.start()
        srv.wait_state(state)
        _inject(srv, fault)
        client.join(20)
        assert not client.is_alive(), "the client never got its answer"
        _assert_worker_lost(client)
    finally:
        raw.close()
        if fault == "frame_corrupt":
            srv.replan_frontend([])
    srv.wait_replaced(before["internal_states"][0]["pid"], timeout=20)
    info = srv.assert_invariants()
    lost = info["failed_requests"]["worker_lost"]
    assert lost > before["failed_requests"].get("worker_lost", 0)
