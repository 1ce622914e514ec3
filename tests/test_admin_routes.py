"""--open-admin-routes over real sockets: every key may use the admin routes, and a
request remembers the key that made it, so one key never aborts another's (issue 23)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from lifecycle.cli import _build_parser
from lifecycle.options import app_config, option_values

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
