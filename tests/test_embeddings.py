"""Embeddings end to end on the scripted worker: ``/v1/embeddings`` with the official
``openai`` client and SGLang's ``/encode``, over real sockets to a real server process.

The scripted worker's vector is a pure function of the prompt ids, the pooling and
``normalize`` (``lifecycle.testing.scripted_worker.scripted_embedding``), so every
expected vector is computed here. It runs one sequence at a time, 10 ms a step: a long
generation holds the only slot while an embedding waits, long enough to disconnect
from it or abort it.
"""

from __future__ import annotations

import base64
import json
import math
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from lifecycle.testing.scripted_worker import scripted_embedding
from wire import EmbedOptions

from .scripted import lifecycle_server, without_model_label

HIDDEN = 576  # the scripted worker's default hidden_size, SmolLM2-135M's too
SERVER_ARGS = ("--scripted-worker", "--max-running", "1", "--worker-args", "--step-delay 0.01")


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with lifecycle_server(*SERVER_ARGS) as base:
        yield base


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)


def _ids(url: str, text: str) -> list[int]:
    return httpx.post(url + "/tokenize", json={"prompt": text}).json()["tokens"]


def _expected(ids: list[int], pooling: str = "last", normalize: bool = True) -> list[float]:
    return scripted_embedding(ids, EmbedOptions(pooling, normalize), HIDDEN)


def _close(a: list[float], b: list[float], tol: float = 1e-6) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b, strict=True))


def _info(url: str) -> dict[str, Any]:
    return httpx.get(url + "/server_info", timeout=10).json()


def _wait(url: str, predicate: Any, timeout: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        info = _info(url)
        if predicate(info):
            return info
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached: {info}")
        time.sleep(0.01)


def _idle(info: dict[str, Any]) -> bool:
    s = info["internal_states"][0]
    return (
        info["live_requests"] == 0
        and info["tombstones"] == 0
        and s["kv_blocks_free"] == s["kv_blocks_total"]
        and s["running"] == s["waiting"] == 0
    )


def _metric(url: str, line_start: str) -> float:
    """The value of the sample whose line starts with ``line_start``, its model's
    ``model_name`` label left out."""
    for line in httpx.get(url + "/metrics").text.splitlines():
        if without_model_label(line).startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# -- /v1/embeddings ---------------------------------------------------------------------------


def test_texts_give_the_workers_vectors_in_order_with_usage(
    client: openai.OpenAI, url: str
) -> None:
    texts = ["hello world", "a second, longer text", "x"]
    r = client.embeddings.create(model="default", input=texts, user="someone")
    assert r.object == "list" and [d.index for d in r.data] == [0, 1, 2]
    assert all(d.object == "embedding" and len(d.embedding) == HIDDEN for d in r.data)
    ids = [_ids(url, t) for t in texts]
    for d, prompt in zip(r.data, ids, strict=True):
        assert _close(d.embedding, _expected(prompt))
        assert abs(math.fsum(v * v for v in d.embedding) - 1) < 1e-5  # L2-normalised
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(p) for p in ids)
    assert r.model and r.model == client.models.list().data[0].id
    _wait(url, _idle)


def test_token_arrays_single_and_batched(client: openai.OpenAI) -> None:
    one = client.embeddings.create(model="default", input=[5, 6, 7])
    assert len(one.data) == 1 and _close(one.data[0].embedding, _expected([5, 6, 7]))
    many = client.embeddings.create(model="default", input=[[5, 6, 7], [9], [5, 6, 7]])
    vecs = [d.embedding for d in many.data]
    assert _close(vecs[0], one.data[0].embedding) and _close(vecs[0], vecs[2])
    assert _close(vecs[1], _expected([9])) and not _close(vecs[0], vecs[1], 1e-3)
    assert many.usage.prompt_tokens == 7


def test_mean_pooling_and_no_normalize_are_extension_fields(client: openai.OpenAI) -> None:
    ids = [11, 12, 13, 14]
    last = client.embeddings.create(model="default", input=ids).data[0].embedding
    mean = (
        client.embeddings.create(model="default", input=ids, extra_body={"pooling": "mean"})
        .data[0]
        .embedding
    )
    raw = (
        client.embeddings.create(
            model="default", input=ids, extra_body={"pooling": "mean", "normalize": False}
        )
        .data[0]
        .embedding
    )
    assert _close(mean, _expected(ids, "mean")) and not _close(mean, last, 1e-3)
    assert _close(raw, _expected(ids, "mean", False), 1e-5)
    assert abs(math.sqrt(sum(v * v for v in raw)) - 1) > 1e-3


def test_base64_is_little_endian_float32_of_the_same_vector(url: str) -> None:
    body = {"input": ["base64 please", "two"], "encoding_format": "base64"}
    b64 = httpx.post(url + "/v1/embeddings", json=body).json()
    floats = httpx.post(url + "/v1/embeddings", json={**body, "encoding_format": "float"}).json()
    for enc, dec in zip(b64["data"], floats["data"], strict=True):
        raw = base64.b64decode(enc["embedding"])
        assert len(raw) == 4 * HIDDEN
        assert list(struct.unpack(f"<{HIDDEN}f", raw)) == dec["embedding"]  # exact: f32 both ways


def test_dimensions_only_the_hidden_size(client: openai.OpenAI) -> None:
    ok = client.embeddings.create(model="default", input="hi", dimensions=HIDDEN)
    assert len(ok.data[0].embedding) == HIDDEN
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model="default", input="hi", dimensions=256)
    err = info.value.body
    assert isinstance(err, dict) and err["param"] == "dimensions"
    assert "dimensions=256" in err["message"] and str(HIDDEN) in err["message"]
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": {"text": "x"}}, "input"),
        ({"input": [1, "a"]}, "input"),
        ({"input": [49152]}, "input"),
        ({}, "input"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "x", "pooling": "max"}, "pooling"),
        ({"input": "x", "normalize": "yes"}, "normalize"),
        ({"input": "x", "user": 3}, "user"),
    ],
)
def test_bad_bodies_are_openai_400s(url: str, body: dict[str, Any], param: str) -> None:
    r = httpx.post(url + "/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_any_model_name_is_served_and_bad_json_400(url: str) -> None:
    r = httpx.post(url + "/v1/embeddings", json={"input": "x", "model": "nope"})
    assert r.status_code == 200 and r.json()["model"] != "nope"  # served by our model
    r = httpx.post(url + "/v1/embeddings", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_too_long_is_the_same_error_as_generate(url: str) -> None:
    ids = [5] * 8192  # the model's context length
    emb = httpx.post(url + "/v1/embeddings", json={"input": ids})
    gen = httpx.post(url + "/generate", json={"input_ids": ids})
    assert emb.status_code == gen.status_code == 400
    err = emb.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "input"
    assert err["message"] == gen.json()["error"]["message"]
    enc = httpx.post(url + "/encode", json={"input_ids": ids})
    assert enc.status_code == 400 and enc.json() == gen.json()
    assert _metric(url, 'lifecycle_request_errors_total{cause="too_long"}') >= 3


# -- /encode ----------------------------------------------------------------------------------


def test_encode_single_and_batch_in_sglangs_shape(url: str) -> None:
    one = httpx.post(url + "/encode", json={"text": "hello", "rid": "enc-1"}).json()
    assert set(one) == {"embedding", "meta_info"}
    assert _close(one["embedding"], _expected(_ids(url, "hello")))
    meta = one["meta_info"]
    assert meta["id"] == "enc-1" and meta["prompt_tokens"] == len(_ids(url, "hello"))
    assert meta["finish_reason"] == {"type": "length", "length": 0} and meta["e2e_latency"] > 0
    batch = httpx.post(
        url + "/encode", json={"input_ids": [[5, 6], [7]], "rid": "b", "pooling": "mean"}
    ).json()
    assert [b["meta_info"]["id"] for b in batch] == ["b_0", "b_1"]
    assert _close(batch[0]["embedding"], _expected([5, 6], "mean"))
    assert _close(batch[1]["embedding"], _expected([7], "mean"))
    texts = httpx.put(url + "/encode", json={"text": ["a", "b"]}).json()
    assert len(texts) == 2 and all(len(t["embedding"]) == HIDDEN for t in texts)


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"text": "a", "input_ids": [1]},
        {"text": []},
        {"text": [""]},
        {"input_ids": []},
        {"text": 5},
        {"text": "a", "dimensions": 3},
        {"text": "a", "pooling": "cls"},
        {"text": "a", "stream": True},
        {"text": ["a", "b"], "rid": ["x", "x"]},
    ],
)
def test_encode_bad_bodies_are_400_in_sglangs_shape(url: str, body: dict[str, Any]) -> None:
    r = httpx.post(url + "/encode", json=body)
    assert r.status_code == 400, r.text
    assert set(r.json()) == {"error"} and r.json()["error"]["message"]


# -- ownership: disconnect and abort, with a generation holding the worker's one slot ---------


def _raw_post(url: str, path: str, body: dict[str, Any]) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    sock.sendall(f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def _busy(url: str) -> Any:
    """A streamed generation that holds the worker's only slot (~4 s) until closed."""
    body = {"input_ids": [5, 6, 7], "stream": True}
    body["sampling_params"] = {"max_new_tokens": 400, "ignore_eos": True}
    return httpx.stream("POST", url + "/generate", json=body, timeout=30)


def test_a_client_that_disconnects_while_waiting_leaks_nothing(url: str) -> None:
    _wait(url, _idle)
    gone = _metric(url, 'lifecycle_request_errors_total{cause="client_gone"}')
    with _busy(url) as stream:
        lines = stream.iter_lines()
        next(lines)
        sock = _raw_post(url, "/v1/embeddings", {"input": ["wait", "for", "a", "slot"]})
        _wait(url, lambda i: i["live_requests"] == 5)
        sock.close()
        _wait(url, lambda i: i["live_requests"] == 1 and i["tombstones"] == 0)
        assert _metric(url, 'lifecycle_request_errors_total{cause="client_gone"}') == gone + 4
        events = [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"  # the generation was not disturbed
        assert json.loads(events[-2][6:])["meta_info"]["completion_tokens"] == 400
    _wait(url, _idle)


def test_abort_request_ends_a_waiting_encode_with_400(url: str) -> None:
    _wait(url, _idle)
    got: dict[str, httpx.Response] = {}

    def encode() -> None:
        got["r"] = httpx.post(url + "/encode", json={"text": "abort me", "rid": "emb-ab"})

    with _busy(url) as stream:
        lines = stream.iter_lines()
        next(lines)
        t = threading.Thread(target=encode)
        t.start()
        _wait(url, lambda i: i["live_requests"] == 2)
        assert httpx.post(url + "/abort_request", json={"rid": "emb-ab"}).status_code == 200
        t.join(10)
        r = got["r"]
        assert r.status_code == 400 and "abort" in r.json()["error"]["message"]
        stream.close()
    _wait(url, _idle)
