"""``lifecycle trace`` on a recorded log and on a live server: its answers match what was sent."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from lifecycle.cli import main
from lifecycle.core.fsm import new_request
from lifecycle.core.states import Cause, Event
from lifecycle.tracing.query import parse_time, percentile
from lifecycle.tracing.tracer import TraceConfig, Tracer
from tests.debug_helpers import debug_server
from tests.test_fsm import drive, release

ROOT = Path(__file__).resolve().parent.parent
HAPPY = (Event.VALIDATE, Event.ADMIT, Event.DISPATCH, Event.FIRST_TOKEN)
STATE_AFTER = ("received", "validated", "queued", "running", "streaming")


def _send(rid: str, upto: int, cause: Cause | None = None, dwell: dict[int, float] | None = None):
    """One request: ``upto`` happy edges (sleeping ``dwell[i]`` s before edge i), then an end."""
    rec = new_request(rid)
    for i, ev in enumerate(HAPPY[:upto]):
        time.sleep((dwell or {}).get(i, 0))
        drive(rec, [ev])
    time.sleep((dwell or {}).get(upto, 0))
    if cause is None:
        drive(rec, [Event.FINISH])
    else:
        rec.fail(cause, f"{rid} failed")
    release(rec)
    return rec


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float, dict[str, int]]:
    """A log of known requests; returns (path, a time between the two phases, rid -> id)."""
    path = tmp_path_factory.mktemp("cli") / "traces.jsonl"
    ids: dict[str, int] = {}
    with Tracer(TraceConfig(log_path=str(path), log_max_bytes=16_000, log_backups=20)) as t:
        for i in range(10):
            ids[f"ok-{i}"] = _send(f"ok-{i}", 4).id
        ids["slow-q"] = _send("slow-q", 4, dwell={2: 0.04}).id  # 40 ms queued
        ids["slow-r"] = _send("slow-r", 4, dwell={3: 0.08}).id  # 80 ms running
        time.sleep(0.02)
        middle = time.time()
        time.sleep(0.02)
        for i in range(3):
            ids[f"dl-{i}"] = _send(f"dl-{i}", 4, Cause.DEADLINE, dwell={4: 0.01}).id
        for i in range(2):
            ids[f"ov-{i}"] = _send(f"ov-{i}", 1, Cause.OVERLOADED).id
        ids["gone"] = _send("gone", 3, Cause.CLIENT_GONE).id
        assert t.log is not None and t.log.rotations >= 1  # the CLI reads the backups too
    return path, middle, ids


def run_json(capsys: pytest.CaptureFixture[str], *argv: str):
    assert main(["trace", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_list_and_filters(recorded, capsys) -> None:
    path, middle, ids = recorded
    log = ["--log", str(path)]
    everything = run_json(capsys, "list", *log)
    assert [t["rid"] for t in everything] == list(ids)
    late = run_json(capsys, "list", *log, "--since", str(middle))
    assert [t["rid"] for t in late] == ["dl-0", "dl-1", "dl-2", "ov-0", "ov-1", "gone"]
    early = run_json(capsys, "list", *log, "--until", str(middle))
    assert len(early) == 12 and early[-1]["rid"] == "slow-r"
    assert [t["rid"] for t in run_json(capsys, "list", *log, "--status", "503")] == ["ov-0", "ov-1"]
    assert len(run_json(capsys, "list", *log, "--status", "error")) == 6
    assert len(run_json(capsys, "list", *log, "--status", "done")) == 12
    assert run_json(capsys, "list", *log, "--since", "1h", "--status", "499")[0]["rid"] == "gone"


def test_errors_by_cause(recorded, capsys) -> None:
    path, _, _ = recorded
    deadline = run_json(capsys, "errors", "deadline", "--log", str(path))
    assert [t["rid"] for t in deadline] == ["dl-0", "dl-1", "dl-2"]
    assert all(t["status"] == 504 and t["message"].endswith("failed") for t in deadline)
    assert run_json(capsys, "errors", "worker_lost", "--log", str(path)) == []
    with pytest.raises(SystemExit, match="unknown cause"):
        main(["trace", "errors", "bogus", "--log", str(path)])


def test_slowest(recorded, capsys) -> None:
    path, _, _ = recorded
    log = ["--log", str(path)]
    assert [t["rid"] for t in run_json(capsys, "slowest", "-n", "2", *log)] == ["slow-r", "slow-q"]
    by_queued = run_json(capsys, "slowest", "-n", "1", "--by", "queued", *log)
    assert by_queued[0]["rid"] == "slow-q" and by_queued[0]["states_ms"]["queued"] >= 40
    by_running = run_json(capsys, "slowest", "-n", "1", "--by", "running", *log)
    assert by_running[0]["rid"] == "slow-r" and by_running[0]["states_ms"]["running"] >= 80
    streaming = run_json(capsys, "slowest", "-n", "3", "--by", "streaming", *log)
    assert {t["rid"] for t in streaming} == {"dl-0", "dl-1", "dl-2"}


def test_timeline(recorded, capsys) -> None:
    path, _, ids = recorded
    t = run_json(capsys, "timeline", "gone", "--log", str(path))
    assert t["id"] == ids["gone"] and t["cause"] == "client_gone"
    assert [(x["src"], x["event"], x["dst"]) for x in t["transitions"]] == [
        ("received", "validate", "validated"),
        ("validated", "admit", "queued"),
        ("queued", "dispatch", "running"),
        ("running", "fail", "error"),
    ]
    assert t["handoffs"]["worker_released"] is not None
    assert run_json(capsys, "timeline", str(ids["gone"]), "--log", str(path)) == t
    assert main(["trace", "timeline", "gone", "--log", str(path)]) == 0
    text = capsys.readouterr().out
    for word in ("error(client_gone)", "received", "queued", "running", "dispatched", "-fail->"):
        assert word in text
    with pytest.raises(SystemExit, match="no request"):
        main(["trace", "timeline", "absent", "--log", str(path)])


def test_summary(recorded, capsys) -> None:
    path, _, _ = recorded
    summary = run_json(capsys, "summary", "--log", str(path))
    assert list(summary) == ["received", "validated", "queued", "running", "streaming"]
    assert summary["received"]["count"] == 18
    assert summary["validated"]["count"] == 18  # the two overloaded failed from there
    assert summary["queued"]["count"] == 16
    assert summary["running"]["count"] == 16 and summary["streaming"]["count"] == 15
    assert summary["queued"]["max_ms"] >= 40 and summary["running"]["max_ms"] >= 80
    assert summary["queued"]["p50_ms"] < 40 <= summary["queued"]["p99_ms"]
    assert main(["trace", "summary", "--log", str(path)]) == 0
    assert "p99 ms" in capsys.readouterr().out


def test_entry_point_and_bad_source(recorded) -> None:
    path, _, _ = recorded
    out = subprocess.run(
        [sys.executable, "-m", "lifecycle", "trace", "errors", "overloaded", "--log", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "ov-0" in out.stdout and "ov-1" in out.stdout and "(2 requests)" in out.stdout
    with pytest.raises(SystemExit, match="exactly one"):
        main(["trace", "summary"])
    with pytest.raises(SystemExit, match="not a time"):
        main(["trace", "list", "--log", str(path), "--since", "soon"])


def test_query_helpers() -> None:
    assert percentile([5.0], 99) == 5.0
    assert percentile([float(i) for i in range(1, 101)], 50) == 50.0
    assert percentile([float(i) for i in range(1, 101)], 99) == 99.0
    assert parse_time("10m", now=1000.0) == 400.0
    assert parse_time("2026-12-02T12:00:00Z") == 1796212800.0


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_live_server_source(capsys, anyio_backend) -> None:
    async with debug_server() as srv:
        srv.finish(srv.start("live-done"))
        srv.finish(srv.start("live-dl", upto=2), Cause.DEADLINE)
        held = srv.start("still-running", upto=3)

        def cli(*argv: str):
            return run_json(capsys, *argv, "--url", srv.url)

        assert [t["rid"] for t in await anyio.to_thread.run_sync(cli, "list")] == [
            "live-done",
            "live-dl",
        ]
        errors = await anyio.to_thread.run_sync(cli, "errors", "deadline")
        assert [t["rid"] for t in errors] == ["live-dl"]
        # A live request is not in the ring: the timeline asks /debug/requests/{key}.
        live = await anyio.to_thread.run_sync(cli, "timeline", "still-running")
        assert live["state"] == "running" and live["id"] == held.id
        assert live["finished_ns"] is None


def test_a_closed_pipe_ends_quietly(recorded) -> None:
    """Issue 40: ``lifecycle trace list | head -1`` ended in a BrokenPipeError traceback."""
    path, _, _ = recorded
    lister = subprocess.Popen(
        [sys.executable, "-m", "lifecycle", "trace", "list", "--log", str(path)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert lister.stdout is not None and lister.stderr is not None
    lister.stdout.close()  # what head does once it has its lines: before any is written
    with lister.stderr:
        err = lister.stderr.read().decode()
    assert lister.wait(60) == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err
