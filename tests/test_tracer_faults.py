"""A trace log that fails never takes serving down (issue 37 item 3), against a real
server process and a real scripted worker: a full disk (``--trace-log /dev/full``), the
log's directory renamed under load, the log file moved away before a rotation; and the
access log on a full disk. Each time every stream ends with its finish reason, the
worker link stays up, new requests are served, and the failure is reported once (the
server log; for the trace log ``/metrics`` and ``/debug/requests`` too)."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from lifecycle.core.fsm import RequestRecord, new_request
from lifecycle.core.states import Cause, Event
from lifecycle.testing.pytest_plugin import LiveServer, start_server
from lifecycle.tracing.tracer import TraceConfig, Tracer
from tests.test_fault_regressions import _stream_events
from tests.test_fsm import drive

ARGS = ("--scripted-worker", "--worker-args", "--step-delay 0.01")
STREAM_TOKENS = 150
FAILED_LINE = "trace logging is off until restart"


def _stream(srv: LiveServer, first: int) -> list[Any]:
    body = {"input_ids": [first],
            "sampling_params": {"max_new_tokens": STREAM_TOKENS, "ignore_eos": True}}  # fmt: skip
    return _stream_events(srv, body)


def _short(srv: LiveServer) -> None:
    body = {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}
    r = httpx.post(srv.url + "/generate", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 2}


def _assert_stream_whole(events: list[Any]) -> None:
    assert events and events[-1] == "[DONE]", events[-2:]
    last = events[-2]
    assert "error" not in last, last
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": STREAM_TOKENS}


def _metric(srv: LiveServer, name: str) -> float | None:
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def _trace_log(srv: LiveServer) -> dict[str, Any]:
    body = httpx.get(srv.url + "/debug/requests", timeout=10).json()
    assert body["tracer_errors"] == 0
    return dict(body["trace_log"])


def _streams_under_load(srv: LiveServer, n: int, during: Any) -> list[list[Any]]:
    """``n`` streams and a loop of short requests; ``during()`` runs once all stream."""
    results: list[list[Any]] = [[] for _ in range(n)]
    errors: list[BaseException] = []
    stop = threading.Event()

    def stream(i: int) -> None:
        try:
            results[i] = _stream(srv, i + 1)
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    def shorts() -> None:
        try:
            while not stop.is_set():
                _short(srv)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(n)]
    threads.append(threading.Thread(target=shorts))
    for t in threads:
        t.start()
    try:
        srv.wait_state("streaming", n, timeout=10)
        during()
    finally:
        time.sleep(0.3)  # a few ticks and rotations with the log gone
        stop.set()
        for t in threads:
            t.join(30)
    assert not errors, errors
    return results


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full")
def test_full_disk_trace_log_is_reported_and_serving_goes_on(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """issue 37 item 3: ``--trace-log`` on a full disk crashed the server (exit 1 from
    the tracer's flush after the first request). Protection: ``Tracer._log_failed`` turns
    the log off and reports it once; the requests, the ring and the server go on."""
    with start_server(*ARGS, "--trace-log", "/dev/full") as srv:
        _short(srv)
        deadline = time.monotonic() + 20  # a tick flushes the line: ENOSPC, the log off
        while _metric(srv, "lifecycle_trace_log_ok") != 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        _short(srv)
        _assert_stream_whole(_stream(srv, 7))
        time.sleep(0.3)
        assert srv.proc.poll() is None
        assert _metric(srv, "lifecycle_trace_log_ok") == 0
        assert (_metric(srv, "lifecycle_trace_log_unlogged_total") or 0) >= 2
        assert _metric(srv, "lifecycle_tracer_errors_total") == 0
        status = _trace_log(srv)
        assert status["ok"] is False and status["path"] == "/dev/full"
        assert "No space left on device" in status["error"], status
        traces = httpx.get(srv.url + "/debug/traces", timeout=10).json()["traces"]
        assert len(traces) == 3  # the ring still holds every finished request
        srv.assert_invariants()
    logged = capfd.readouterr().err
    assert logged.count(FAILED_LINE) == 1, logged
    assert "/dev/full" in logged and "Traceback" not in logged


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full")
def test_full_disk_access_log_is_reported_and_serving_goes_on(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """issue 37 item 3 (the access log, the other observer that writes a file): on a full
    disk every exchange's line raised in its handler, so every request (``/health``
    too) was a 500 and the server never became ready. Protection: ``AccessLog._write``
    logs the failure once and turns the access log off."""
    with start_server(*ARGS, "--access-log", "/dev/full") as srv:
        for _ in range(3):
            _short(srv)
        _assert_stream_whole(_stream(srv, 7))
        assert srv.health() == 200 and srv.proc.poll() is None
        srv.assert_invariants()
    logged = capfd.readouterr().err
    assert logged.count("access logging is off until restart") == 1, logged
    assert "Traceback" not in logged


def test_trace_log_directory_renamed_under_load(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """issue 37 item 3: moving the log away under load cut a stream and killed the worker
    link (the next rotation's FileNotFoundError came out of the observer, inside the
    request path and the worker link's reader). Protection: every log call is guarded in
    the tracer; the log is turned off and reported."""
    log_dir = tmp_path / "traces"
    path = log_dir / "t.jsonl"
    args = (*ARGS, "--trace-log", str(path), "--trace-log-max-bytes", "3000")
    with start_server(*args) as srv:
        worker = srv.worker()["pid"]
        streams = _streams_under_load(srv, 6, lambda: log_dir.rename(tmp_path / "moved"))
        for events in streams:
            _assert_stream_whole(events)
        _short(srv)
        assert srv.worker()["pid"] == worker and srv.health() == 200
        assert _metric(srv, "lifecycle_worker_restarts_total") in (None, 0)
        assert _metric(srv, "lifecycle_trace_log_ok") == 0
        status = _trace_log(srv)
        assert status["ok"] is False and "No such file or directory" in status["error"]
        srv.assert_invariants()
    logged = capfd.readouterr().err
    assert logged.count(FAILED_LINE) == 1, logged
    # What was written before the rename is whole JSON, one trace per line.
    for f in (tmp_path / "moved").iterdir():
        for line in f.read_bytes().splitlines():
            assert json.loads(line)["id"] > 0


def test_trace_log_file_moved_away_goes_on_in_a_new_file(tmp_path: Path) -> None:
    """issue 37 item 3: a log file moved away (as a log shipper does) made the next
    rotation fail (``os.replace`` of a path that is gone). Protection: the rotation skips
    what is gone and opens a new file at the path; the log stays on."""
    path = tmp_path / "t.jsonl"
    args = (*ARGS, "--trace-log", str(path), "--trace-log-max-bytes", "3000")
    with start_server(*args) as srv:
        _short(srv)
        time.sleep(0.3)  # flushed: the file exists
        streams = _streams_under_load(srv, 4, lambda: path.rename(tmp_path / "shipped.jsonl"))
        for events in streams:
            _assert_stream_whole(events)
        _short(srv)
        time.sleep(0.3)
        assert _metric(srv, "lifecycle_trace_log_ok") == 1
        status = _trace_log(srv)
        assert status["ok"] is True and status["error"] is None and status["unlogged"] == 0
        assert path.exists() and path.stat().st_size > 0
        srv.assert_invariants()


def test_a_tracer_bug_never_reaches_the_request_path(caplog: pytest.LogCaptureFixture) -> None:
    """issue 37 item 3: the tracer runs inside ``RequestRecord.advance``/``fail`` and the
    worker link's release; an exception there came out of the edge after it was taken,
    so the request path stopped half way. Protection: ``Tracer.transition`` and
    ``released`` never raise; the first failure is logged with its traceback, every one
    is counted, and the record reaches its terminal state."""

    def broken_probe(rec: RequestRecord) -> dict[str, Any]:
        raise KeyError("probe bug")

    with Tracer(TraceConfig(), probe=broken_probe) as tracer:
        tracer.subscribe().close()  # a feed subscriber: each edge is fed too
        tracer._pending = None  # type: ignore[assignment]  # the feed itself broken
        for end in ("finish", "fail"):
            rec = new_request()
            drive(rec, [Event.VALIDATE, Event.ADMIT, Event.DISPATCH])
            if end == "finish":
                assert rec.advance(Event.FINISH)
            else:
                assert rec.fail(Cause.CLIENT_GONE, "gone")
            rec.worker_released()
            assert rec.terminal
        assert tracer.errors == 2 * 5  # every edge and release of both requests
    failures = [r for r in caplog.records if "the tracer failed" in r.getMessage()]
    assert len(failures) == 1 and failures[0].exc_info is not None
