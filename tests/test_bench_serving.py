"""The serving load generator end to end: runs against the FastAPI baseline app in a
subprocess (every API, streamed and not, scripted failures, an open loop under a time
cap, the CLI's JSON), a refused connection, a keep-alive connection the server closed,
and the comparison harness alternating two baseline servers."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.apis import RequestSpec
from bench.client import Target
from bench.procs import ServerProcess
from bench.serving import LoadConfig, run_load_sync
from bench.workload import WorkloadConfig, make_workload

ROOT = Path(__file__).resolve().parent.parent

# --- end to end against the FastAPI baseline --------------------------------------------


@pytest.fixture(scope="module")
def baseline() -> Iterator[Target]:
    proc = ServerProcess.start_baseline(sys.executable, cwd=ROOT)
    try:
        yield Target("127.0.0.1", proc.port)
    finally:
        proc.stop()


def _run(target: Target, spec: RequestSpec, n: int = 6, conc: int = 3, out_len: int = 5):
    prompts = make_workload(WorkloadConfig(num_requests=n, input_len=8, output_len=out_len))
    cfg = LoadConfig(max_concurrency=conc, progress=False, request_timeout_s=20)
    return run_load_sync(target, spec, prompts, cfg)


@pytest.mark.parametrize("api", ["generate", "completions", "chat"])
@pytest.mark.parametrize("stream", [True, False])
def test_load_against_baseline(baseline: Target, api: str, stream: bool) -> None:
    res = _run(baseline, RequestSpec(api=api, stream=stream))
    m = res.metrics
    assert (m.completed, m.failed, res.not_started) == (6, 0, 0)
    assert (m.total_input, m.total_output) == (48, 30) and res.short == []
    assert res.connections_opened <= 4  # keep-alive: one per concurrent slot (+ warm-up)
    for o in res.outputs:
        assert o.ttft > 0 and o.latency >= o.ttft
        assert len(o.itl) == (4 if stream else 0)
    assert res.outputs[0].generated_text.startswith(" the of")


@pytest.mark.parametrize(
    ("fault", "api", "stream", "error"),
    [
        ("http_500", "generate", True, "HTTP 500"),
        ("http_500", "completions", False, "HTTP 500"),
        ("truncate", "generate", True, "without [DONE]"),
        ("truncate", "completions", True, "without [DONE]"),
        ("drop", "generate", True, "truncated response"),
    ],
)
def test_scripted_failures_are_counted(
    baseline: Target, fault: str, api: str, stream: bool, error: str
) -> None:
    spec = RequestSpec(api=api, stream=stream, extra_body={"scripted_fault": fault})
    prompts = make_workload(WorkloadConfig(num_requests=4, input_len=4, output_len=8))
    cfg = LoadConfig(max_concurrency=2, progress=False, warmup_requests=0, request_timeout_s=20)
    res = run_load_sync(baseline, spec, prompts, cfg)
    assert (res.metrics.completed, res.metrics.failed) == (0, 4)
    assert res.metrics.total_output == 0 and res.metrics.output_throughput == 0
    assert all(error in o.error for o in res.outputs), [o.error for o in res.outputs]


@pytest.mark.parametrize("stream", [True, False])
def test_a_short_answer_is_named(baseline: Target, stream: bool) -> None:
    """A request that forced 5 tokens and got 4, ended as if whole, succeeds and is
    listed (prompt index, counted, forced); without forcing, fewer tokens are the
    model's choice and nothing is listed."""
    spec = RequestSpec(stream=stream, extra_body={"scripted_fault": "short"})
    res = _run(baseline, spec, n=3, conc=1)
    assert (res.metrics.completed, res.metrics.failed) == (3, 0)
    assert res.short == [(0, 4, 5), (1, 4, 5), (2, 4, 5)]
    free = RequestSpec(stream=stream, ignore_eos="off", extra_body={"scripted_fault": "short"})
    assert _run(baseline, free, n=3, conc=1).short == []


def test_refused_connection_is_a_failure() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again before use: nothing listens there
    cfg = LoadConfig(max_concurrency=2, progress=False, warmup_requests=0)
    prompts = make_workload(WorkloadConfig(num_requests=3, input_len=4, output_len=2))
    res = run_load_sync(Target("127.0.0.1", port), RequestSpec(), prompts, cfg)
    assert res.metrics.failed == 3 and "connection error" in res.outputs[0].error


def test_open_loop_with_time_cap_stops_issuing(baseline: Target) -> None:
    prompts = make_workload(WorkloadConfig(num_requests=200, input_len=4, output_len=2))
    cfg = LoadConfig(request_rate=40.0, time_cap_s=0.5, progress=False)
    res = run_load_sync(baseline, RequestSpec(), prompts, cfg)
    m = res.metrics
    assert m.failed == 0 and 3 <= m.completed <= 60, m.completed
    assert m.completed + res.not_started == 200
    assert m.duration_s < 3.0 and not math.isnan(m.request_throughput)


def test_cli_writes_json(baseline: Target, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    cmd = [
        sys.executable,
        "-m",
        "bench.serving",
        "--base-url",
        f"http://127.0.0.1:{baseline.port}",
        "--api",
        "completions",
        "--num-requests",
        "4",
        "--max-concurrency",
        "2",
        "--output-len",
        "3",
        "--input-len",
        "4",
        "--output-file",
        str(out),
        "--quiet",
    ]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "Serving Benchmark Result" in run.stdout and "P95 ITL (ms)" in run.stdout
    d = json.loads(out.read_text())
    assert d["completed"] == 4 and d["total_output"] == 12 and "p99_itl_ms" in d
    assert d["client_cpu_s"] >= 0


# --- the comparison harness ------------------------------------------------------------


def test_compare_alternates_and_pools_reps(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from bench.compare import compare, print_table
    from bench.contenders import Contender

    procs = [ServerProcess.start_baseline(sys.executable, cwd=ROOT) for _ in range(2)]
    try:
        contenders = [Contender(lb, p, RequestSpec()) for lb, p in zip("AB", procs, strict=True)]
        args = argparse.Namespace(
            levels=[1, 3],
            num_requests=4,
            reps=2,
            mode="frontend",
            time_cap=30.0,
            quiet=True,
            input_len=4,
            output_len=6,
            long_output_len=12,
        )
        summary = compare(contenders, args)
    finally:
        for p in procs:
            p.stop()
    order = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("==")]
    assert [ln.rsplit(" ", 1)[1] for ln in order] == list("ABAB" * 2)
    for conc in (1, 3):
        for lb in "AB":
            row = summary[conc][lb]
            assert (row["completed"], row["failed"]) == (8, 0)  # 4 requests x 2 reps, pooled
            assert len(row["rep_output_tok_s"]) == 2 and row["output_tok_s"] > 0
            assert row["server_cpu_us_per_request"] > 0
            # the second output length ran: a slope and an intercept exist (their values
            # are noise at 6 vs 12 tokens)
            assert math.isfinite(row["marginal_cpu_us_per_token"])
            assert math.isfinite(row["fixed_cpu_us_per_request"])
    print_table(summary, ["A", "B"], frontend=True)
    table = capsys.readouterr().out
    assert "A/B" in table and "CPU us/tok" in table and "c=3: A 8/0, B 8/0" in table
    assert "per streamed token (marginal)" in table


def test_stale_keep_alive_connection_is_retried_once() -> None:
    """Regression: a server may close an idle keep-alive connection between two requests
    (its idle timeout). The next request on that pooled connection sees EOF before any
    byte and must be resent on a fresh connection, not counted as failed."""
    import socket
    import threading

    body = b'{"text": " a", "meta_info": {"completion_tokens": 1}}'
    reply = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
        len(body),
        body,
    )
    listener = socket.create_server(("127.0.0.1", 0))
    served: list[int] = []

    def scripted_peer() -> None:  # answers one request per connection, then hangs up
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data or not data.endswith(b"}"):
                    data += conn.recv(65536)
                served.append(1)  # before the reply: the client may count at once
                conn.sendall(reply)

    thread = threading.Thread(target=scripted_peer, daemon=True)
    thread.start()
    try:
        target = Target("127.0.0.1", listener.getsockname()[1])
        prompts = make_workload(WorkloadConfig(num_requests=3, input_len=2, output_len=1))
        cfg = LoadConfig(max_concurrency=1, progress=False, warmup_requests=0, request_timeout_s=10)
        res = run_load_sync(target, RequestSpec(stream=False), prompts, cfg)
    finally:
        listener.close()
    assert (res.metrics.completed, res.metrics.failed) == (3, 0), [o.error for o in res.outputs]
    assert len(served) == 3 and res.connections_opened == 3
