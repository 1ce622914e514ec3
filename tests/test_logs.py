"""What the server's log says (issue 40): one "ready" line once it serves, naming where,
what and how much; a throughput line while busy; no internal noise at info level."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import time
from types import SimpleNamespace

import anyio
import httpx
import pytest

from lifecycle import app as app_module
from lifecycle.testing.pytest_plugin import free_port
from wire.child import stop_process

from .app_helpers import running_app
from .ws_helpers import echo_body


def test_the_ready_line_comes_once_health_is_200() -> None:
    port = free_port()
    argv = [sys.executable, "-m", "lifecycle", "serve", "--scripted-worker", "--port", str(port)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(argv + ["--log-level", "info"], stderr=subprocess.PIPE, env=env)
    assert proc.stderr is not None
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while not any(" ready: " in ln for ln in lines):
            assert time.monotonic() < deadline, lines
            line = proc.stderr.readline().decode()
            assert line, f"the server exited: {lines}"
            lines.append(line.rstrip())
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(url + "/health").status_code == 200  # ready means serving
    finally:
        stop_process(proc)
        proc.stderr.close()
    (ready,) = [ln for ln in lines if " ready: " in ln]
    assert f"{url} serves SmolLM2-135M-Instruct.Q4_1" in ready
    assert "context 8192 tokens" in ready and "KV cache 65536 tokens" in ready
    assert "64 running at most" in ready
    assert f"{url}/debug and {url}/metrics" in ready
    listening = next(i for i, ln in enumerate(lines) if "listening on" in ln)
    assert listening < lines.index(ready)
    assert not any("cpu runtime" in ln for ln in lines)


@pytest.mark.anyio
async def test_a_throughput_line_while_busy_and_none_when_idle(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``_report_load`` over a stand-in frontend (a fake: only the counters it reads).
    Waits on the log, not the clock: a loaded machine may run the reporter's ticks late
    or back to back, which changes how many "1 live" lines come, never what they say."""
    monkeypatch.setattr(app_module, "LOAD_REPORT_S", 0.05)
    books = SimpleNamespace(finished=0, failed={})
    fe = SimpleNamespace(registry=books, output_tokens=0, calls=[object()])
    caplog.set_level(logging.INFO, logger="lifecycle.app")
    busy = "serving: 1 live, 4 ended in 0 s (1 with an error so far), 800.0 output tokens/s"

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.message.startswith("serving:")]

    async with anyio.create_task_group() as tg:
        tg.start_soon(app_module._report_load, fe)
        await anyio.sleep(0.01)
        books.finished, books.failed, fe.output_tokens = 3, {"aborted": 1}, 40
        with anyio.fail_after(30):
            while busy not in lines():
                await anyio.sleep(0.01)
        fe.calls = []  # idle from here: no tick may log again
        before = lines()
        await anyio.sleep(0.25)  # five periods
        tg.cancel_scope.cancel()
    assert lines() == before
    # the ticks before the change and after it (each a window with one live request)
    quiet = {
        "serving: 1 live, 0 ended in 0 s (0 with an error so far), 0.0 output tokens/s",
        "serving: 1 live, 0 ended in 0 s (1 with an error so far), 0.0 output tokens/s",
    }
    assert before.count(busy) == 1 and set(before) - {busy} <= quiet, before


_SERVING = re.compile(
    r"serving: (\d+) live, (\d+) ended in \d+ s \((\d+) with an error so far\), "
    r"([\d.]+) output tokens/s"
)


@pytest.mark.anyio
async def test_the_throughput_line_counts_tokens_while_a_request_runs(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 53: the rate is of the tokens that reached the frontend in the window, a
    request still generating included (it said 0.0 for the whole of a long generation,
    then all of it at once when it ended). A real app and the scripted worker, 10 ms a
    step; windows of 0.25 s, so a window's rate is 4x its tokens, exact in the line."""
    window = 0.25
    monkeypatch.setattr(app_module, "LOAD_REPORT_S", window)
    caplog.set_level(logging.INFO, logger="lifecycle.app")
    body = {**echo_body(1, 150), "stream": True}  # 150 steps: 1.5 s or more
    invalid = {"text": "x", "sampling_params": {"top_p": -1}}  # a record that ends invalid
    async with running_app(worker_extra_args=("--step-delay", "0.01")) as app:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.port}", timeout=60) as c:
            async with c.stream("POST", "/generate", json=body) as r:
                assert r.status_code == 200
                async for _ in r.aiter_bytes():
                    pass
            await anyio.sleep(2 * window)  # the end in a window of its own
            assert (await c.post("/generate", json=invalid)).status_code == 400
            await anyio.sleep(2 * window)
        assert app.frontend.output_tokens == 150
    got = [_SERVING.fullmatch(r.getMessage()) for r in caplog.records
           if r.getMessage().startswith("serving:")]  # fmt: skip
    assert all(got), caplog.records
    lines = [(int(m[1]), int(m[2]), int(m[3]), float(m[4])) for m in got if m]
    running = [ln for ln in lines if ln[0] == 1 and ln[1] == 0]
    assert len(running) >= 3, lines  # lines while the stream ran, before it ended
    # Most of its tokens were counted while it still ran (before: none of them).
    assert sum(rate for *_, rate in running) * window >= 75, lines
    # Every token counted once, in the window it arrived in.
    assert sum(rate for *_, rate in lines) * window == 150, lines
    # The stream's end, then the refused request's, each in a line of its own.
    ended = [ln for ln in lines if ln[1]]
    assert [(live, n, errors) for live, n, errors, _ in ended] == [(0, 1, 0), (0, 1, 1)], lines
    assert ended[1][3] == 0.0  # the refused request produced nothing
