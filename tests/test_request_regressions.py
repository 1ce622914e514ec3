"""Issue 37's black-box findings on the request path, each a named regression test
against a real server process and a real scripted worker process (faults from
``wire.faults`` where a test needs one). Each docstring names the finding and the
protection; each test failed on the code before its fix.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from lifecycle.core.live_calls import ABORT_MESSAGE
from lifecycle.testing.pytest_plugin import LiveServer, RawClients, start_server
from wire.faults import FaultRule

LONG = {"max_new_tokens": 250, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    plan = tmp_path_factory.mktemp("faults") / "plan.json"
    plan.write_text("[]")
    args = (
        "--scripted-worker",
        "--worker-args",
        "--step-delay 0.02 --prefill-chunk 64 --prefill-delay 0.3",
        "--hung-timeout",
        "1",
        "--send-timeout",
        "60",
        "--restart-backoff",
        "0.1",
    )
    with start_server(*args, faults=str(plan)) as srv:
        yield srv


@pytest.fixture
def srv(server: LiveServer) -> Iterator[LiveServer]:
    server.wait_ready()
    server.assert_invariants()
    yield server
    server.replan_frontend([])


def _sse_events(raw: bytes) -> list[Any]:
    """The ``data:`` events of a chunked SSE response read whole off a raw socket."""
    _, _, body = raw.partition(b"\r\n\r\n")
    out: list[Any] = []
    for line in body.split(b"\n"):
        if line.startswith(b"data: "):
            data = line[6:].strip()
            out.append(data.decode() if data == b"[DONE]" else json.loads(data))
    return out


def _read_all(sock: socket.socket, timeout: float = 30.0) -> bytes:
    sock.settimeout(timeout)
    got = bytearray()
    while not got.endswith(b"0\r\n\r\n"):
        chunk = sock.recv(1 << 16)
        if not chunk:
            break
        got += chunk
    return bytes(got)


def _trace(srv: LiveServer, rid: str) -> dict[str, Any]:
    r = httpx.get(f"{srv.url}/debug/requests/{rid}", timeout=10)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_lost_dispatch_ends_alone_while_others_stream(srv: LiveServer) -> None:
    """Issue 37 item 1: a request lost on the way to the worker stayed ``running`` for
    as long as other streams kept the worker busy (the hung-worker watchdog never
    fired), then a healthy worker was restarted. Protection: the watchdog's AUDIT
    (``WorkerClient.audit``) asks the worker which sent rids it never received; that
    request alone ends worker_lost within seconds, the others and the worker go on."""
    pid = srv.worker()["pid"]
    results: dict[str, Any] = {}

    def stream(name: str, ids: list[int]) -> None:
        body = {"input_ids": ids, "sampling_params": LONG, "stream": True}
        with httpx.stream("POST", srv.url + "/generate", json=body, timeout=60) as r:
            events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
        results[name] = (time.monotonic(), json.loads(events[-2]))

    others = [threading.Thread(target=stream, args=(f"s{i}", [7, i + 1])) for i in range(4)]
    for t in others:
        t.start()
    srv.wait_state("streaming", 4, timeout=10)
    srv.replan_frontend([FaultRule("frontend.dispatch", "drop", nth=1)])
    sent = time.monotonic()
    r = httpx.post(srv.url + "/generate", json={"input_ids": [3, 4], "sampling_params": LONG})
    ended = time.monotonic()
    for t in others:
        t.join(60)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["message"].startswith("worker lost")
    # Within the audit's bound (hung timeout 1 s: one audit a second), long before the
    # 5 s the other streams run.
    assert ended - sent < 4.0
    assert all(ended < results[f"s{i}"][0] for i in range(4))
    for i in range(4):
        last = results[f"s{i}"][1]
        assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 250}
        assert last["output_ids"] == ([7, i + 1] * 125)
    assert srv.worker()["pid"] == pid  # the worker was never restarted
    srv.assert_invariants()


def test_long_prefill_is_not_hung(srv: LiveServer) -> None:
    """Issue 37 item 10: with ``--hung-timeout 2`` a 7k-token prompt (26 s of prefill)
    ended 503 worker_lost: a step that only prefills sent nothing, so the watchdog saw
    no progress. Protection: such a step sends an empty STEP (``gpu.worker.process._step``; the
    scripted worker's ``--prefill-chunk`` does the same), which the watchdog counts.
    Here 640 prompt tokens take 10 chunks of 0.3 s: 3 s without a token, hung timeout 1 s."""
    pid = srv.worker()["pid"]
    prompt = [5 + i % 50 for i in range(640)]
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    t0 = time.monotonic()
    r = httpx.post(srv.url + "/generate", json=body, timeout=30)
    assert time.monotonic() - t0 > 2.5  # the prefill really outlasted the hung timeout
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == prompt[:4]
    assert srv.worker()["pid"] == pid
    srv.assert_invariants()


def test_abort_during_tokenization_is_honoured(srv: LiveServer) -> None:
    """Issue 37 item 5: ``/abort_request`` sent while a long text prompt was still being
    tokenized was answered 200 and lost (18 of 30 here): the call had nothing submitted
    to abort yet. Protection: ``GenerateCall.abort`` marks a run not yet submitted, and
    it is then never submitted; it ends with finish_reason abort, the one abort message."""
    # Tokenizing takes 0.4 s here (fault ``frontend.tokenize`` delay), so each abort,
    # sent once the request is registered, lands while its prompt is being tokenized.
    srv.replan_frontend([FaultRule("frontend.tokenize", "delay", delay=0.4, times=0)])
    text = "the quick brown fox jumps over the lazy dog"
    outcomes = []
    for i in range(3):
        rid = f"tok-{i}"
        body = {"text": text, "rid": rid, "sampling_params": LONG}
        result: dict[str, Any] = {}

        def send(body: dict[str, Any] = body, result: dict[str, Any] = result) -> None:
            result["r"] = httpx.post(srv.url + "/generate", json=body, timeout=60)

        t = threading.Thread(target=send)
        t.start()
        deadline = time.monotonic() + 5
        while httpx.get(f"{srv.url}/debug/requests/{rid}").status_code != 200:
            assert time.monotonic() < deadline, "the request never showed up"
        assert httpx.post(srv.url + "/abort_request", json={"rid": rid}).status_code == 200
        t.join(60)
        r = result["r"]
        assert r.status_code == 200, r.text
        outcomes.append(r.json()["meta_info"]["finish_reason"])
        assert r.json()["output_ids"] == []
    assert all(f == {"type": "abort", "message": ABORT_MESSAGE} for f in outcomes), outcomes
    srv.assert_invariants()


def test_lagging_reader_gets_every_token_before_the_error(srv: LiveServer) -> None:
    """Issue 37 item 8: a paused reader of a cumulative stream saw 217 of the 613 tokens
    the frontend had received when the worker died: the last chunk, the one holding
    the failure, was never sent. Protection: ``GenerateCall.frames`` sends a failed
    sample's remaining output before its error event; the delivered tokens equal the
    trace's count."""
    clients = RawClients(srv)
    body = {
        "input_ids": [11, 12, 13],
        "rid": "lagging",
        "stream": True,
        "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True},
        "return_logprob": True,  # big cumulative frames: the socket's buffers fill
        "top_logprobs_num": 5,
    }
    sock = clients.open(body, rcvbuf=4096)  # read nothing while tokens pile up
    srv.wait_until(lambda i: i["requests_by_state"].get("streaming", 0) >= 1)
    # ~200 steps (4 s on a quiet machine, longer under load): the writer is blocked on
    # the full socket; the live trace counts the tokens the frontend has received.
    deadline = time.monotonic() + 60
    while (_trace(srv, "lagging").get("tokens") or 0) < 200:
        assert time.monotonic() < deadline, _trace(srv, "lagging")
        time.sleep(0.2)
    srv.kill_worker()
    events = _sse_events(_read_all(sock))
    clients.close()
    assert events[-1] == "[DONE]" and "error" in events[-2], events[-2:]
    data = [e for e in events if isinstance(e, dict) and "output_ids" in e]
    delivered = data[-1]["output_ids"]
    # The reader really lagged: the last event holds many tokens the one before lacks.
    assert len(delivered) - len(data[-2]["output_ids"]) > 1
    trace = _trace(srv, "lagging")
    assert trace["tokens"] == len(delivered) > 100
    assert delivered == ([11, 12, 13] * 700)[: len(delivered)]
    srv.assert_invariants()


def test_a_request_bigger_than_a_frame_is_split_not_fatal(srv: LiveServer) -> None:
    """Issue 37 item 4: one valid batch request (its stop list copied into each of its
    prompts' entries) made a SUBMIT frame over the 64 MiB frame limit; the dispatcher
    died on it, every running stream ended 503 worker_lost and the worker restarted.
    Protection: ``WorkerClient._take_ready`` cuts SUBMIT frames under the limit (and
    ``submit`` refuses, before dispatch, one request that alone would not fit)."""
    pid = srv.worker()["pid"]
    results: dict[str, Any] = {}

    def stream() -> None:
        body = {"input_ids": [7, 8], "sampling_params": LONG, "stream": True}
        with httpx.stream("POST", srv.url + "/generate", json=body, timeout=60) as r:
            events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
        results["stream"] = json.loads(events[-2])

    t = threading.Thread(target=stream)
    t.start()
    srv.wait_state("streaming", 1, timeout=10)
    stops = [f"{i:05d}" + "x" * 995 for i in range(7000)]  # 7 MB, under the 8 MiB body
    body = {
        "input_ids": [[9, i] for i in range(10)],  # 10 entries of 7 MB: 70 MB to send
        "sampling_params": {"max_new_tokens": 2, "ignore_eos": True, "stop": stops},
    }
    r = httpx.post(srv.url + "/generate", json=body, timeout=60)
    t.join(60)
    assert r.status_code == 200, r.text[:300]
    assert [x["output_ids"] for x in r.json()] == [[9, i] for i in range(10)]
    assert results["stream"]["meta_info"]["finish_reason"] == {"type": "length", "length": 250}
    assert srv.worker()["pid"] == pid
    srv.assert_invariants()


def test_a_request_past_its_deadline_ends_504(srv: LiveServer) -> None:
    """Issue 37 item 1: no request had a deadline (``Cause.DEADLINE`` was never raised).
    A request's ``X-Request-Timeout`` header (or ``--request-timeout``, below) is the
    seconds it may take; past them it ends ``deadline``: 504 unary, an error event then
    ``[DONE]`` streaming, the OpenAI error shape on ``/v1``; the worker stops its work."""
    body = {"input_ids": [4, 5], "sampling_params": LONG, "rid": "late"}
    t0 = time.monotonic()
    r = httpx.post(srv.url + "/generate", json=body, headers={"X-Request-Timeout": "0.5"})
    took = time.monotonic() - t0
    assert r.status_code == 504, r.text
    assert r.json()["error"]["message"] == "the request's deadline passed (0.5 s)"
    assert 0.5 <= took < 3.0  # 250 tokens take 5 s here
    trace = _trace(srv, "late")
    assert trace["state"] == "error" and trace["cause"] == "deadline"
    srv.assert_invariants()  # the worker let go of it
    with httpx.stream(
        "POST", srv.url + "/generate", json={**body, "rid": "late-stream", "stream": True},
        headers={"X-Request-Timeout": "0.5"},
    ) as s:  # fmt: skip
        assert s.status_code == 200
        events = [ln[6:] for ln in s.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == 504 and "deadline" in err["message"], err
    assert json.loads(events[-3])["output_ids"]  # what it made before the deadline came
    chat = {
        "model": "default",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 400,
        "ignore_eos": True,
    }
    r = httpx.post(
        srv.url + "/v1/chat/completions", json=chat, headers={"X-Request-Timeout": "0.3"}
    )
    assert r.status_code == 504 and "deadline" in r.json()["error"]["message"], r.text
    for bad in ("0", "-1", "soon", "nan"):
        r = httpx.post(srv.url + "/generate", json=body, headers={"X-Request-Timeout": bad})
        assert r.status_code == 400 and "X-Request-Timeout" in r.json()["error"]["message"]
    srv.assert_invariants()


def test_request_timeout_is_every_requests_default() -> None:
    """Issue 37 item 1: ``--request-timeout`` gives every request a deadline; a request's
    header overrides it (here: longer)."""
    args = ("--scripted-worker", "--worker-args", "--step-delay 0.02", "--request-timeout", "0.5")
    with start_server(*args) as srv:
        body = {"input_ids": [4, 5], "sampling_params": {"max_new_tokens": 60}}
        r = httpx.post(srv.url + "/generate", json=body)
        assert r.status_code == 504 and "deadline" in r.json()["error"]["message"]
        r = httpx.post(srv.url + "/generate", json=body, headers={"X-Request-Timeout": "10"})
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 60
        srv.assert_invariants()


def test_one_abort_message_in_every_state(srv: LiveServer) -> None:
    """Issue 37 item 11: an aborted request's finish message depended on where it was
    (the frontend's words while queued, the worker's once running: three spellings).
    Protection: the dispatcher reports its own abort message for every rid it aborted
    (``Submission.abort_message``); tokenizing: ``test_abort_during_tokenization_...``."""
    for stream in (False, True):
        rid = f"abort-running-{stream}"
        body = {"input_ids": [8, 9], "rid": rid, "sampling_params": LONG, "stream": stream}
        result: dict[str, Any] = {}

        def send(body: dict[str, Any] = body, result: dict[str, Any] = result) -> None:
            if not body["stream"]:
                result["last"] = httpx.post(srv.url + "/generate", json=body, timeout=60).json()
                return
            with httpx.stream("POST", srv.url + "/generate", json=body, timeout=60) as r:
                events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
            result["last"] = json.loads(events[-2])

        t = threading.Thread(target=send)
        t.start()
        srv.wait_until(lambda i: i["requests_by_state"].get("streaming", 0) >= 1)
        assert httpx.post(srv.url + "/abort_request", json={"rid": rid}).status_code == 200
        t.join(60)
        finish = result["last"]["meta_info"]["finish_reason"]
        assert finish == {"type": "abort", "message": ABORT_MESSAGE}, finish
    srv.assert_invariants()
