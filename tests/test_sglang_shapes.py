"""Issue 40, SGLang's shapes where the model's output does not matter: one real server
(``--dp 2`` scripted workers, real sockets) for ``/detokenize``'s ``text`` and batches,
``/flush_cache`` and ``/health_generate`` on every worker (the router forgetting its
prefixes), ``/get_load``, ``meta_info.weight_version`` and the CORS option."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest

from .scripted import lifecycle_server

ORIGIN = "http://app.example"


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    # steps of 5 ms: a long stream stays in flight while /get_load looks
    with lifecycle_server("--scripted-worker", "--dp", "2", "--router-policy", "cache_aware",
                          "--worker-args", "--step-delay 0.005",
                          "--weight-version", "v7", "--cors-allow-origins",
                          f"{ORIGIN},http://other.example") as base:  # fmt: skip
        yield base


def _info(url: str) -> dict:
    return httpx.get(url + "/server_info", timeout=10).json()


def _tokens(url: str, text: str) -> list[int]:
    r = httpx.post(url + "/tokenize", json={"prompt": text, "add_special_tokens": False})
    return r.json()["tokens"]


def test_detokenize_answers_text_and_takes_a_list_of_lists(url: str) -> None:
    a, b = _tokens(url, "Hello world"), _tokens(url, "Good night")
    for prefix in ("", "/v1"):
        one = httpx.post(url + prefix + "/detokenize", json={"tokens": a})
        assert one.status_code == 200 and one.json() == {"text": "Hello world"}
        many = httpx.post(url + prefix + "/detokenize", json={"tokens": [a, b, []]})
        assert many.json() == {"text": ["Hello world", "Good night", ""]}
    for bad in ([a, 5], [[-1]], [["x"]], "abc"):
        r = httpx.post(url + "/detokenize", json={"tokens": bad})
        assert r.status_code == 400 and "tokens must be" in r.json()["error"]["message"], bad


def _family(k: int, j: int) -> list[int]:
    """Prompt ``j`` of family ``k``: a 64-token prefix of its own, then a tail."""
    return [1000 + 97 * k + t for t in range(64)] + [5000 + j, 6000 + j]


def _generate(url: str, ids: list[int]) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}}
    r = httpx.post(url + "/generate", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_flush_reaches_every_worker_and_the_router_forgets_its_prefixes(url: str) -> None:
    for j in range(2):
        for k in range(2):
            _generate(url, _family(k, j))
    router = _info(url)["router"]
    assert router["indexed_blocks"] >= 8 and router["affinity_hits"] >= 2, router
    r = httpx.post(url + "/flush_cache", timeout=30)
    assert r.status_code == 200, r.text
    lines = r.text.splitlines()
    assert lines[0] == "Cache flushed." and lines[1:] == [  # each worker answered
        "worker 0: Cache flushed.", "worker 1: Cache flushed."]  # fmt: skip
    after = _info(url)["router"]
    assert after["indexed_blocks"] == 0, after
    _generate(url, _family(0, 9))  # a known prefix no longer draws it anywhere
    assert _info(url)["router"]["affinity_hits"] == after["affinity_hits"]


def test_health_generate_probes_every_worker(url: str) -> None:
    def steps() -> list[int]:
        return [s["worker_load"]["steps"] for s in _info(url)["internal_states"]]

    before = steps()
    r = httpx.get(url + "/health_generate", timeout=30)
    assert r.status_code == 200, r.text
    after = steps()
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)


def test_get_load_has_sglangs_shape_per_worker(url: str) -> None:
    r = httpx.get(url + "/get_load", timeout=10)
    assert r.status_code == 200
    load = r.json()
    assert [w["dp_rank"] for w in load] == [0, 1]
    keys = {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens", "num_pending_tokens",
            "ts_tic"}  # fmt: skip
    for w in load:
        assert set(w) == keys and w["num_reqs"] == 0 and w["ts_tic"] > 1.7e9, w
    # a long stream holds a request on one worker, and its KV blocks
    body = {"input_ids": list(range(100, 140)), "stream": True,
            "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}  # fmt: skip
    with httpx.stream("POST", url + "/generate", json=body, timeout=30) as s:
        lines = s.iter_lines()
        for _ in range(3):
            next(lines)
        deadline = time.monotonic() + 5
        while True:  # the worker's books catch up with its first token
            busy = httpx.get(url + "/get_load").json()
            if sum(w["num_reqs"] for w in busy) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        httpx.post(url + "/abort_request", json={"abort_all": True})
    assert sorted(w["num_reqs"] for w in busy) == [0, 1], busy
    assert max(w["num_tokens"] for w in busy) >= 40, busy


def test_generate_meta_info_carries_the_weight_version(url: str) -> None:
    out = _generate(url, [5, 6, 7])
    assert out["meta_info"]["weight_version"] == "v7"
    body = {"input_ids": [5, 6, 7], "stream": True, "sampling_params": {"max_new_tokens": 3}}
    with httpx.stream("POST", url + "/generate", json=body, timeout=30) as s:
        frames = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    assert frames and all(f["meta_info"]["weight_version"] == "v7" for f in frames)
    assert httpx.get(url + "/model_info").json()["weight_version"] == "v7"
    # a generation on the WebSocket: the same meta_info builder, the same field
    from websockets.sync.client import connect

    with connect(url.replace("http://", "ws://") + "/v1/stream") as ws:
        ws.send(json.dumps({"type": "generate", "id": "w", "body": body}))
        events = []
        while not events or events[-1]["type"] == "delta":
            events.append(json.loads(ws.recv()))
    assert events[-1]["type"] == "done", events[-1]
    assert all(e["meta_info"]["weight_version"] == "v7" for e in events)


def test_cors_preflight_and_allow_origin_for_the_origins_named(url: str) -> None:
    pre = httpx.options(url + "/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})  # fmt: skip
    assert pre.status_code == 204
    assert pre.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert pre.headers["access-control-allow-headers"] == "authorization, content-type"
    unary = httpx.get(url + "/v1/models", headers={"Origin": ORIGIN})
    assert unary.headers["access-control-allow-origin"] == ORIGIN
    assert unary.headers["access-control-expose-headers"] == "X-Request-Id"
    assert unary.headers["x-request-id"]
    body = {"input_ids": [5, 6], "stream": True, "sampling_params": {"max_new_tokens": 2}}
    with httpx.stream("POST", url + "/generate", json=body,
                      headers={"Origin": "http://other.example"}) as s:  # fmt: skip
        assert s.headers["access-control-allow-origin"] == "http://other.example"
        s.read()
    missing = httpx.get(url + "/no/such/route", headers={"Origin": ORIGIN})
    assert missing.status_code == 404 and missing.headers["access-control-allow-origin"] == ORIGIN
    # another origin, or none: no CORS header, and no preflight answer
    stranger = httpx.get(url + "/v1/models", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in stranger.headers
    assert "access-control-allow-origin" not in httpx.get(url + "/v1/models").headers
    refused = httpx.options(url + "/v1/models", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "GET"})  # fmt: skip
    assert refused.status_code == 405 and "access-control-allow-origin" not in refused.headers


def test_cors_is_off_by_default() -> None:
    from lifecycle.api.cors import cors

    async def handler(request: object) -> object:
        raise AssertionError("never called")

    assert cors(handler, ()) is handler  # type: ignore[arg-type]
