"""Named regression tests: failures other serving stacks had in production
(``reference/peers.md`` §5, ``reference/sglang.md`` §5-6), each reproduced against a real
server process and a real scripted worker process, with faults from ``wire.faults``.

Each docstring names the protection the test guards; each test was checked to fail with
that protection removed. After every scenario the release invariants hold
(``LiveServer.assert_invariants``: every request reached exactly one terminal state, no
live request or tombstone is left, every KV block is free).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import psutil
import pytest

from lifecycle.testing.pytest_plugin import LiveServer, RawClients, start_server
from wire.faults import FaultRule

# 2 running, 4 credits, 8 admitted-and-undispatched; 128 KV blocks of 16 tokens.
SERVER_ARGS = (
    "--scripted-worker",
    "--max-pending",
    "4",
    "--max-running",
    "2",
    "--max-queued",
    "8",
    "--worker-args",
    "--step-delay 0.02 --kv-blocks 128",
    "--send-timeout",
    "1",
    "--hung-timeout",
    "1",
    "--restart-backoff",
    "0.1",
)
LONG = {"sampling_params": {"max_new_tokens": 600, "ignore_eos": True}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    plan = tmp_path_factory.mktemp("faults") / "plan.json"
    plan.write_text("[]")
    with start_server(*SERVER_ARGS, faults=str(plan)) as srv:
        yield srv


@pytest.fixture
def srv(server: LiveServer) -> Iterator[LiveServer]:
    """The shared server, with a clean worker plan and idle books before and after."""
    server.wait_ready()
    server.assert_invariants()
    yield server
    if server.plan_path is not None:
        with open(server.plan_path) as f:
            dirty = f.read().strip() not in ("[]", '{"rules": []}')
        if dirty:
            server.replan_worker([])


def _stream_events(
    srv: LiveServer, body: dict[str, Any], headers: dict[str, str] | None = None
) -> list[Any]:
    out: list[Any] = []
    with httpx.stream(
        "POST", srv.url + "/generate", json={**body, "stream": True}, timeout=30,
        headers=headers,
    ) as r:  # fmt: skip
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[6:]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_zombie_decode_after_disconnect(srv: LiveServer) -> None:
    """llama.cpp #24496/#11720, sglang #36333, mini-sglang #15: a client that hangs up
    must stop its decode at once. Protection: ``GenerateCall.close`` aborts every rid the
    worker holds (``WorkerClient.abort``) when the handler's scope ends."""
    clients = RawClients(srv)
    for stream in (True, False):
        clients.disconnect_at(
            {"input_ids": [9, 8], "stream": stream, **LONG}, "streaming" if stream else "running"
        )
        srv.assert_invariants(timeout=2)
        steps = srv.worker()["worker_load"]["steps"]
        time.sleep(0.2)  # 10 step times: a zombie would have advanced
        assert srv.worker()["worker_load"]["steps"] == steps
    info = srv.info()
    assert info["failed_requests"].get("client_gone", 0) >= 2


def test_abort_does_not_kill_other_clients_decode(srv: LiveServer) -> None:
    """ik_llama.cpp #1929: cancelling a queued request aborted another client's decode.
    Protection: aborts are per wire rid end to end (``/abort_request`` resolves the client
    rid to its own record; the worker ends only the rids named)."""
    result: dict[str, Any] = {}

    def run_b() -> None:
        result["b"] = _stream_events(
            srv,
            {
                "input_ids": [21, 22, 23],
                "rid": "b",
                "sampling_params": {"max_new_tokens": 150, "ignore_eos": True},
            },
        )

    clients = RawClients(srv)
    a_running = clients.open({"input_ids": [5], "rid": "a-run", "stream": True, **LONG})
    t = threading.Thread(target=run_b)
    t.start()
    a_queued = clients.open({"input_ids": [6], "rid": "a-queued", **LONG})
    # All three held by the worker (two running, one waiting) before the aborts: b
    # reaching the server after them, or (60 tokens before) ending first, proved nothing.
    srv.wait_until(lambda i: i["internal_states"][0]["waiting"] >= 1
                   and i["internal_states"][0]["running"] >= 2)  # fmt: skip
    assert t.is_alive(), "b ended before the aborts were sent"
    for rid in ("a-queued", "a-run"):
        assert httpx.post(srv.url + "/abort_request", json={"rid": rid}).status_code == 200
    t.join(30)
    events = result["b"]
    assert events[-1] == "[DONE]"
    last = events[-2]
    assert "error" not in last
    assert last["output_ids"] == ([21, 22, 23] * 50)[:150]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 150}
    a_running.close()
    a_queued.close()
    srv.assert_invariants()


def test_kv_not_leaked_on_abort_during_handoff(srv: LiveServer) -> None:
    """vllm #46283/#50425, sglang #36333: an abort while the request is between the
    frontend and the worker leaked its KV. Here every frame the worker receives is held
    0.3 s, so the client hangs up while the SUBMIT is still in flight. Protection: the
    frontend keeps a tombstone and sends ABORT; it frees the rid only on the worker's
    terminal entry (``WorkerClient._sinks[rid] = None`` until ``_end``)."""
    srv.replan_worker([FaultRule("worker.frame_recv", "delay", delay=0.3, times=0)])
    clients = RawClients(srv)
    for stream in (True, False):
        sock = clients.open({"input_ids": [7, 7, 7], "stream": stream, **LONG})
        # Dispatch takes ~1 ms; the worker holds the SUBMIT 0.3 s (no /server_info
        # meanwhile: its STATS frame would be held too and let the SUBMIT through).
        time.sleep(0.1)
        sock.close()
        srv.assert_invariants(timeout=5)


def test_unfittable_prompt_refused_not_hung(srv: LiveServer) -> None:
    """vllm #35541: a request that can never fit the KV pool made the scheduler retry
    forever. Protection: the worker refuses a request needing more blocks than it has
    (``too_long``) at submit instead of queueing it (``ScriptedWorker.submit``; the
    model worker's ``Engine.submit`` checks ``max_context``)."""
    body = {"input_ids": [3] * 100, "sampling_params": {"max_new_tokens": 2000}}
    t = time.monotonic()
    r = httpx.post(srv.url + "/generate", json=body, timeout=10)
    assert time.monotonic() - t < 2
    assert r.status_code == 400
    assert r.json() == {"error": {"message": "2100 tokens exceed the KV cache of 2048"}}
    ok = httpx.post(
        srv.url + "/generate",
        json={"input_ids": [4], "sampling_params": {"max_new_tokens": 3}},
        timeout=10,
    )
    assert ok.status_code == 200 and ok.json()["output_ids"] == [4, 4, 4]
    srv.assert_invariants()


def test_health_503_while_engine_hung(srv: LiveServer) -> None:
    """vllm PR #36451: /health said 200 while the engine was alive but hung. Here the
    worker's step loop stalls forever (it still holds its socket open). Protection: the
    supervisor's watchdog (``Supervisor._watchdog``: work held, no frame for
    ``hung_timeout``) turns readiness off, fails the held requests and restarts it."""
    srv.replan_worker([FaultRule("worker.forward", "stall", nth=4)])
    result: dict[str, Any] = {}
    t = threading.Thread(
        target=lambda: result.update(
            r=httpx.post(srv.url + "/generate", json={"input_ids": [1, 2], **LONG}, timeout=30)
        )
    )
    t.start()
    srv.wait_until(lambda i: i["received_requests"] > 0 and i["live_requests"] == 1)
    srv.replan_worker([], restart=False)  # the next worker life starts clean
    deadline = time.monotonic() + 5
    while srv.health() == 200:
        assert time.monotonic() < deadline, "health stayed 200 while the worker hung"
        time.sleep(0.05)
    t.join(10)
    r = result["r"]
    assert r.status_code == 503 and r.headers["retry-after"] == "2"
    assert r.json()["error"]["message"].startswith("worker lost")
    srv.wait_ready(timeout=10)
    srv.assert_invariants()


def test_lost_dispatch_is_hung_even_while_stats_are_polled(srv: LiveServer) -> None:
    """Found by the simulation (seed 729): a submission lost on the way to the worker
    (fault ``frontend.dispatch`` drop) stayed a tombstone for as long as anyone polled
    ``/server_info``, because every STATS reply counted as progress and the hung-worker
    watchdog never fired; once it did fire, it restarted a healthy worker. Protection:
    the watchdog's AUDIT (``WorkerClient.audit``) finds the rid the worker never got and
    ends that request alone; the worker is not restarted."""
    pid = srv.worker()["pid"]
    srv.replan_frontend([FaultRule("frontend.dispatch", "drop", nth=1)])
    try:
        stop = threading.Event()

        def poll() -> None:  # what a dashboard or a load balancer's check does
            while not stop.is_set():
                srv.info()
                time.sleep(0.05)

        poller = threading.Thread(target=poll)
        poller.start()
        try:
            r = httpx.post(srv.url + "/generate", json={"input_ids": [3, 4], **LONG}, timeout=30)
        finally:
            stop.set()
            poller.join(10)
        assert r.status_code == 503 and r.json()["error"]["message"].startswith("worker lost")
    finally:
        srv.replan_frontend([])
    srv.wait_ready(timeout=10)
    assert srv.worker()["pid"] == pid
    srv.assert_invariants()


def test_truncated_stream_never_ends_with_done(srv: LiveServer) -> None:
    """A stream cut short (here: the worker killed mid-decode) must never look like
    success: no finish_reason, and an explicit error event before ``[DONE]``
    (text-generation-inference #3050 reported silent "incomplete generation").
    Protection: ``NativeAPI._stream`` yields ``cause.body(...)`` when the call failed."""
    srv.replan_worker([FaultRule("worker.forward", "kill", nth=10)])
    srv.replan_worker([], restart=False)  # already loaded by the running worker
    events = _stream_events(srv, {"input_ids": [31, 32], **LONG})
    assert events[-1] == "[DONE]"
    frames, last = events[:-2], events[-2]
    assert 0 < len(frames) < 600
    assert all(f["meta_info"]["finish_reason"] is None for f in frames)
    assert last["error"]["code"] == 503 and last["error"]["type"] == "server_error"
    assert last["error"]["retryable"] is True
    assert last["error"]["message"].startswith("worker lost")
    srv.wait_ready(timeout=10)
    srv.assert_invariants()


def test_malformed_logprob_field_does_not_kill_scheduler(srv: LiveServer) -> None:
    """sglang §8: a malformed logprob field (ragged ``token_ids_logprob``) killed the
    scheduler for everyone. Protections: the edge refuses a ragged field with a 400;
    a malformed logprob field in the worker's output ends only that request, with an
    explicit error (``GenerateCall._bad_output``), never the handler or the stream."""
    r = httpx.post(
        srv.url + "/generate",
        json={"input_ids": [1], "return_logprob": True, "token_ids_logprob": [[1, 2], 3]},
        timeout=10,
    )
    assert r.status_code == 400 and "token_ids_logprob" in r.json()["error"]["message"]
    srv.replan_worker([FaultRule("worker.sample", "corrupt", nth=3)])  # a restart loads it
    body = {
        "input_ids": [41, 42],
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 20},
    }
    events = _stream_events(srv, body)
    restarts = srv.worker()["restarts"]  # the worker that sent the bad field
    assert events[-1] == "[DONE]"
    assert events[-2]["error"] == {
        "message": "the worker sent invalid output",
        "type": "server_error",
        "code": 500,
        "retryable": False,
    }
    after = httpx.post(srv.url + "/generate", json=body, timeout=10)
    assert after.status_code == 200 and len(after.json()["output_ids"]) == 20
    # one request ended; the worker was not restarted for it
    assert srv.worker()["restarts"] == restarts and srv.health() == 200
    srv.assert_invariants()


def test_output_before_a_malformed_field_reaches_the_client_either_way(srv: LiveServer) -> None:
    """The tokens of the chunk whose extra field is malformed still reach the client
    before the error, whether the chunk was polled by the owner task or by a push from
    the worker link's wake-up (``GenerateCall.hand_back``); ``X-Request-Timeout`` keeps
    the owner polling (no push)."""
    body = {"input_ids": [41, 42], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 20}}  # fmt: skip
    got = []
    for headers in ({}, {"X-Request-Timeout": "60"}):
        srv.replan_worker([FaultRule("worker.sample", "corrupt", nth=3)])
        events = _stream_events(srv, body, headers)
        assert events[-1] == "[DONE]" and "error" in events[-2]
        got.append([i for e in events[:-2] for i in e["output_ids"]])
    assert got[0] == got[1] and len(got[0]) >= 3, got
    srv.replan_worker([])
    srv.assert_invariants()


def test_burst_queue_bounded(srv: LiveServer) -> None:
    """vllm #18826/#2901, TGI #439: the waiting queue grew without bound under a burst.
    Protection: ``AdmissionQueue`` (``--max-queued``): beyond 4 credits + 8 queued, a
    request is refused at once with 503 and Retry-After; memory stays flat."""
    rss = psutil.Process(srv.proc.pid).memory_info().rss
    body = {"input_ids": [8, 9], "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}
    results: list[httpx.Response] = []
    lock = threading.Lock()

    def one() -> None:
        r = httpx.post(srv.url + "/generate", json=body, timeout=60)
        with lock:
            results.append(r)

    threads = [threading.Thread(target=one) for _ in range(48)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 48
    refused = [r for r in results if r.status_code == 503]
    served = [r for r in results if r.status_code == 200]
    assert len(refused) + len(served) == 48 and refused and len(served) >= 12
    for r in refused:
        assert r.headers["retry-after"] == "1"
        assert r.json() == {"error": {"message": "The server is overloaded; retry later."}}
    for r in served:
        assert r.json()["output_ids"] == ([8, 9] * 20)[:40]
    growth = psutil.Process(srv.proc.pid).memory_info().rss - rss
    assert growth < 8 * 2**20, f"RSS grew {growth / 2**20:.1f} MiB"
    info = srv.assert_invariants()
    assert info["failed_requests"].get("overloaded", 0) >= len(refused)
