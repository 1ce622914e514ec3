"""WebSocket streaming with the real worker and the real model (SmolLM2-135M): 16 concurrent
greedy generations on one socket each get exactly the tokens ``POST /generate`` gives."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from websockets.asyncio.client import connect

from .scripted import lifecycle_server
from .ws_helpers import collect, gen_msg, wait_idle

pytestmark = [pytest.mark.model, pytest.mark.anyio]

SUBJECTS = (
    "France", "Japan", "Brazil", "Canada", "Egypt", "Norway", "India", "Mexico",
    "Kenya", "Spain", "Peru", "Italy", "Chile", "Greece", "Poland", "Turkey",
)  # fmt: skip


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with lifecycle_server(
        "--device",
        "cpu",
        "--max-running",
        "16",
        "--kv-cache-tokens",
        "8192",
        "--weights",
        "fp32",  # streams are compared across batch shapes: fp32-exact
    ) as base:
        yield base


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_sixteen_greedy_streams_on_one_socket_equal_http(url: str) -> None:
    bodies = {
        f"s{i}": {
            "text": f"The capital of {country} is",
            "sampling_params": {"max_new_tokens": 8, "temperature": 0},
        }
        for i, country in enumerate(SUBJECTS)
    }
    async with connect(url.replace("http", "ws") + "/v1/stream") as ws:
        for mid, body in bodies.items():
            await ws.send(gen_msg(mid, body))
        got = await collect(ws, len(bodies))
    outputs = set()
    for mid, body in bodies.items():
        assert got.final[mid]["type"] == "done", got.final[mid]
        unary = httpx.post(url + "/generate", json=body, timeout=120).json()
        assert got.ids(mid) == unary["output_ids"], mid
        assert got.text(mid) == unary["text"], mid
        outputs.add(tuple(unary["output_ids"]))
    assert len(outputs) > 8  # different prompts, different continuations: no mix-up hidden
    wait_idle(url, timeout=20)
