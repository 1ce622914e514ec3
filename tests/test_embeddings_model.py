"""Embeddings with the real model (SmolLM2-135M) through the official ``openai`` client,
on the session's one real-model server (``model_server`` in conftest)."""

from __future__ import annotations

import base64
import json
import socket
import struct
import threading
import time
from typing import Any

import httpx
import openai
import pytest

pytestmark = pytest.mark.model

HIDDEN = 576  # SmolLM2-135M
TEXTS = [
    "The capital of France is Paris.",
    "A quick brown fox jumps over the lazy dog.",
    "Embeddings map text to vectors.",
    "It rained all day in Manchester.",
    "def add(a, b): return a + b",
    "The mitochondria is the powerhouse of the cell.",
    "Je pense, donc je suis.",
    "Seven plus five equals twelve.",
    "Bananas are rich in potassium.",
    "The stock market fell sharply on Monday after the announcement.",
    "Photosynthesis converts light into chemical energy.",
    "She played the violin at the concert hall.",
    "HTTP/1.1 keeps connections alive by default.",
    "Mount Everest is the highest mountain on Earth.",
    "The train to Berlin leaves at nine.",
    "A paged KV cache shares full blocks between requests with the same prefix.",
]


@pytest.fixture(scope="module")
def url(model_server: str) -> str:
    return model_server


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _dot(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def _idle(url: str, timeout: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        info = httpx.get(url + "/server_info", timeout=10).json()
        s = info["internal_states"][0]
        if (
            info["live_requests"] == 0
            and info["tombstones"] == 0
            and s["kv_blocks_free"] == s["kv_blocks_total"]
            and s["running"] == s["waiting"] == 0
        ):
            return info
        if time.monotonic() > deadline:
            raise AssertionError(f"not idle: {info}")
        time.sleep(0.05)


def test_vectors_alone_equal_those_in_a_batch_of_16(client: openai.OpenAI, url: str) -> None:
    alone = [
        client.embeddings.create(model="default", input=TEXTS[i]).data[0].embedding
        for i in (0, 9, 15)
    ]
    httpx.post(url + "/flush_cache")  # the batch computes every prefix again
    batch = client.embeddings.create(model="default", input=TEXTS)
    assert [d.index for d in batch.data] == list(range(16))
    vecs = [d.embedding for d in batch.data]
    assert all(len(v) == HIDDEN for v in vecs)
    for a, i in zip(alone, (0, 9, 15), strict=True):
        assert max(abs(x - y) for x, y in zip(a, vecs[i], strict=True)) < 1e-5, i
    assert all(abs(_dot(v, v) - 1) < 1e-5 for v in vecs)  # L2-normalised: cos = dot
    cos = [_dot(vecs[0], v) for v in vecs[1:]]
    assert max(cos) < 0.9999 and min(cos) > -1
    assert batch.usage.prompt_tokens == batch.usage.total_tokens > 16 * 5
    _idle(url)


def test_mean_and_last_pooling_differ_and_base64_is_the_same_floats(url: str) -> None:
    def post(**kw: Any) -> dict[str, Any]:
        r = httpx.post(url + "/v1/embeddings", json={"input": TEXTS[:2], **kw}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    last = [d["embedding"] for d in post()["data"]]
    mean = [d["embedding"] for d in post(pooling="mean")["data"]]
    assert all(_dot(a, b) < 0.99 for a, b in zip(last, mean, strict=True))
    for d, floats in zip(post(encoding_format="base64")["data"], last, strict=True):
        got = struct.unpack(f"<{HIDDEN}f", base64.b64decode(d["embedding"]))
        assert max(abs(x - y) for x, y in zip(got, floats, strict=True)) < 1e-5


def test_dimensions_and_bad_input_are_400s(client: openai.OpenAI, url: str) -> None:
    assert len(client.embeddings.create(model="default", input="x", dimensions=HIDDEN).data) == 1
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model="default", input="x", dimensions=64)
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "dimensions"
    r = httpx.post(url + "/v1/embeddings", json={"input": [[1, 2], "mixed"]})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "input"
    assert err["type"] == "invalid_request_error" and set(err) == {
        "message",
        "type",
        "param",
        "code",
    }


def test_generation_beside_embeddings_is_unchanged(client: openai.OpenAI, url: str) -> None:
    body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 24, "temperature": 0}}
    alone = httpx.post(url + "/generate", json=body, timeout=120).json()
    got: dict[str, Any] = {}

    def generate() -> None:
        got["g"] = httpx.post(url + "/generate", json=body, timeout=120).json()

    t = threading.Thread(target=generate)
    t.start()
    emb = client.embeddings.create(model="default", input=TEXTS * 2)
    t.join(120)
    assert got["g"]["output_ids"] == alone["output_ids"]
    assert len(emb.data) == 32
    _idle(url)


def test_a_client_that_disconnects_mid_request_leaks_nothing(url: str) -> None:
    before = _idle(url)
    long = " ".join(TEXTS) * 2  # ~400 tokens each: 16 of them take a few steps
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps({"input": [f"{i} {long}" for i in range(16)]}).encode()
    sock = socket.create_connection((host, int(port)))
    head = "POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    sock.sendall(f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)
    deadline = time.monotonic() + 30
    try:
        while True:  # until the worker holds some of them
            info = httpx.get(url + "/server_info", timeout=10).json()
            # The load counts appear with the worker's first load report.
            if info["internal_states"][0].get("running", 0) > 0:
                break
            assert time.monotonic() < deadline, info
            time.sleep(0.02)
        assert info["live_requests"] == 16
    finally:
        sock.close()
    after = _idle(url)
    # Each of the 16 ended once: done if its one step came before the close, else client_gone.
    gone = after["failed_requests"].get("client_gone", 0) - before["failed_requests"].get(
        "client_gone", 0
    )
    finished = after["finished_requests"] - before["finished_requests"]
    assert gone + finished == 16 and gone >= 8, (gone, finished)
