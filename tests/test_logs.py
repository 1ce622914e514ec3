"""What the server's log says (issue 40): one "ready" line once it serves, naming where,
what and how much; a throughput line while busy; no internal noise at info level."""

from __future__ import annotations

import logging
import os
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
    """``_report_load`` over a stand-in frontend (a fake: only the counters it reads)."""
    monkeypatch.setattr(app_module, "LOAD_REPORT_S", 0.05)
    books = SimpleNamespace(finished=0, failed={})
    fe = SimpleNamespace(registry=books, output_tokens=0, calls=[object()])
    caplog.set_level(logging.INFO, logger="lifecycle.app")
    async with anyio.create_task_group() as tg:
        tg.start_soon(app_module._report_load, fe)
        await anyio.sleep(0.01)
        books.finished, books.failed, fe.output_tokens = 3, {"aborted": 1}, 40
        await anyio.sleep(0.06)
        fe.calls = []
        await anyio.sleep(0.2)  # idle: nothing more
        tg.cancel_scope.cancel()
    lines = [r.getMessage() for r in caplog.records if r.message.startswith("serving:")]
    assert lines[0] == (
        "serving: 1 live, 4 ended in 0 s (1 with an error so far), 800.0 output tokens/s"
    )
    assert len(lines) == 1
