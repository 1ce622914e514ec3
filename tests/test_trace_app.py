"""Traces from the real server: ``lifecycle serve --trace-log`` with the scripted worker.

Requests go over real HTTP to a real server process; their traces are read back from the
debug routes while it runs and from the trace log (and ``lifecycle trace``) after it
stopped.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from lifecycle.cli import main
from lifecycle.core.states import EDGES
from lifecycle.tracing.store import read_log

from .scripted import lifecycle_server

ROOT = Path(__file__).resolve().parent.parent
VALIDATOR = jsonschema.Draft202012Validator(
    json.loads((ROOT / "specs" / "trace.schema.json").read_text())
)
ALLOWED = {(e.src.value, e.event.value, e.dst.value) for e in EDGES}
KEY = {"authorization": "Bearer adm1n"}


def _trace(url: str, rid: str, *, ended: bool = True, timeout: float = 10) -> dict[str, Any]:
    """The trace of ``rid``; with ``ended``, once the worker let go of it too."""
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.get(f"{url}/debug/requests/{rid}", headers=KEY, timeout=10)
        if r.status_code == 200:
            t = r.json()
            if not ended or (t["finished_ns"] and (t["worker"] is None or _released(t))):
                return dict(t)
        assert time.monotonic() < deadline, f"no finished trace for {rid}: {r.text}"
        time.sleep(0.02)


def _released(t: dict[str, Any]) -> bool:
    return t["handoffs"]["worker_released"] is not None


def _path(t: dict[str, Any]) -> list[str]:
    assert all((x["src"], x["event"], x["dst"]) in ALLOWED for x in t["transitions"])
    return [x["event"] for x in t["transitions"]]


def test_traces_from_the_server(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "traces.jsonl"
    args = ("--scripted-worker", "--worker-args", "--step-delay 0.02", "--trace-log", str(log))
    with lifecycle_server(*args, "--admin-api-key", "adm1n") as url:
        assert httpx.get(f"{url}/debug/requests", timeout=10).status_code == 401
        page = httpx.get(f"{url}/debug?key=adm1n", timeout=10)
        assert page.status_code == 200 and b"/feed" in page.content
        assert "adm1n" not in httpx.get(f"{url}/server_info", timeout=10).text

        body = {"text": "hello there", "rid": "unary-ok", "sampling_params": {"max_new_tokens": 4}}
        assert httpx.post(f"{url}/generate", json=body, timeout=30).status_code == 200
        ok = _trace(url, "unary-ok")
        assert _path(ok) == ["validate", "admit", "dispatch", "first_token", "finish"]
        assert ok["tokens"] == 4 and ok["worker"].startswith("local pid")
        assert all(ok["handoffs"][h] for h in ("admitted", "dispatched", "first_token"))
        assert _released(ok)

        long = {"text": "hi", "rid": "too-long", "sampling_params": {"max_new_tokens": 10**6}}
        assert httpx.post(f"{url}/generate", json=long, timeout=30).status_code == 400
        refused = _trace(url, "too-long")
        assert _path(refused)[-1] == "fail" and refused["status"] == 400
        assert refused["worker"] is None and not _released(refused)

        gone = {**body, "rid": "gone", "stream": True, "sampling_params": {"max_new_tokens": 500}}
        with httpx.stream("POST", f"{url}/generate", json=gone, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # first chunk in: leave mid-stream
        live = _trace(url, "gone", ended=False)
        assert live["state"] in ("streaming", "error")
        left = _trace(url, "gone")
        assert left["cause"] == "client_gone" and _path(left)[-1] == "fail"
        assert left["transitions"][-1]["src"] == "streaming" and _released(left)
        assert 0 < left["tokens"] < 500
    lines = read_log(log)
    assert [t["rid"] for t in lines] == ["unary-ok", "too-long", "gone"]
    for line in lines:
        VALIDATOR.validate(line)
    assert lines[0] == ok and lines[2]["handoffs"] == left["handoffs"]

    assert main(["trace", "errors", "client_gone", "--log", str(log), "--json"]) == 0
    assert [t["rid"] for t in json.loads(capsys.readouterr().out)] == ["gone"]
