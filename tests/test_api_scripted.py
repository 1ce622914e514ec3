"""The SGLang-native API end to end: real HTTP (httpx, raw sockets) to a real server
process driving the scripted worker process (outputs echo the prompt ids, see
``lifecycle.testing.scripted_worker``)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from .scripted import lifecycle_server

# Worker: 4 credits, 2 running, 20 ms per step: long requests stay in flight long enough
# to disconnect from them in each phase.
SERVER_ARGS = (
    "--scripted-worker",
    "--max-pending",
    "4",
    "--max-running",
    "2",
    "--worker-args",
    "--step-delay 0.02",
    "--send-timeout",
    "1",
)


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with lifecycle_server(*SERVER_ARGS) as base:
        yield base


def _gen(url: str, body: dict[str, Any], **kw: Any) -> httpx.Response:
    return httpx.post(url + "/generate", json=body, timeout=30, **kw)


def _events(url: str, body: dict[str, Any]) -> list[Any]:
    out: list[Any] = []
    with httpx.stream("POST", url + "/generate", json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[6:]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _info(url: str) -> dict[str, Any]:
    return httpx.get(url + "/server_info", timeout=10).json()


def _wait_idle(url: str, timeout: float = 5.0) -> dict[str, Any]:
    """live_requests 0 and every KV block free, within ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        info = _info(url)
        state = info["internal_states"][0]
        if (
            info["live_requests"] == 0
            and info["tombstones"] == 0
            and state["kv_blocks_free"] == state["kv_blocks_total"]
            and state["running"] == 0
            and state["waiting"] == 0
        ):
            return info
        if time.monotonic() > deadline:
            raise AssertionError(f"not idle: {info}")
        time.sleep(0.02)


def _tokenize(url: str, text: str) -> list[int]:
    r = httpx.post(url + "/tokenize", json={"prompt": text, "add_special_tokens": False})
    return r.json()["tokens"]


# -- unary ------------------------------------------------------------------------------------
def test_unary_text_prompt(url: str) -> None:
    ids = _tokenize(url, "The quick brown fox")
    r = _gen(url, {"text": "The quick brown fox", "sampling_params": {"max_new_tokens": 6}})
    assert r.status_code == 200
    out = r.json()
    expected = (ids * 3)[:6]
    assert out["output_ids"] == expected
    detok = httpx.post(url + "/detokenize", json={"tokens": expected}).json()["text"]
    assert out["text"] == detok
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == 6
    assert meta["cached_tokens"] == 0 and meta["num_retractions"] == 0
    assert meta["e2e_latency"] > 0 and isinstance(meta["id"], str)


def test_unary_input_ids_rid_echoed_and_stop_token(url: str) -> None:
    r = _gen(
        url,
        {
            "input_ids": [100, 200, 300],
            "rid": "my-req",
            "sampling_params": {"max_new_tokens": 10, "stop_token_ids": [300]},
        },
    )
    out = r.json()
    assert out["output_ids"] == [100, 200, 300]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": 300}
    assert out["meta_info"]["id"] == "my-req"


def test_batch_and_n(url: str) -> None:
    r = _gen(url, {"input_ids": [[10, 11], [20, 21, 22]], "sampling_params": {"max_new_tokens": 3}})
    outs = r.json()
    assert [o["output_ids"] for o in outs] == [[10, 11, 10], [20, 21, 22]]
    r = _gen(
        url,
        {"input_ids": [[10, 11], [20, 21, 22]], "sampling_params": {"max_new_tokens": 2, "n": 2}},
    )
    outs = r.json()
    # SGLang's order: the batch repeated n times; sample j of the scripted worker starts j later.
    assert [o["output_ids"] for o in outs] == [[10, 11], [20, 21], [11, 10], [21, 22]]
    single_n = _gen(url, {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1, "n": 2}})
    assert [o["output_ids"] for o in single_n.json()] == [[5], [6]]


def test_logprob_options(url: str) -> None:
    body = {
        "input_ids": [400, 401, 402],
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 2,
        "token_ids_logprob": [7, 8],
        "return_text_in_logprobs": True,
        "sampling_params": {"max_new_tokens": 3},
    }
    meta = _gen(url, body).json()["meta_info"]
    out = meta["output_token_logprobs"]
    assert [e[1] for e in out] == [400, 401, 402] and all(isinstance(e[2], str) for e in out)
    assert out[0][0] == pytest.approx(-0.2)
    assert meta["output_token_logprobs_length"] == 3
    assert [[t[1] for t in pos] for pos in meta["output_top_logprobs"]] == [
        [400, 401],
        [401, 402],
        [402, 403],
    ]
    assert [[t[1] for t in pos] for pos in meta["output_token_ids_logprobs"]] == [[7, 8]] * 3
    inp = meta["input_token_logprobs"]
    assert inp[0][0] is None and [e[1] for e in inp] == [400, 401, 402]


# -- streaming -----------------------------------------------------------------------------
def test_stream_cumulative(url: str) -> None:
    ids = _tokenize(url, "Hello there, friend")
    events = _events(url, {"text": "Hello there, friend", "sampling_params": {"max_new_tokens": 5}})
    assert events[-1] == "[DONE]"
    frames = events[:-1]
    counts = [f["meta_info"]["completion_tokens"] for f in frames]
    assert counts == sorted(counts) and counts[-1] == 5
    assert frames[-1]["output_ids"] == (ids * 2)[:5]
    for a, b in zip(frames, frames[1:], strict=False):
        assert b["text"].startswith(a["text"])  # cumulative, as bench_serving expects
    assert frames[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(f["meta_info"]["finish_reason"] is None for f in frames[:-1])


def test_stream_incremental(url: str) -> None:
    whole = _gen(
        url, {"text": "Streaming in pieces", "sampling_params": {"max_new_tokens": 7}}
    ).json()
    events = _events(
        url,
        {
            "text": "Streaming in pieces",
            "incremental_streaming_output": True,
            "sampling_params": {"max_new_tokens": 7},
        },
    )
    frames = events[:-1]
    assert "".join(f["text"] for f in frames) == whole["text"]
    assert [i for f in frames for i in f["output_ids"]] == whole["output_ids"]


def test_stream_batch_has_index(url: str) -> None:
    events = _events(
        url, {"input_ids": [[1000, 1001], [2000]], "sampling_params": {"max_new_tokens": 2}}
    )
    frames = events[:-1]
    last = {}
    for f in frames:
        last[f["index"]] = f["output_ids"]
    assert last == {0: [1000, 1001], 1: [2000, 2000]}


# -- errors --------------------------------------------------------------------------------
def test_validation_400_with_sglang_message(url: str) -> None:
    r = _gen(url, {"text": "x", "sampling_params": {"top_p": -1}})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "top_p must be in (0, 1], got -1."
    r = _gen(url, {"text": "x", "sampling_params": {"max_new_tokens": 9000}})
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
    events = _events(url, {"text": "x", "sampling_params": {"temperature": -1}})
    assert events[-1] == "[DONE]" and events[0]["error"]["code"] == 400
    assert "temperature" in events[0]["error"]["message"]
    _wait_idle(url)


def test_duplicate_live_rid_is_refused(url: str) -> None:
    with httpx.stream(
        "POST",
        url + "/generate",
        timeout=30,
        json={"input_ids": [1, 2], "rid": "dup", "stream": True, **LONG},
    ) as first:
        lines = first.iter_lines()  # kept: a collected iterator closes the response
        next(lines)
        r = _gen(url, {"input_ids": [1], "rid": "dup"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == "Duplicate request ID detected: dup"
    _wait_idle(url)


LONG = {"sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}


def _tokens_so_far(url: str, rid: str) -> int:
    """Request ``rid``'s output tokens by its trace (0 until the server knows it)."""
    r = httpx.get(f"{url}/debug/requests/{rid}")
    return int(r.json()["tokens"]) if r.status_code == 200 else 0


def test_abort_request_ends_running_request(url: str) -> None:
    import threading

    result: dict[str, Any] = {}

    def run() -> None:
        result["r"] = _gen(
            url,
            {
                "input_ids": [3, 4],
                "rid": "to-abort",
                "sampling_params": {"max_new_tokens": 500, "ignore_eos": True},
            },
        )

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 10  # until it has output (an abort before is no test)
    while _tokens_so_far(url, "to-abort") == 0:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert httpx.post(url + "/abort_request", json={"rid": "to-abort"}).status_code == 200
    t.join(10)
    out = result["r"].json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < out["meta_info"]["completion_tokens"] < 500
    _wait_idle(url)


# -- client disconnects release the worker ---------------------------------------------------
def _raw_request(url: str, body: dict[str, Any]) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    data = json.dumps(body).encode()
    sock.sendall(
        b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + f"content-length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def _wait_running(url: str, n: int) -> None:
    deadline = time.monotonic() + 5
    while _info(url)["internal_states"][0]["running"] < n:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_disconnect_while_waiting_for_unary_reply(url: str) -> None:
    sock = _raw_request(url, {"input_ids": [9, 9], **LONG})
    _wait_running(url, 1)
    sock.close()
    _wait_idle(url, timeout=2)


def test_disconnect_mid_stream(url: str) -> None:
    sock = _raw_request(url, {"input_ids": [9, 8], "stream": True, **LONG})
    assert b"data: " in sock.recv(65536) or b"data: " in sock.recv(65536)
    sock.close()
    _wait_idle(url, timeout=2)


def test_disconnect_while_queued_in_worker_and_frontend(url: str) -> None:
    # 2 run, 2 wait in the worker (4 credits), 2 more wait in the frontend's queue.
    socks = [
        _raw_request(url, {"input_ids": [i + 1], "stream": i % 2 == 0, **LONG}) for i in range(6)
    ]
    deadline = time.monotonic() + 10  # until all six are in: the last may still be parsed
    while (
        (info := _info(url))["live_requests"],
        info["internal_states"][0]["running"],
        info["internal_states"][0]["waiting"],
        info["internal_states"][0]["dispatch_queue"],
    ) != (6, 2, 2, 2):
        assert time.monotonic() < deadline, info
        time.sleep(0.02)
    for s in reversed(socks):  # queued ones first
        s.close()
    info = _wait_idle(url, timeout=3)
    assert info["failed_requests"].get("client_gone", 0) >= 6


def test_disconnect_during_prefill_phase(url: str) -> None:
    # Before any token arrives the stream has only headers; closing then must still release.
    sock = _raw_request(url, {"input_ids": list(range(100, 150)), "stream": True, **LONG})
    time.sleep(0.01)
    sock.close()
    _wait_idle(url, timeout=2)


# -- other routes ---------------------------------------------------------------------------
def test_info_routes(url: str) -> None:
    for path in ("/model_info", "/get_model_info"):
        info = httpx.get(url + path).json()
        assert info["is_generation"] is True and info["model_path"].endswith(".gguf")
    for path in ("/server_info", "/get_server_info"):
        info = httpx.get(url + path).json()
        state = info["internal_states"][0]
        assert {"pid", "running", "waiting", "kv_blocks_total", "kv_blocks_free"} <= set(state)
        assert "live_requests" in info
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/health_generate", timeout=30).status_code == 200
    r = httpx.post(url + "/flush_cache")
    assert r.status_code == 200 and r.text.startswith("Cache flushed")


def test_tokenize_detokenize(url: str) -> None:
    for prefix in ("", "/v1"):
        r = httpx.post(
            url + prefix + "/tokenize", json={"prompt": "Hello world", "add_special_tokens": False}
        )
        body = r.json()
        assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 8192
        back = httpx.post(url + prefix + "/detokenize", json={"tokens": body["tokens"]}).json()
        assert back == {"text": "Hello world"}
    assert httpx.post(url + "/detokenize", json={"tokens": [-1]}).status_code == 400


def test_client_that_stops_reading_is_ended_as_stalled(url: str) -> None:
    # Cumulative frames with 20 top logprobs each grow fast, so the socket buffers fill
    # within seconds; the client never reads, so the write stalls past --send-timeout.
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    data = json.dumps(
        {
            "input_ids": [11, 12, 13],
            "stream": True,
            "return_logprob": True,
            "top_logprobs_num": 20,
            "return_text_in_logprobs": True,
            **LONG,
        }
    ).encode()
    sock.sendall(
        b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + f"content-length: {len(data)}\r\n\r\n".encode()
        + data
    )
    try:
        deadline = time.monotonic() + 30
        while _info(url)["failed_requests"].get("client_stalled", 0) < 1:
            assert time.monotonic() < deadline, _info(url)
            time.sleep(0.1)
        _wait_idle(url, timeout=3)
    finally:
        sock.close()


def test_bench_serving_client_reads_the_stream(url: str) -> None:
    """What SGLang's bench_serving sglang client does with each frame: strip ``data: ``,
    skip ``[DONE]``, take ``text`` as the whole text so far, split each inter-chunk gap
    by the ``completion_tokens`` delta."""
    body = {
        "text": "Benchmarks read cumulative text",
        "stream": True,
        "sampling_params": {"max_new_tokens": 24, "ignore_eos": True, "temperature": 0.0},
    }
    generated, last_count, itl_entries = "", 0, 0
    with httpx.stream("POST", url + "/generate", json=body, timeout=30) as r:
        for chunk in r.iter_lines():
            chunk = chunk.removeprefix("data: ")
            if not chunk or chunk == "[DONE]":
                continue
            data = json.loads(chunk)
            if data["text"]:
                generated = data["text"]
                count = data["meta_info"]["completion_tokens"]
                itl_entries += count - last_count
                last_count = count
    whole = _gen(url, {**body, "stream": False}).json()
    assert generated == whole["text"] and last_count == 24 and itl_entries == 24
