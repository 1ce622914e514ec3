"""One request id everywhere (docs/api.md, "Request ids"), over a real server on the
scripted worker: every answer carries ``X-Request-Id`` (the client's, the body's rid, or
one the server made), and ``/debug/requests/{key}``, the trace log, ``lifecycle trace``
and the access log find a request by it and by every id the client got from it
(``chatcmpl-``, ``cmpl-``, ``resp_``, ``meta_info.id``)."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import websockets

from lifecycle.cli import main as cli_main
from lifecycle.tracing.query import find
from lifecycle.tracing.store import read_log
from tests.scripted import lifecycle_server
from transport import HTTPError, Request, Response, Router, Server, ServerConfig, SSEResponse

HEX = re.compile(r"^[0-9a-f]{32}$")
BODY = {"input_ids": [101, 202, 303], "sampling_params": {"max_new_tokens": 3}}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Path]]:
    tmp = tmp_path_factory.mktemp("ids")
    traces, access = tmp / "traces.jsonl", tmp / "access.jsonl"
    with lifecycle_server(
        "--scripted-worker", "--worker-args", "--step-delay 0.005",
        "--trace-log", str(traces), "--access-log", str(access), "--trace-prompts",
    ) as url:  # fmt: skip
        yield url, traces, access


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _logged(path: Path, ok: Any, timeout: float = 5.0) -> list[dict[str, Any]]:
    """The file's JSON lines, once ``ok(lines)`` holds (the trace log flushes every 0.1 s)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        if ok(lines) or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


def test_every_answer_carries_its_id(server: tuple[str, Path, Path]) -> None:
    url = server[0]
    with httpx.Client(base_url=url, timeout=30) as c:
        made = c.get("/health").headers["x-request-id"]
        assert HEX.match(made)
        assert c.get("/health").headers["x-request-id"] != made  # one per request
        assert (
            c.get("/health", headers={"X-Request-Id": "mine-1"}).headers["x-request-id"] == "mine-1"
        )
        # Not a usable id (too long): replaced by one the server makes.
        assert HEX.match(
            c.get("/health", headers={"X-Request-Id": "x" * 200}).headers["x-request-id"]
        )
        assert HEX.match(c.get("/no/such/route").headers["x-request-id"])  # a 404 too
        assert c.get("/v1/models", headers={"x-request-id": "m-1"}).headers["x-request-id"] == "m-1"
        bad = c.post("/generate", content=b"{", headers={"X-Request-Id": "bad-1"})
        assert bad.status_code == 400 and bad.headers["x-request-id"] == "bad-1"
        # The body's rid names the request when no header does; a header wins.
        r = c.post("/generate", json={**BODY, "rid": "body-1"})
        assert r.headers["x-request-id"] == "body-1" == r.json()["meta_info"]["id"]
        r = c.post("/generate", json={**BODY, "rid": "body-2"}, headers={"X-Request-Id": "hdr-2"})
        assert r.headers["x-request-id"] == "hdr-2" and r.json()["meta_info"]["id"] == "body-2"
        with c.stream("POST", "/generate", json={**BODY, "stream": True}) as s:
            sid = s.headers["x-request-id"]
            events = [line for line in s.iter_lines() if line.startswith("data: {")]
        assert HEX.match(sid) and json.loads(events[-1][6:])["meta_info"]["id"] == sid
        with c.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True},
                      headers={"X-Request-Id": "sse-1"}) as s:  # fmt: skip
            assert s.headers["x-request-id"] == "sse-1"
            chunk = next(line for line in s.iter_lines() if line.startswith("data: {"))
        assert json.loads(chunk[6:])["id"] == "chatcmpl-sse-1"

    async def upgrade() -> tuple[str, str]:
        ws_url = url.replace("http", "ws") + "/v1/stream"
        async with websockets.connect(ws_url, additional_headers={"X-Request-Id": "ws-1"}) as ws:
            await ws.send(json.dumps({"type": "generate", "id": 1, "body": BODY}))
            while (msg := json.loads(await ws.recv()))["type"] != "done":
                pass
            return ws.response.headers["x-request-id"], msg["meta_info"]["id"]

    upgrade_id, generation_id = anyio.run(upgrade)
    assert upgrade_id == "ws-1" and HEX.match(generation_id)  # each generation: its own id
    trace = httpx.get(f"{url}/debug/requests/{generation_id}").json()
    assert trace["route"] == "/v1/stream" and trace["request_id"] == generation_id


def test_a_request_is_found_by_every_id_it_gave(
    server: tuple[str, Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    url, traces, access = server
    found: dict[str, str] = {}  # an id the client got -> the request id its trace has
    with httpx.Client(base_url=url, timeout=30) as c:
        r = c.post("/generate", json=BODY)
        meta_id = r.json()["meta_info"]["id"]
        assert meta_id == r.headers["x-request-id"]
        found[meta_id] = meta_id
        r = c.post("/generate", json={**BODY, "sampling_params": {"max_new_tokens": 2, "n": 2}})
        ids = [x["meta_info"]["id"] for x in r.json()]
        rq = r.headers["x-request-id"]
        assert ids == [f"{rq}_0", f"{rq}_1"]  # each sample's; both name the request
        found.update({i: rq for i in ids})
        r = c.post("/generate", json={"input_ids": [[1, 2, 3], [4, 5, 6]],
                                      "sampling_params": {"max_new_tokens": 2}})  # fmt: skip
        rq = r.headers["x-request-id"]
        assert [x["meta_info"]["id"] for x in r.json()] == [f"{rq}_0", f"{rq}_1"]
        found[f"{rq}_1"] = f"{rq}_1"
        found[rq] = f"{rq}_0"  # a batch's id names its first prompt
        r = c.post("/v1/chat/completions", json=CHAT)
        assert r.json()["id"] == "chatcmpl-" + r.headers["x-request-id"]
        found[r.json()["id"]] = r.headers["x-request-id"]
        r = c.post("/v1/completions", json={"prompt": "once", "max_tokens": 2},
                   headers={"X-Request-Id": "client-cmpl"})  # fmt: skip
        assert r.json()["id"] == "cmpl-client-cmpl"
        found["cmpl-client-cmpl"] = "client-cmpl"
        r = c.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2})
        assert r.json()["id"] == "resp_" + r.headers["x-request-id"]
        found[r.json()["id"]] = r.headers["x-request-id"]
        for key, rq in found.items():
            t = c.get(f"/debug/requests/{key}")
            assert t.status_code == 200, key
            assert t.json()["request_id"] == rq and t.json()["state"] == "done", key
        assert c.get("/debug/requests/chatcmpl-nobody").status_code == 404
        # With --trace-prompts a trace keeps the prompt's text (a chat's rendered template).
        chat = c.get(f"/debug/requests/{next(k for k in found if k.startswith('chatcmpl-'))}")
        assert "hi" in chat.json()["prompt"] and "user" in chat.json()["prompt"]
        assert chat.json()["params"]["max_new_tokens"] == 2

    # The trace log: every line has its request id and route, and the same keys find it.
    logged = _logged(traces, lambda lines: all(find(lines, k) for k in found))
    assert all(t["route"] and t["request_id"] for t in logged)
    on_disk = read_log(traces)
    for key, rq in found.items():
        hit = find(on_disk, key)
        assert hit is not None and hit["request_id"] == rq, key
    # lifecycle trace, from the log and from the server.
    chat_id = next(k for k in found if k.startswith("chatcmpl-"))
    for source in (["--log", str(traces)], ["--url", url]):
        assert cli_main(["trace", "timeline", chat_id, *source, "--json"]) == 0
        answer = json.loads(capsys.readouterr().out)
        assert answer["request_id"] == found[chat_id] and answer["route"] == "/v1/chat/completions"
    # The access log's ids find the same request.
    lines = _logged(access, lambda ls: any(x.get("request_id") == "client-cmpl" for x in ls))
    line = next(x for x in lines if x.get("request_id") == "client-cmpl")
    assert line["rid"] == "client-cmpl" and line["route"] == "/v1/completions"
    assert find(on_disk, line["rid"])["request_id"] == "client-cmpl"


def test_abort_request_by_request_id_ends_each_of_its_prompts(
    server: tuple[str, Path, Path],
) -> None:
    """``/abort_request`` with an id that is no body ``rid`` names the request id: both
    prompts of a batch sent with ``X-Request-Id`` end abort with their partial output."""
    import threading

    url = server[0]
    body = {
        "input_ids": [[11, 12], [13, 14]],
        "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True},
    }
    out: dict[str, Any] = {}

    def call() -> None:
        out["r"] = httpx.post(url + "/generate", json=body, timeout=30,
                              headers={"X-Request-Id": "to-abort"})  # fmt: skip

    t = threading.Thread(target=call)
    t.start()
    deadline = time.monotonic() + 10
    while httpx.get(url + "/debug/requests/to-abort").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert httpx.post(url + "/abort_request", json={"rid": "to-abort"}).status_code == 200
    t.join(30)
    r = out["r"]
    assert r.status_code == 200 and r.headers["x-request-id"] == "to-abort"
    assert [x["meta_info"]["finish_reason"]["type"] for x in r.json()] == ["abort", "abort"]
    assert all(x["meta_info"]["completion_tokens"] < 2000 for x in r.json())


@pytest.mark.anyio
async def test_transport_extra_headers_reach_every_answer() -> None:
    """``Request.response_headers``: on a returned response, one sent with ``respond``
    (a stream), an HTTPError's, a 500's, a 404 (the app's WebSocket 101 is checked above)."""
    router = Router()

    async def events() -> Any:
        yield "one"

    async def ok(request: Request) -> Response:
        return Response(b"ok")

    async def stream(request: Request) -> Response:
        return await request.respond(SSEResponse(events()))

    async def refused(request: Request) -> Response:
        raise HTTPError(418, "no")

    async def broken(request: Request) -> Response:
        raise RuntimeError("a bug")

    for path, handler in (("/ok", ok), ("/stream", stream), ("/refused", refused),
                          ("/broken", broken)):  # fmt: skip
        router.add("GET", path, handler)

    async def app(request: Request) -> Response:
        request.response_headers = [("x-extra", request.path)]
        return await router(request)

    server = Server(app, ServerConfig(port=0, shutdown_timeout=2))
    async with anyio.create_task_group() as tg:
        bound = await tg.start(server.serve)
        base = f"http://127.0.0.1:{bound[0][1]}"
        async with httpx.AsyncClient(base_url=base) as c:
            for path, status in (("/ok", 200), ("/stream", 200), ("/refused", 418),
                                 ("/broken", 500), ("/missing", 404)):  # fmt: skip
                r = await c.get(path)
                assert (r.status_code, r.headers.get("x-extra")) == (status, path)
        await server.shutdown(2)
        tg.cancel_scope.cancel()
