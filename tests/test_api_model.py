"""The SGLang-native API end to end with the real worker and the real model (SmolLM2-135M):
one server process for the module (start-up costs seconds)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.model

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def url(model_server: str) -> Iterator[str]:
    yield model_server


def _gen(url: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _wait_idle(url: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        info = httpx.get(url + "/server_info", timeout=10).json()
        s = info["internal_states"][0]
        if (
            info["live_requests"] == 0
            and s["kv_blocks_free"] == s["kv_blocks_total"]
            and not s["running"]
        ):
            return
        assert time.monotonic() < deadline, info
        time.sleep(0.05)


def test_greedy_unary_and_stream_agree(url: str) -> None:
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    a, b = _gen(url, body), _gen(url, body)
    assert a["output_ids"] == b["output_ids"] and len(a["output_ids"]) <= 12
    assert a["text"] and a["meta_info"]["finish_reason"]["type"] in ("length", "stop")
    frames = []
    with httpx.stream("POST", url + "/generate", json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                frames.append(line[6:])
    assert frames[-1] == "[DONE]"
    last = json.loads(frames[-2])
    assert last["text"] == a["text"] and last["output_ids"] == a["output_ids"]
    _wait_idle(url)


def test_stop_string_is_trimmed(url: str) -> None:
    base = _gen(url, {"text": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0}})
    text = base["text"]
    stop = text.strip().split()[1] if len(text.split()) > 1 else text.strip()[:2]
    out = _gen(
        url,
        {
            "text": PROMPT,
            "sampling_params": {"max_new_tokens": 12, "temperature": 0, "stop": [stop]},
        },
    )
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[: text.find(stop)]
    kept = _gen(
        url,
        {
            "text": PROMPT,
            "sampling_params": {
                "max_new_tokens": 12,
                "temperature": 0,
                "stop": [stop],
                "no_stop_trim": True,
            },
        },
    )
    assert kept["text"].endswith(stop)


def _streamed_texts(url: str, path: str, body: dict[str, Any]) -> list[str]:
    """The text a client holds after each event of a stream: /generate's events carry
    the text so far, the OpenAI routes' carry deltas."""
    held, texts = "", []
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            if path == "/generate":
                held = event["text"]
            else:
                choice = event["choices"][0] if event.get("choices") else {}
                held += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            texts.append(held)
    return texts


def test_stop_strings_ending_inside_tokens_are_never_taken_back(url: str) -> None:
    """Issue 54, point 1, end to end on every streaming API: stop strings of 2-4
    characters that start at several places of the greedy reply, most of them inside a
    token. What a stream showed never extends past the final text (nothing is shown and
    then taken back), and the final text ends where the stop string begins."""
    chat = {"messages": [{"role": "user", "content": "Name three colours."}]}
    cases = [
        (
            "/generate",
            {"text": PROMPT, "sampling_params": {"max_new_tokens": 16, "temperature": 0}},
        ),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 16, "temperature": 0}),
        ("/v1/chat/completions", {**chat, "max_tokens": 16, "temperature": 0}),
    ]
    checked = 0
    for path, body in cases:
        whole = _streamed_texts(url, path, body)[-1]
        for start in range(3, min(len(whole) - 4, 15), 3):
            stop = whole[start : start + 2 + start % 3]
            if whole.find(stop) != start or not stop.strip():
                continue
            if path == "/generate":
                sb = {**body, "sampling_params": {**body["sampling_params"], "stop": [stop]}}
            else:
                sb = {**body, "stop": [stop]}
            texts = _streamed_texts(url, path, sb)
            final = texts[-1] if texts else ""
            assert final == whole[:start], (path, stop, final)
            assert all(final.startswith(t) for t in texts), (path, stop, texts)
            checked += 1
    assert checked >= 6
    _wait_idle(url)


def test_logprobs_shapes(url: str) -> None:
    out = _gen(
        url,
        {
            "text": PROMPT,
            "return_logprob": True,
            "top_logprobs_num": 3,
            "return_text_in_logprobs": True,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        },
    )
    meta = out["meta_info"]
    lps = meta["output_token_logprobs"]
    assert [e[1] for e in lps] == out["output_ids"]
    assert all(e[0] <= 0 and isinstance(e[2], str) for e in lps)
    tops = meta["output_top_logprobs"]
    assert len(tops) == len(lps) and all(len(t) == 3 for t in tops)
    assert all(t[0][1] == e[1] for t, e in zip(tops, lps, strict=True))  # greedy: top-1 chosen


def test_disconnect_mid_stream_releases_kv(url: str) -> None:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    data = json.dumps(
        {
            "text": PROMPT,
            "stream": True,
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True},
        }
    ).encode()
    sock.sendall(
        b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + f"content-length: {len(data)}\r\n\r\n".encode()
        + data
    )
    got = b""
    while b"data: " not in got:
        got += sock.recv(65536)
    sock.close()
    _wait_idle(url)


def test_health_generate_and_abort(url: str) -> None:
    assert httpx.get(url + "/health_generate", timeout=60).status_code == 200
    import threading

    res: dict[str, Any] = {}
    t = threading.Thread(
        target=lambda: res.update(
            r=_gen(
                url,
                {
                    "text": PROMPT,
                    "rid": "abort-me",
                    "sampling_params": {"max_new_tokens": 400, "ignore_eos": True},
                },
            )
        )
    )
    t.start()
    time.sleep(1.0)
    httpx.post(url + "/abort_request", json={"rid": "abort-me"})
    t.join(60)
    assert res["r"]["meta_info"]["finish_reason"]["type"] == "abort"
    _wait_idle(url)
