"""WebSocket streaming (``/v1/stream``) end to end: the ``websockets`` client against a real
server process driving the scripted worker (outputs echo the prompt ids)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import anyio
import cbor2
import httpx
import pytest
from websockets.asyncio.client import connect

from .scripted import lifecycle_server, without_model_label
from .ws_helpers import (
    Collected,
    SilentClient,
    collect,
    echo_body,
    echo_ids,
    gen_msg,
    server_info,
    server_process,
    wait_idle,
    worker_load,
)

pytestmark = pytest.mark.anyio

SERVER_ARGS = (
    "--scripted-worker",
    "--max-pending",
    "64",
    "--max-running",
    "64",
    "--worker-args",
    "--step-delay 0.02",
    "--send-timeout",
    "3",
)


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with lifecycle_server(*SERVER_ARGS) as base:
        yield base


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the websockets client is asyncio-only


def ws_url(url: str, query: str = "") -> str:
    return url.replace("http://", "ws://") + "/v1/stream" + query


async def test_sixteen_concurrent_generations_each_get_their_own_tokens(url: str) -> None:
    bodies = {f"g{i}": echo_body(i, 12 + i) for i in range(16)}
    async with connect(ws_url(url)) as ws:
        for mid, body in bodies.items():
            await ws.send(gen_msg(mid, body))
        got = await collect(ws, 16)
    from concurrent.futures import ThreadPoolExecutor

    def post(body: dict[str, Any]) -> dict[str, Any]:
        return httpx.post(url + "/generate", json=body, timeout=30).json()

    with ThreadPoolExecutor(16) as pool:  # the unary twins side by side, as the streams ran
        unaries = dict(zip(bodies, pool.map(post, bodies.values()), strict=True))
    for mid, body in bodies.items():
        final = got.final[mid]
        assert final["type"] == "done", final
        assert got.ids(mid) == echo_ids(body)
        unary = unaries[mid]
        assert got.ids(mid) == unary["output_ids"]
        assert got.text(mid) == unary["text"]
        assert final["meta_info"]["finish_reason"] == {
            "type": "length",
            "length": len(unary["output_ids"]),
        }
        assert final["meta_info"]["completion_tokens"] == len(unary["output_ids"])
    wait_idle(url)


async def test_cbor_by_subprotocol_and_by_query(url: str) -> None:
    body = echo_body(1, 6)
    async with connect(ws_url(url), subprotocols=["lifecycle.cbor"]) as ws:  # type: ignore[list-item]
        assert ws.subprotocol == "lifecycle.cbor"
        await ws.send(cbor2.dumps({"type": "generate", "id": 7, "body": body}))
        got = Collected()
        while 7 not in got.final:
            raw = await ws.recv()
            assert isinstance(raw, bytes)  # binary frames, CBOR inside
            got.add(raw)
    assert got.final[7]["type"] == "done" and got.ids(7) == echo_ids(body)
    async with connect(ws_url(url, "?format=cbor")) as ws:
        await ws.send(cbor2.dumps({"type": "generate", "id": "q", "body": body}))
        raw = await ws.recv()
        assert isinstance(raw, bytes) and cbor2.loads(raw)["id"] == "q"
    async with connect(ws_url(url), subprotocols=["lifecycle.json"]) as ws:  # type: ignore[list-item]
        assert ws.subprotocol == "lifecycle.json"
        await ws.send(gen_msg("j", body))
        assert isinstance(await ws.recv(), str)


async def test_cancel_one_leaves_the_others_and_releases_its_slot(url: str) -> None:
    wait_idle(url)
    long = {f"c{i}": echo_body(i, 150) for i in range(4)}  # ~3 s each at 20 ms a step
    async with connect(ws_url(url)) as ws:
        for mid, body in long.items():
            await ws.send(gen_msg(mid, body))
        got = Collected()
        while len(got.deltas["c0"]) < 3:
            got.add(await ws.recv())
        assert worker_load(url) == 4
        await ws.send(json.dumps({"type": "cancel", "id": "c0"}))
        while "c0" not in got.final:
            got.add(await ws.recv())
        assert got.final["c0"]["error"]["type"] == "aborted"
        deadline = time.monotonic() + 2
        while worker_load(url) != 3:  # released while the others still run
            assert time.monotonic() < deadline, server_info(url)
            await anyio.sleep(0.02)
        assert server_info(url)["live_requests"] == 3
        await ws.send(json.dumps({"type": "cancel", "id": "c0"}))  # already ended: ignored
        await collect(ws, 4, got)
    for mid in ("c1", "c2", "c3"):
        assert got.final[mid]["type"] == "done"
        assert got.ids(mid) == echo_ids(long[mid])
    assert got.ids("c0") == echo_ids(long["c0"])[: len(got.ids("c0"))]
    wait_idle(url)


async def test_closing_the_socket_mid_stream_releases_every_slot(url: str) -> None:
    wait_idle(url)
    async with connect(ws_url(url)) as ws:
        for i in range(8):
            await ws.send(gen_msg(i, echo_body(i, 300)))
        got = Collected()
        while sum(len(v) for v in got.deltas.values()) < 16:
            got.add(await ws.recv())
        assert worker_load(url) == 8
    info = wait_idle(url, timeout=5)
    assert info["live_requests"] == 0


async def test_protocol_errors_are_tagged_and_the_socket_survives(url: str) -> None:
    async with connect(ws_url(url)) as ws:
        await ws.send("{not json")
        m = json.loads(await ws.recv())
        assert m["type"] == "error" and m["id"] is None and m["error"]["code"] == 400
        await ws.send(json.dumps({"type": "generate", "id": [1], "body": {}}))
        assert "id must be" in json.loads(await ws.recv())["error"]["message"]
        await ws.send(gen_msg("bad", {"text": "x", "sampling_params": {"top_p": -1}}))
        m = json.loads(await ws.recv())
        assert m == {"type": "error", "id": "bad", **m} and "top_p" in m["error"]["message"]
        await ws.send(gen_msg("d", echo_body(0, 100)))
        await ws.send(gen_msg("d", echo_body(1, 5)))  # the same id while live
        got = Collected()
        while "d" not in got.final:
            got.add(await ws.recv())
        assert got.final["d"]["type"] == "error" and "already streaming" in str(got.final["d"])
        got.final.clear()
        await collect(ws, 1, got)  # the first "d" still completes
        assert got.final["d"]["type"] == "done" and got.ids("d") == echo_ids(echo_body(0, 100))
        await ws.send(gen_msg("d", echo_body(2, 3)))  # reusable once it ended
        again = await collect(ws, 1)
        assert again.ids("d") == echo_ids(echo_body(2, 3))


async def test_abort_request_api_reaches_websocket_generations(url: str) -> None:
    wait_idle(url)
    body = {**echo_body(3, 400), "rid": "ws-abort-me"}
    async with connect(ws_url(url)) as ws:
        await ws.send(gen_msg("a", body))
        got = Collected()
        while not got.deltas["a"]:
            got.add(await ws.recv())
        r = httpx.post(url + "/abort_request", json={"rid": "ws-abort-me"}, timeout=10)
        assert r.status_code == 200
        await collect(ws, 1, got)
    final = got.final["a"]
    assert final["type"] == "done" and final["meta_info"]["finish_reason"]["type"] == "abort"
    wait_idle(url)


# -- a client that stops reading ------------------------------------------------------------
LONG_TOKENS = [1725, 2546, 2908, 3036, 3113, 3355, 3571, 3720]  # " understanding", ...
STALL_ARGS = (
    "--scripted-worker",
    "--max-pending",
    "64",
    "--max-running",
    "64",
    "--max-queued",
    "128",
    "--send-timeout",
    "6",
    # One step per write, as a model's steps come: the frontend then sends small deltas,
    # whose ~10 MB the kernel buffers cannot hold (bursts coalesce them into far fewer).
    "--worker-args",
    "--burst 1",
)


@pytest.fixture(scope="module")
def fast_url() -> Iterator[str]:
    with lifecycle_server(*STALL_ARGS) as base:
        yield base


def _metric(url: str, line_start: str) -> float:
    """The value of the sample whose line starts with ``line_start``, its model's
    ``model_name`` label left out."""
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if without_model_label(line).startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_a_stopped_reader_is_bounded_and_cut_and_others_go_on(fast_url: str) -> None:
    url = fast_url
    proc = server_process(url)
    async with connect(ws_url(url)) as warm:  # settle the server's memory first
        await warm.send(gen_msg(0, echo_body(0, 2000)))
        await collect(warm, 1)
    wait_idle(url)
    rss0 = proc.memory_info().rss
    stalled0 = _metric(url, 'lifecycle_request_errors_total{cause="client_stalled"}')
    done0 = _metric(url, 'lifecycle_requests_total{outcome="done"}')
    streams, max_new = 64, 8000
    # Tokens of 14 characters: ~10 MB of deltas in all, more than the kernel buffers hold,
    # so the server's sends block. Had it queued a message per token it would hold 512k
    # messages (~128 MB); it holds each stream's output ids, bounded by max_new_tokens.
    long_body = {"input_ids": LONG_TOKENS, "sampling_params": {"max_new_tokens": max_new}}
    silent = SilentClient("127.0.0.1", int(url.rsplit(":", 1)[1]), "/v1/stream")
    try:
        for i in range(streams):
            silent.send_text(gen_msg(i, long_body))
        peak = rss0
        t0 = time.monotonic()
        async with connect(ws_url(url)) as other:  # meanwhile another socket streams freely
            await other.send(gen_msg("o", echo_body(40, 50)))
            got = await collect(other, 1)
            assert got.final["o"]["type"] == "done" and got.ids("o") == echo_ids(echo_body(40, 50))
        # It finished while the stalled socket's streams were still held (not after the cut).
        assert server_info(url)["live_requests"] > 0
        while server_info(url)["live_requests"]:  # cut after send_timeout (6 s) of no progress
            peak = max(peak, proc.memory_info().rss)
            assert time.monotonic() - t0 < 30
            await anyio.sleep(0.05)
    finally:
        silent.close()
    wait_idle(url, timeout=5)
    assert peak - rss0 < 64 * 2**20, f"server grew {(peak - rss0) / 2**20:.1f} MiB"
    stalled = _metric(url, 'lifecycle_request_errors_total{cause="client_stalled"}') - stalled0
    done = _metric(url, 'lifecycle_requests_total{outcome="done"}') - done0
    # Most streams were cut mid-way; one whose whole output fit in the socket buffers is done.
    assert stalled >= streams // 2 and stalled + done == streams + 1, (stalled, done)


async def test_a_paused_reader_gets_fewer_larger_deltas_and_no_gap(fast_url: str) -> None:
    url = fast_url
    bodies = {i: {"input_ids": LONG_TOKENS[i % 4 :], "sampling_params": {"max_new_tokens": 8000}}
              for i in range(16)}  # fmt: skip
    silent = SilentClient("127.0.0.1", int(url.rsplit(":", 1)[1]), "/v1/stream")
    try:
        for mid, body in bodies.items():
            silent.send_text(gen_msg(mid, body))
        await anyio.sleep(1.5)  # below send_timeout: the sends wait, the buffers coalesce
        got = Collected()
        for raw in silent.read_messages():
            got.add(raw)
            if len(got.final) == len(bodies):
                break
    finally:
        silent.close()
    for mid, body in bodies.items():
        assert got.final[mid]["type"] == "done"
        assert got.ids(mid) == echo_ids(body)
        assert len(got.deltas[mid]) < 8000
    wait_idle(url)


async def test_batch_and_n_samples_are_indexed_like_generate(url: str) -> None:
    body = {
        "input_ids": [[101, 102, 103], [201, 202]],
        "sampling_params": {"max_new_tokens": 5, "n": 2},
    }
    unary = httpx.post(url + "/generate", json=body, timeout=30).json()
    assert len(unary) == 4
    async with connect(ws_url(url)) as ws:
        await ws.send(gen_msg("b", body))
        got = await collect(ws, 1)
    by_index: dict[int, list[int]] = {}
    for d in got.deltas["b"]:
        by_index.setdefault(d["index"], []).extend(d["output_ids"])
    assert [by_index[i] for i in range(4)] == [u["output_ids"] for u in unary]
    metas = got.final["b"]["meta_info"]
    assert [m["finish_reason"] for m in metas] == [u["meta_info"]["finish_reason"] for u in unary]


async def test_openai_style_bodies_stream_like_their_http_routes(url: str) -> None:
    completion = {"model": "default", "prompt": "hello there", "max_tokens": 5, "stream": True}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    async with connect(ws_url(url)) as ws:
        await ws.send(json.dumps({"type": "completions", "id": "c", "body": completion}))
        await ws.send(json.dumps({"type": "chat", "id": "h", "body": chat}))
        await ws.send(json.dumps({"type": "chat", "id": "bad", "body": {"messages": []}}))
        got = await collect(ws, 3)
    assert got.final["c"]["type"] == "done" and len(got.ids("c")) == 5
    unary = httpx.post(url + "/v1/completions", json={**completion, "stream": False}, timeout=30)
    assert got.text("c") == unary.json()["choices"][0]["text"]
    assert got.final["h"]["type"] == "done" and len(got.ids("h")) == 3
    reply = httpx.post(url + "/v1/chat/completions", json=chat, timeout=30).json()
    assert got.text("h") == reply["choices"][0]["message"]["content"]
    assert got.final["bad"]["type"] == "error"
    assert got.final["bad"]["error"]["message"] == "messages must be a non-empty list."
    wait_idle(url)
