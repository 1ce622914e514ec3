"""Streamed ``/generate`` chunks written from the worker link's wake-up (``GenerateCall.
set_push``, ``lifecycle/api/native.py`` ``_push``) while the socket takes them at once:
the same output, in the same order, as the owner task writes when it is woken for each
chunk, over an in-process server and the scripted worker (known outputs, paced steps).
Where the frames are cut is timing: an owner woken late (a loaded machine, a step of
5 ms) writes every step since in one frame, so the streams are compared joined.

The owner path is the one a request with ``X-Request-Timeout`` takes (a deadline keeps
the owner awake on its own clock, so no push is installed)."""

from __future__ import annotations

import itertools
import json
import logging
import socket
import time
from typing import Any

import anyio
import h11
import httpx
import orjson
import pytest
from anyio.abc import SocketAttribute

from lifecycle.api import native
from lifecycle.core.call import GenerateCall

from .app_helpers import running_app
from .ws_helpers import echo_body, echo_ids

pytestmark = pytest.mark.anyio
STEP = ("--step-delay", "0.005")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _events(body: bytes) -> list[dict[str, Any]]:
    out = []
    for line in body.decode().split("\n"):
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    assert body.rstrip().endswith(b"data: [DONE]")
    return out


def _by_index(events: list[dict[str, Any]], incremental: bool) -> dict[Any, dict[str, Any]]:
    """Each sample's whole output (``_whole``), keyed by its index (None without ``n``)."""
    keys = list(dict.fromkeys(e.get("index") for e in events))
    return {k: _whole([e for e in events if e.get("index") == k], incremental) for k in keys}


async def _stream(c: httpx.AsyncClient, body: dict[str, Any], headers: dict[str, str]) -> bytes:
    r = await c.post("/generate", json={**body, "stream": True}, headers=headers)
    assert r.status_code == 200, r.text
    return r.content


async def test_pushed_chunks_are_the_owners_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    pushed = []
    made = native._push

    def counting(call: GenerateCall, gate: Any, incremental: bool) -> Any:
        push = made(call, gate, incremental)

        def counted() -> bool:
            done = push()
            pushed.append(done)
            return done

        return counted

    monkeypatch.setattr(native, "_push", counting)
    bodies = [
        echo_body(1, 40),  # one sample
        {**echo_body(2, 25), "sampling_params": {"max_new_tokens": 25, "n": 2}},  # indexed
    ]
    async with running_app(worker_extra_args=STEP, incremental_streaming_output=True) as app:
        base = f"http://127.0.0.1:{app.port}"
        async with httpx.AsyncClient(base_url=base, timeout=60) as c:
            for body in bodies:
                pushed.clear()
                fast = _events(await _stream(c, body, {}))
                assert pushed.count(True) >= 10, pushed  # most chunks never woke the owner
                assert False in pushed  # the end: declined, the owner writes it
                pushed.clear()
                woken = _events(await _stream(c, body, {"X-Request-Timeout": "60"}))
                assert not pushed  # a deadline: no push installed
                whole = _by_index(fast, incremental=True)
                assert whole == _by_index(woken, incremental=True)
                first = whole[0 if "index" in fast[0] else None]
                assert first["output_ids"] == echo_ids(body)


async def test_cumulative_chunks_too() -> None:
    """Without incremental output each chunk carries everything so far, pushed or not."""
    async with running_app(worker_extra_args=STEP) as app:
        base = f"http://127.0.0.1:{app.port}"
        async with httpx.AsyncClient(base_url=base, timeout=60) as c:
            body = echo_body(3, 30)
            fast = _events(await _stream(c, body, {}))
            woken = _events(await _stream(c, body, {"X-Request-Timeout": "60"}))
    whole = _whole(fast, incremental=False)
    assert whole == _whole(woken, incremental=False)
    assert whole["output_ids"] == echo_ids(body)


def _small_send_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's accepted sockets get a 4 KiB send buffer (inherited from the
    listener; no autotuning), so a client that pauses fills it within a few chunks."""
    real = anyio.create_tcp_listener

    async def small(*args: Any, **kwargs: Any) -> Any:
        listener = await real(*args, **kwargs)
        for sub in listener.listeners:
            sub.extra(SocketAttribute.raw_socket).setsockopt(
                socket.SOL_SOCKET, socket.SO_SNDBUF, 4096
            )
        return listener

    monkeypatch.setattr(anyio, "create_tcp_listener", small)


def _read_in_bursts(port: int, body: dict[str, Any], headers: dict[str, str]) -> bytes:
    """POST a stream and read it through a 4 KiB receive buffer: 16 reads at once, then
    a 30 ms pause, and so on to the end (a reader alternately fast and stopped). Returns
    the response body (chunked transfer decoded); fails on an unterminated body."""
    data = orjson.dumps({**body, "stream": True})
    extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    head = (f"POST /generate HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\nconnection: close\r\n{extra}\r\n")  # fmt: skip
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as client:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect
        client.settimeout(30)
        client.connect(("127.0.0.1", port))
        client.sendall(head.encode() + data)
        raw = bytearray()
        reads = 0
        while chunk := client.recv(4096):
            raw += chunk
            reads += 1
            if reads % 16 == 0:
                time.sleep(0.03)
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="POST", target="/generate", headers=[("host", "t")]))
    conn.receive_data(bytes(raw))
    conn.receive_data(b"")
    out = bytearray()
    while not isinstance(event := conn.next_event(), h11.EndOfMessage):
        assert event is not h11.NEED_DATA, f"the body was not terminated: {bytes(out[-200:])!r}"
        if isinstance(event, h11.Response):
            assert event.status_code == 200, raw[:300]
        elif isinstance(event, h11.Data):
            out += event.data
    return bytes(out)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
async def test_the_push_waits_for_a_socket_that_stops_taking(
    incremental: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 54, point 6: a push asks the socket before it polls output. Through 4 KiB
    buffers and a reader that alternately reads and pauses, frames with top-20 logprobs
    fill the socket every few chunks: the push must decline there (the owner writes when
    the socket drains) and never poll output it cannot write. Every token reaches the
    client once, in order, as the owner path delivers it, and nothing fails on the way
    (a push that fails is logged and the owner takes over for good: without the check,
    the first full socket did that)."""
    _small_send_buffers(monkeypatch)
    declined: list[bool] = []
    made = native._push

    def watched(call: GenerateCall, gate: Any, incremental: bool) -> Any:
        push = made(call, gate, incremental)

        def counted() -> bool:
            if not gate.ready_now():
                declined.append(True)
            return push()

        return counted

    monkeypatch.setattr(native, "_push", watched)
    body = {**echo_body(4, 300), "return_logprob": True, "top_logprobs_num": 20}
    async with running_app(
        worker_extra_args=("--step-delay", "0.002"), incremental_streaming_output=incremental
    ) as app:
        pushed = _events(await anyio.to_thread.run_sync(_read_in_bursts, app.port, body, {}))
        owner = _events(
            await anyio.to_thread.run_sync(
                _read_in_bursts, app.port, body, {"X-Request-Timeout": "60"}
            )
        )
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors
    assert len(declined) >= 3, "the socket should have been full at some pushes"
    whole = _whole(pushed, incremental)
    assert whole == _whole(owner, incremental)
    assert whole["output_ids"] == echo_ids(body)
    assert whole["finish_reason"] == {"type": "length", "length": 300}


def _whole(events: list[dict[str, Any]], incremental: bool) -> dict[str, Any]:
    """The output a stream delivered, however its frames were cut (a frame written late
    carries every step since): incremental frames joined, each counting the tokens so
    far; cumulative frames each checked to be the final output cut after its tokens,
    growing, and the last taken."""
    if incremental:
        parts = [(e["text"], e["output_ids"], e["meta_info"].get("output_token_logprobs", []),
                  e["meta_info"].get("output_top_logprobs", [])) for e in events]  # fmt: skip
        text = "".join(p[0] for p in parts)
        ids = [i for p in parts for i in p[1]]
        counts = [e["meta_info"]["completion_tokens"] for e in events]
        assert counts == list(itertools.accumulate(len(p[1]) for p in parts))
        logprobs = [x for p in parts for x in p[2]]
        top = [x for p in parts for x in p[3]]
    else:
        last = events[-1]
        text, ids = last["text"], last["output_ids"]
        logprobs = last["meta_info"].get("output_token_logprobs", [])
        top = last["meta_info"].get("output_top_logprobs", [])
        seen = 0
        for e in events:
            n = len(e["output_ids"])
            assert n > seen and e["output_ids"] == ids[:n]
            assert e["meta_info"]["completion_tokens"] == n
            assert e["meta_info"].get("output_token_logprobs", []) == logprobs[:n]
            assert text.startswith(e["text"])
            seen = n
    assert events[-1]["meta_info"]["completion_tokens"] == len(ids)
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    return {"text": text, "output_ids": ids, "logprobs": logprobs, "top": top,
            "finish_reason": events[-1]["meta_info"]["finish_reason"]}  # fmt: skip
