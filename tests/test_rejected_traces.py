"""Every refused generation request leaves a short trace (route, cause, message, client)
and counts in ``lifecycle_requests_total`` with its cause, like any request that ended in
error: a body that is not JSON, a wrong type, an unknown field under ``--strict-fields``,
empty ``messages``, a prompt too long, a refused stream, a missing API key. Over a real
server on the scripted worker; ``/debug``, ``lifecycle trace`` and the trace log see them."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import jsonschema
import pytest
import websockets
from prometheus_client.parser import text_string_to_metric_families

from lifecycle.cli import main as cli_main
from tests.scripted import ROOT, lifecycle_server

KEY = "k-rejected"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    traces = tmp_path_factory.mktemp("rejected") / "traces.jsonl"
    with lifecycle_server(
        "--scripted-worker", "--strict-fields", "--api-key", KEY, "--open-admin-routes",
        "--trace-log", str(traces),
    ) as url:  # fmt: skip
        yield url, traces


async def refused_on_a_socket(url: str) -> dict[str, Any]:
    ws_url = url.replace("http", "ws") + "/v1/stream"
    async with websockets.connect(ws_url, additional_headers=AUTH) as ws:
        body = {"text": "x", "sampling_params": {"top_p": "high"}}
        await ws.send(json.dumps({"type": "generate", "id": 1, "body": body}))
        return dict(json.loads(await ws.recv()))


def outcomes(c: httpx.Client) -> dict[str, float]:
    text = c.get("/metrics", headers=AUTH).text
    return {
        s.labels["outcome"]: s.value
        for family in text_string_to_metric_families(text)
        if family.name == "lifecycle_requests"
        for s in family.samples
        if s.name == "lifecycle_requests_total"
    }


# (route, body or raw bytes, extra headers, expected status, cause, a part of the message)
CASES: list[tuple[str, Any, dict[str, str], int, str, str]] = [
    ("/generate", b"{not json", AUTH, 400, "invalid", "Invalid JSON"),
    ("/generate", {"text": "x", "sampling_params": {"top_p": "high"}}, AUTH, 400, "invalid",
     "top_p"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "frobnicate": 1},
     AUTH, 400, "invalid", "frobnicate"),
    ("/v1/chat/completions", {"messages": []}, AUTH, 400, "invalid", "messages"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, AUTH, 400, "invalid", "max_tokens"),
    ("/v1/embeddings", {"input": 7}, AUTH, 400, "invalid", "input"),
    ("/generate", {"input_ids": [5] * 9000}, AUTH, 400, "too_long", "context"),
    ("/generate", {"text": "x", "stream": True, "sampling_params": {"n": 0}}, AUTH, 200,
     "invalid", "n"),
    ("/generate", {"text": "x"}, {}, 401, "unauthorized", ""),
]  # fmt: skip


def test_every_refusal_is_traced_and_counted(
    server: tuple[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    url, traces = server
    with httpx.Client(base_url=url, timeout=30) as c:
        before = outcomes(c)
        ids = []
        for i, (route, body, headers, status, _, _) in enumerate(CASES):
            rid = f"refused-{i}"
            kw: dict[str, Any] = {"content": body} if isinstance(body, bytes) else {"json": body}
            r = c.post(route, headers={**headers, "X-Request-Id": rid}, **kw)
            assert r.status_code == status, (route, r.text)
            assert r.headers["x-request-id"] == rid
            ids.append(rid)
        # Not a generation route: answered, not recorded as a request.
        assert c.post("/tokenize", content=b"{", headers=AUTH).status_code == 400
        # A generation on a WebSocket refused by validation: traced under its route.
        ws_error = anyio.run(refused_on_a_socket, url)
        assert ws_error["type"] == "error" and "top_p" in ws_error["error"]["message"]
        after = outcomes(c)
        for i, (route, _, _, status, cause, part) in enumerate(CASES):
            t = c.get(f"/debug/requests/{ids[i]}", headers=AUTH).json()
            assert (t["route"], t["state"], t["cause"]) == (route, "error", cause), t
            assert part in (t["message"] or ""), t
            assert t["client"].startswith("127.0.0.1:")
            if status == 401:
                assert t["status"] == 401
        errors = c.get("/debug/traces", params={"status": "error"}, headers=AUTH).json()["traces"]
        assert {t["request_id"] for t in errors} >= set(ids)
        page = c.get("/debug/requests", headers=AUTH).json()
        assert page["counts"]["error"] >= len(CASES)
    ws_traces = [t for t in errors if t["route"] == "/v1/stream"]
    assert len(ws_traces) == 1 and ws_traces[0]["cause"] == "invalid"
    wanted = {"invalid": 1}  # the socket's
    for *_, cause, _ in CASES:
        wanted[cause] = wanted.get(cause, 0) + 1
    for cause, n in wanted.items():
        assert after.get(cause, 0) - before.get(cause, 0) == n, (cause, before, after)

    # The trace log has them, valid against the schema, and `lifecycle trace` lists them.
    schema = json.loads((ROOT / "specs" / "trace.schema.json").read_text())
    deadline = time.monotonic() + 5
    while True:
        lines = [json.loads(x) for x in traces.read_text().splitlines()]
        logged = {t["request_id"]: t for t in lines}
        if set(ids) <= set(logged) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for rid in ids:
        jsonschema.validate(logged[rid], schema)
        assert logged[rid]["route"] and logged[rid]["client"]
    assert cli_main(["trace", "errors", "invalid", "--log", str(traces), "--json"]) == 0
    listed = {t["request_id"] for t in json.loads(capsys.readouterr().out)}
    refused = {rid for rid, case in zip(ids, CASES, strict=True) if case[4] == "invalid"}
    assert listed == refused | {ws_traces[0]["request_id"]}
    assert cli_main(["trace", "list", "--log", str(traces), "--route", "/v1/chat/completions",
                     "--json"]) == 0  # fmt: skip
    chats = json.loads(capsys.readouterr().out)
    assert {t["request_id"] for t in chats} == {"refused-2", "refused-3"}
