"""The frontend's one event feed (``lifecycle.core.events``): every watcher subscribes
once, with the hooks it has; over a real server and the scripted worker a subscriber sees
a request opened, its edges in order, its call closed once terminal and its hold
released, and a subscriber that raises costs the request nothing."""

from __future__ import annotations

from typing import Any

import anyio
import httpx
import pytest

from .app_helpers import running_app


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class _Recorder:
    def __init__(self) -> None:
        self.seen: list[tuple[str, Any]] = []

    def opened(self, call: Any) -> None:
        self.seen.append(("opened", call.request_id))

    def transition(self, rec: Any, entry: Any) -> None:
        self.seen.append(("transition", entry[2].value))

    def released(self, rec: Any) -> None:
        self.seen.append(("released", rec.request_id))

    def closed(self, call: Any) -> None:
        self.seen.append(("closed", call.request_id))


class _Broken:
    def opened(self, call: Any) -> None:
        raise RuntimeError("a subscriber's bug")

    closed = opened


@pytest.mark.anyio
async def test_one_feed_in_order_and_a_broken_subscriber_costs_nothing() -> None:
    async with running_app() as app:
        rec = _Recorder()
        app.frontend.events.subscribe(_Broken())
        app.frontend.events.subscribe(rec)
        body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3}}
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.port}") as c:
            r = await c.post("/generate", json=body, headers={"x-request-id": "ev-1"})
            assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 3
        with anyio.fail_after(5):  # the worker's release of the hold follows its end
            while ("released", "ev-1") not in rec.seen:
                await anyio.sleep(0.01)
        kinds = [k for k, _ in rec.seen]
        assert kinds[0] == "opened" and ("closed", "ev-1") in rec.seen
        edges = [v for k, v in rec.seen if k == "transition"]
        assert edges == ["validated", "queued", "running", "streaming", "done"], edges
        closed_at = rec.seen.index(("closed", "ev-1"))
        assert kinds.index("transition") < closed_at  # closed only once terminal
        assert rec.seen.index(("transition", "done")) < closed_at
