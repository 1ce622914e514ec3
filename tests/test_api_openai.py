"""The OpenAI-compatible API through the official ``openai`` client, unmodified, against a
real server process driving the scripted worker (each sample echoes its prompt ids
cyclically, sample ``j`` starting ``j`` tokens on), so every expected output is known."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from .scripted import lifecycle_server

# 2 ms per step: a long request stays in flight long enough to abort it.
SERVER_ARGS = (
    "--scripted-worker",
    "--max-pending",
    "8",
    "--max-running",
    "4",
    "--worker-args",
    "--step-delay 0.002",
)


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with lifecycle_server(*SERVER_ARGS) as base:
        yield base


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)


def _tokenize(url: str, text: str) -> list[int]:
    r = httpx.post(url + "/tokenize", json={"prompt": text, "add_special_tokens": False})
    return r.json()["tokens"]


def _detokenize(url: str, ids: list[int]) -> str:
    return httpx.post(url + "/detokenize", json={"tokens": ids}).json()["text"]


def _echoed(prompt: list[int], n_tokens: int, sample: int) -> list[int]:
    """What the scripted worker generates for ``sample`` of a prompt."""
    return [prompt[(g + sample) % len(prompt)] for g in range(n_tokens)]


def _error(url: str, path: str, body: Any) -> tuple[int, dict[str, Any]]:
    r = httpx.post(url + path, content=json.dumps(body), timeout=30)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return r.status_code, err


def test_models_list_and_retrieve(client: openai.OpenAI, url: str) -> None:
    models = client.models.list()
    assert len(models.data) == 1
    card = models.data[0]
    assert card.object == "model" and isinstance(card.created, int)
    assert client.models.retrieve(card.id).id == card.id
    assert client.models.retrieve("default").id == card.id
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert info.value.body["code"] == "model_not_found"  # type: ignore[index]


def test_completion_unary_n2(client: openai.OpenAI, url: str) -> None:
    prompt = "one two three four five"
    ids = _tokenize(url, prompt)
    r = client.completions.create(model="default", prompt=prompt, max_tokens=7, n=2)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.system_fingerprint and r.system_fingerprint.startswith("fp_")
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert c.text == _detokenize(url, _echoed(ids, 7, c.index))
        assert c.finish_reason == "length" and c.logprobs is None
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 14)
    assert r.usage.total_tokens == len(ids) + 14


def test_completion_default_max_tokens_is_16(client: openai.OpenAI) -> None:
    r = client.completions.create(model="default", prompt="a b c d e")
    assert r.usage is not None and r.usage.completion_tokens == 16


def test_completion_prompt_forms_are_prompt_major(client: openai.OpenAI, url: str) -> None:
    a, b = _tokenize(url, "alpha beta gamma"), _tokenize(url, "red green blue")
    for prompt in (["alpha beta gamma", "red green blue"], [a, b]):
        r = client.completions.create(model="default", prompt=prompt, max_tokens=4, n=2)
        texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
        want = [_detokenize(url, _echoed(p, 4, j)) for p in (a, b) for j in range(2)]
        assert texts == want
    r = client.completions.create(model="default", prompt=a, max_tokens=3)
    assert r.choices[0].text == _detokenize(url, _echoed(a, 3, 0))


def test_completion_logprobs_and_echo(client: openai.OpenAI, url: str) -> None:
    prompt = "the quick brown fox"
    ids = _tokenize(url, prompt)
    r = client.completions.create(model="default", prompt=prompt, max_tokens=5, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert "".join(lp.tokens) == r.choices[0].text
    assert len(lp.token_logprobs) == 5 and all(v is not None and v < 0 for v in lp.token_logprobs)
    assert lp.top_logprobs is not None and all(len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset or []) and lp.text_offset[0] == 0
    r = client.completions.create(
        model="default", prompt=prompt, max_tokens=3, logprobs=1, echo=True
    )
    c = r.choices[0]
    assert c.text.startswith(prompt) and c.text == prompt + _detokenize(url, _echoed(ids, 3, 0))
    assert c.logprobs is not None and c.logprobs.token_logprobs is not None
    assert len(c.logprobs.token_logprobs) == len(ids) + 3
    assert c.logprobs.token_logprobs[0] is None  # the first prompt token has no logprob


def test_completion_stream_matches_unary(client: openai.OpenAI) -> None:
    body: dict[str, Any] = {"model": "default", "prompt": ["x y z w", "p q r s"], "n": 2}
    body["max_tokens"] = 6
    unary = client.completions.create(**body)
    texts: dict[int, str] = {}
    finishes: dict[int, str | None] = {}
    chunks = list(
        client.completions.create(**body, stream=True, stream_options={"include_usage": True})
    )
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    for chunk in chunks[:-1]:
        assert chunk.usage is None and chunk.object == "text_completion"
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            finishes[c.index] = c.finish_reason or finishes.get(c.index)
    assert texts == {c.index: c.text for c in unary.choices}
    assert finishes == {i: "length" for i in range(4)}
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.model_dump() == unary.usage.model_dump()  # type: ignore[union-attr]


def test_chat_unary_with_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="default",
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hello there"}]},
        ],
        max_tokens=6,
        logprobs=True,
        top_logprobs=3,
    )
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    c = r.choices[0]
    assert c.message.role == "assistant" and c.finish_reason == "length"
    assert c.logprobs is not None and c.logprobs.content is not None
    assert len(c.logprobs.content) == 6 and r.usage is not None
    assert r.usage.completion_tokens == 6
    for entry in c.logprobs.content:
        assert 1 <= len(entry.top_logprobs) <= 3 and entry.bytes is not None
    joined = b"".join(bytes(e.bytes or []) for e in c.logprobs.content).decode()
    assert c.message.content and c.message.content in joined  # special tokens are skipped


def test_chat_stream_n2_include_usage(client: openai.OpenAI) -> None:
    body: dict[str, Any] = {
        "model": "default",
        "messages": [{"role": "user", "content": "Count with me"}],
        "max_completion_tokens": 5,
        "n": 2,
    }
    unary = client.chat.completions.create(**body)
    chunks = list(
        client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True})
    )
    content: dict[int, str] = {}
    roles: dict[int, str | None] = {}
    for chunk in chunks[:-1]:
        assert chunk.object == "chat.completion.chunk" and chunk.id.startswith("chatcmpl-")
        for c in chunk.choices:
            roles.setdefault(c.index, c.delta.role)
            content[c.index] = content.get(c.index, "") + (c.delta.content or "")
    assert roles == {0: "assistant", 1: "assistant"}
    assert content == {c.index: c.message.content for c in unary.choices}
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 10


def test_stop_token_ids_give_finish_stop(client: openai.OpenAI, url: str) -> None:
    ids = _tokenize(url, "one two three four")
    r = client.completions.create(
        model="default",
        prompt=ids,
        max_tokens=10,
        extra_body={"stop_token_ids": [ids[2]], "ignore_eos": True},
    )
    c = r.choices[0]
    assert c.finish_reason == "stop"
    assert c.text == _detokenize(url, ids[:2])  # the matched stop token is trimmed


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": 7}, "prompt"),
        ("/v1/completions", {"prompt": "x", "logprobs": 99}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, None),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "bot", "content": "x"}]}, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "tools": [{}]},
            "tools",
        ),
    ],
)
def test_bad_input_is_400_with_param(url: str, path: str, body: Any, param: str | None) -> None:
    status, err = _error(url, path, body)
    assert status == 400 and err["type"] == "invalid_request_error" and err["param"] == param


def test_any_model_name_is_served_and_bad_json(url: str, client: openai.OpenAI) -> None:
    served = client.models.list().data[0].id
    r = httpx.post(url + "/v1/chat/completions", json={  # SGLang's leniency (issue 22)
        "model": "gpt-x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})  # fmt: skip
    assert r.status_code == 200 and r.json()["model"] == served
    r = httpx.post(url + "/v1/completions", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="default", prompt="a b", max_tokens=9000)
    assert info.value.body["code"] == "context_length_exceeded"  # type: ignore[index]


def test_streamed_error_after_headers_is_a_chunk_then_done() -> None:
    """A worker that dies mid-stream: the stream ends with an error chunk and [DONE]."""
    args = ("--scripted-worker", "--worker-args", "--die-after-steps 3 --step-delay 0.02")
    with lifecycle_server(*args) as base:
        body = {"prompt": "a b c d", "max_tokens": 50, "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["code"] == "worker_lost" and err["type"] == "server_error"
        assert all("choices" in json.loads(e) for e in events[:-2])
        # The restarted worker dies again 3 steps in: the client raises on the error chunk.
        deadline = time.monotonic() + 30
        while httpx.get(base + "/health", timeout=5).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIError) as info:
            list(
                client.completions.create(model="default", prompt="a b", max_tokens=50, stream=True)
            )
        assert not isinstance(info.value, openai.APIStatusError)  # raised after a 200
        assert info.value.body["code"] == "worker_lost"  # type: ignore[index]


def test_abort_all_reaches_openai_streams(client: openai.OpenAI, url: str) -> None:
    finishes: list[str | None] = []

    def consume() -> None:
        stream = client.completions.create(
            model="default", prompt="a b c", max_tokens=4000, stream=True
        )
        finishes.extend(c.choices[0].finish_reason for c in stream if c.choices)

    reader = threading.Thread(target=consume)
    reader.start()
    deadline = time.monotonic() + 10
    while httpx.get(url + "/server_info").json()["live_requests"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    httpx.post(url + "/abort_request", json={"abort_all": True})
    reader.join(30)
    assert finishes and finishes[-1] == "abort"


def test_client_gone_mid_stream_releases_everything(url: str) -> None:
    body = {"prompt": "a b c", "max_tokens": 4000, "stream": True, "n": 2}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # close the connection mid-stream
    deadline = time.monotonic() + 10
    while True:
        info = httpx.get(url + "/server_info").json()
        state = info["internal_states"][0]
        if (
            info["live_requests"] == 0
            and info["tombstones"] == 0
            and state["kv_blocks_free"] == state["kv_blocks_total"]
        ):
            break
        assert time.monotonic() < deadline, info
        time.sleep(0.02)
    assert info["failed_requests"].get("client_gone", 0) >= 1


def test_rid_names_the_request_for_abort_and_duplicates(client: openai.OpenAI, url: str) -> None:
    finishes: list[str | None] = []

    def consume() -> None:
        stream = client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": "go"}],
            stream=True,
            extra_body={"rid": "chat-1", "ignore_eos": True},
        )
        finishes.extend(c.choices[0].finish_reason for c in stream if c.choices)

    reader = threading.Thread(target=consume)
    reader.start()
    deadline = time.monotonic() + 10
    while httpx.get(url + "/server_info").json()["live_requests"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    status, err = _error(url, "/v1/completions", {"prompt": "x", "rid": "chat-1"})
    assert status == 400 and "chat-1" in err["message"]
    httpx.post(url + "/abort_request", json={"rid": "chat-1"})
    reader.join(30)
    assert finishes and finishes[-1] == "abort"
