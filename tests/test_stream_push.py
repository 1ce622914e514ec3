"""Streamed ``/generate`` chunks written from the worker link's wake-up (``GenerateCall.
set_push``, ``lifecycle/api/native.py`` ``_push``) while the socket takes them at once:
the same events, in the same order, as the owner task writes when it is woken for each
chunk, over an in-process server and the scripted worker (known outputs, paced steps).

The owner path is the one a request with ``X-Request-Timeout`` takes (a deadline keeps
the owner awake on its own clock, so no push is installed)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

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


def _shape(events: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """What must agree: each event's new text and ids, its index, how it ended."""
    return [(e.get("index"), e["text"], tuple(e["output_ids"]), e["meta_info"]["finish_reason"],
             e["meta_info"]["completion_tokens"]) for e in events]  # fmt: skip


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
                assert _shape(fast) == _shape(woken)
                ids = [i for e in fast if e.get("index", 0) == 0 for i in e["output_ids"]]
                assert ids == echo_ids(body)


async def test_cumulative_chunks_too() -> None:
    """Without incremental output each chunk carries everything so far, pushed or not."""
    async with running_app(worker_extra_args=STEP) as app:
        base = f"http://127.0.0.1:{app.port}"
        async with httpx.AsyncClient(base_url=base, timeout=60) as c:
            body = echo_body(3, 30)
            fast = _events(await _stream(c, body, {}))
            woken = _events(await _stream(c, body, {"X-Request-Timeout": "60"}))
    assert _shape(fast) == _shape(woken)
    assert fast[-1]["output_ids"] == echo_ids(body)
