"""``lifecycle serve --frontends 2``: two frontend processes behind one port (SO_REUSEPORT)
share one worker; killing one mid-stream ends only the streams it carried, the other's
finish whole, and the launcher starts it again. A real launcher, real frontends, the
scripted worker, which serves several frontends at once (books of its own for each);
that the model worker frees what a departed frontend held, and only that, is
tests/test_worker_process.py's."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.scripted import ROOT, count_stream, free_port

pytestmark = pytest.mark.timeout(120)

TOKENS = 150  # at 10 ms a step: 1.5 s a stream


@contextmanager
def _launcher(*args: str) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    port = free_port()
    argv = [sys.executable, "-m", "lifecycle", "serve", "--port", str(port), "--frontends", "2",
            "--scripted-worker", "--log-level", "warning", *args]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=ROOT)
    try:
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _info(url: str) -> dict:
    # a fresh connection each time: the kernel picks the listener per connection
    return httpx.get(url + "/server_info", timeout=10, headers={"Connection": "close"}).json()


def _frontends(url: str, want: int = 2, timeout: float = 60) -> dict[int, int]:
    """``{frontend_index: pid}`` once ``want`` distinct frontends have answered."""
    seen: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    while len(seen) < want:
        assert time.monotonic() < deadline, seen
        try:
            info = _info(url)
            if info["internal_states"][0].get("ready"):
                seen[info["frontend_index"]] = info["frontend_pid"]
        except (httpx.TransportError, KeyError, ValueError):
            time.sleep(0.1)
    return seen


def test_two_frontends_share_the_port_and_survive_each_other() -> None:
    with _launcher("--worker-args", "--step-delay 0.01") as (proc, url):
        pids = _frontends(url)

        async def load() -> list[tuple[str, int]]:
            progress = [0] * 24
            tasks = [asyncio.create_task(count_stream(url, i, TOKENS, progress)) for i in range(24)]
            deadline = time.monotonic() + 30
            while min(progress) == 0:  # every stream under way
                assert time.monotonic() < deadline, progress
                await asyncio.sleep(0.02)
            os.kill(pids[0], signal.SIGKILL)  # frontend 0 dies mid-stream
            return await asyncio.gather(*tasks)

        outcomes = asyncio.run(load())
        done = [o for o in outcomes if o == ("done", TOKENS)]
        cut = [o for o in outcomes if o[0] == "cut"]
        # the kernel spread 24 connections over both listeners (all on one: 2**-23)
        assert done and cut and len(done) + len(cut) == 24, outcomes
        assert all(0 < n < TOKENS for _, n in cut), cut  # cut mid-stream, not refused

        # the launcher starts frontend 0 again; the worker freed what it held
        deadline = time.monotonic() + 60
        while True:
            again = _frontends(url)
            state = _info(url)["internal_states"][0]
            if again[0] != pids[0] and state["running"] == 0:
                break
            assert time.monotonic() < deadline, (again, state)
            time.sleep(0.2)
        assert again[1] == pids[1]  # the other one never stopped
        assert state["kv_blocks_free"] == state["kv_blocks_total"], state
        assert asyncio.run(count_stream(url, 99, TOKENS)) == ("done", TOKENS)

        proc.send_signal(signal.SIGTERM)  # the frontends drain and stop, then the worker
        assert proc.wait(60) == 0


def test_frontends_with_a_shared_trace_log_are_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with _launcher("--trace-log", str(tmp_path / "t.jsonl")) as (proc, _):
        assert proc.wait(30) == 2


def test_a_scrape_of_any_frontend_is_the_whole_server() -> None:
    """/metrics on the shared port: every frontend's series, labelled ``frontend``, from
    whichever frontend answers (lifecycle/tracing/shared_metrics.py), so the server's
    counts are the same whoever is asked and never go back."""
    with _launcher() as (proc, url):
        _frontends(url)
        body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3}}
        for _ in range(10):
            r = httpx.post(url + "/generate", json=body, headers={"Connection": "close"})
            assert r.status_code == 200, r.text

        def scrape() -> tuple[str, float]:
            text = httpx.get(url + "/metrics", headers={"Connection": "close"}).text
            families = {f.name: f for f in text_string_to_metric_families(text)}
            samples = families["lifecycle_http_requests"].samples
            assert {s.labels["frontend"] for s in samples} <= {"0", "1"}
            rss = families["lifecycle_process_resident_memory_bytes"].samples
            assert sorted(s.labels["frontend"] for s in rss) == ["0", "1"]
            return text, sum(s.value for s in samples if s.labels["endpoint"] == "/generate")

        # each frontend publishes its own every second: until both have, however late
        deadline = time.monotonic() + 20
        seen = [scrape()[1]]
        while seen[-1] != 10:
            assert time.monotonic() < deadline and seen[-1] <= 10, seen
            time.sleep(0.1)
            seen.append(scrape()[1])
        assert seen == sorted(seen), seen  # never back
        totals = []
        for _ in range(12):
            text, total = scrape()
            totals.append(total)
        assert totals == [10] * 12, totals
        if shutil.which("promtool"):
            check = subprocess.run(["promtool", "check", "metrics"], input=text.encode(),
                                   capture_output=True)  # fmt: skip
            assert check.returncode == 0, check.stderr
