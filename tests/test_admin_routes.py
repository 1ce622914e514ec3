"""--open-admin-routes over real sockets: every key may use the admin routes, and a
request remembers the key that made it, so one key never aborts another's (issue 23)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import pytest

from lifecycle.cli import _build_parser
from lifecycle.option_args import option_values
from lifecycle.runtime import app_config

from .app_helpers import running_app
from .test_edge_security import KEY, KEY2


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def test_the_flag() -> None:
    closed = app_config(option_values(_build_parser().parse_args(["serve", "--api-key", KEY])))
    assert not closed.open_admin_routes
    opened = _build_parser().parse_args(["serve", "--api-key", KEY, "--open-admin-routes"])
    assert app_config(option_values(opened)).open_admin_routes


async def _next_event(lines: AsyncIterator[str]) -> dict[str, Any]:
    async for line in lines:
        if line.startswith("data: "):
            return json.loads(line[6:])  # type: ignore[no-any-return]
    raise AssertionError("the stream ended before its first event")


@pytest.mark.anyio
async def test_open_admin_routes_and_a_key_aborts_only_its_own_requests(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """--open-admin-routes lets every key use the admin routes, but a request remembers
    the key that made it: another key's abort, by rid or abort_all, leaves it running."""
    caplog.set_level(logging.INFO, logger="lifecycle.api.auth")
    long = {"input_ids": [3, 4], "rid": "first", "stream": True,
            "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}  # fmt: skip
    first, second = {"x-api-key": KEY}, {"authorization": f"Bearer {KEY2}"}
    slow = ("--step-delay", "0.005")  # a token per 5 ms: the request outlives the aborts
    async with running_app(
        api_keys=(KEY, KEY2), open_admin_routes=True, worker_extra_args=slow
    ) as app:
        base = f"http://127.0.0.1:{app.port}"
        async with httpx.AsyncClient(base_url=base, timeout=30) as c:
            assert (await c.get("/debug/requests", headers=second)).status_code == 200
            async with c.stream("POST", "/generate", json=long, headers=first) as stream:
                lines = stream.aiter_lines()
                await _next_event(lines)
                for body in ({"rid": "first"}, {"abort_all": True}):
                    r = await c.post("/abort_request", json=body, headers=second)
                    assert r.status_code == 200
                for _ in range(20):  # ~0.1 s more of tokens: an aborted call ends at once
                    assert (await _next_event(lines))["meta_info"]["finish_reason"] is None
                assert len(app.frontend.calls) == 1
                r = await c.post("/abort_request", json={"rid": "first"}, headers=first)
                assert r.status_code == 200
                events = [line[6:] async for line in lines if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            meta = json.loads(events[-2])["meta_info"]  # ended by its own key's abort
            assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 2000
    assert "open to every API key (--open-admin-routes)" in caplog.text


async def _abort_own_queued(
    app: Any, c: httpx.AsyncClient, requests: list[tuple[str, dict[str, Any]]], ws_body: Any
) -> tuple[dict[str, httpx.Response], dict[str, Any]]:
    """Send ``requests`` and a WebSocket generation with the first key while the second
    key's generation holds the credit; once all are live, abort all of the first key's;
    their replies and the WebSocket's terminal message."""
    from websockets.asyncio.client import connect

    replies: dict[str, httpx.Response] = {}

    async def post(path: str, body: dict[str, Any]) -> None:
        replies[path] = await c.post(path, json=body, headers={"x-api-key": KEY})

    ws_url = f"ws://127.0.0.1:{app.port}/v1/stream"
    async with connect(ws_url, additional_headers={"x-api-key": KEY}) as ws:
        async with anyio.create_task_group() as tg:
            for path, body in requests:
                tg.start_soon(post, path, body)
            await ws.send(json.dumps({"type": "generate", "id": "w", "body": ws_body}))
            while len(app.frontend.calls) < 1 + len(requests) + 1:
                await anyio.sleep(0.01)
            r = await c.post("/abort_request", json={"abort_all": True}, headers={"x-api-key": KEY})
            assert r.status_code == 200
            ws_end = json.loads(await ws.recv())
    return replies, ws_end


@pytest.mark.anyio
async def test_every_entry_point_records_its_owner() -> None:
    """Every face makes its calls through ``Frontend.call`` with the request's key as the
    owner (issue 38): a key's ``abort_all`` ends its requests on /generate, both OpenAI
    completions routes, /v1/responses, /v1/score, /v1/embeddings and the WebSocket, and
    leaves another key's running. One worker credit, held by the other key's long
    generation, keeps them all queued in the frontend until the abort."""
    second = {"x-api-key": KEY2}
    blocker = {"input_ids": [3, 4], "rid": "blocker", "stream": True,
               "sampling_params": {"max_new_tokens": 5000, "ignore_eos": True}}  # fmt: skip
    short = {"max_new_tokens": 4, "ignore_eos": True}
    requests = [
        ("/generate", {"input_ids": [5, 6], "sampling_params": short}),
        ("/v1/completions", {"model": "m", "prompt": [5, 6], "max_tokens": 4}),
        ("/v1/chat/completions",
         {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
        ("/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 4}),
        ("/v1/score", {"query": [5, 6, 7], "items": [[8]], "label_token_ids": [11, 12]}),
        ("/v1/embeddings", {"model": "m", "input": [[5, 6, 7]]}),
    ]  # fmt: skip
    ws_body = {"input_ids": [5, 6], "sampling_params": short}
    async with running_app(
        api_keys=(KEY, KEY2), open_admin_routes=True, max_pending=1,
        worker_extra_args=("--step-delay", "0.005"),
    ) as app:  # fmt: skip
        base = f"http://127.0.0.1:{app.port}"
        async with httpx.AsyncClient(base_url=base, timeout=30) as c:
            async with c.stream("POST", "/generate", json=blocker, headers=second) as held:
                lines = held.aiter_lines()
                await _next_event(lines)  # it runs: the only credit is taken
                # a call the abort missed would wait for the 25 s blocker: fail before
                with anyio.fail_after(15):
                    replies, ws_end = await _abort_own_queued(app, c, requests, ws_body)
                assert len(app.frontend.calls) == 1  # the other key's generation runs on
                assert (await _next_event(lines))["meta_info"]["finish_reason"] is None
                await c.post("/abort_request", json={"rid": "blocker"}, headers=second)
    finishes = {
        "/generate": replies["/generate"].json()["meta_info"]["finish_reason"]["type"],
        "/v1/completions": replies["/v1/completions"].json()["choices"][0]["finish_reason"],
        "/v1/chat/completions":
            replies["/v1/chat/completions"].json()["choices"][0]["finish_reason"],
        "/v1/responses": replies["/v1/responses"].json()["status"],
        "/v1/score": replies["/v1/score"].json()["error"]["code"],
        "/v1/embeddings": replies["/v1/embeddings"].json()["error"]["code"],
        "ws": ws_end["meta_info"]["finish_reason"]["type"],
    }  # fmt: skip
    assert finishes == {"/generate": "abort", "/v1/completions": "abort",
                        "/v1/chat/completions": "abort", "/v1/responses": "cancelled",
                        "/v1/score": "aborted", "/v1/embeddings": "aborted",
                        "ws": "abort"}, finishes  # fmt: skip
