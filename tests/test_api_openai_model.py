"""The OpenAI API with the real model (SmolLM2-135M) through the official ``openai``
client: one server process for the module."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from .scripted import lifecycle_server

pytestmark = pytest.mark.model

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with lifecycle_server("--device", "cpu", "--max-running", "8") as base:
        yield base


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_completion_equals_native_generate(client: openai.OpenAI, url: str) -> None:
    r = client.completions.create(model="default", prompt=PROMPT, max_tokens=12, temperature=0)
    native = httpx.post(
        url + "/generate",
        json={"text": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0}},
        timeout=120,
    ).json()
    assert r.choices[0].text == native["text"] and r.choices[0].text
    assert r.usage is not None
    assert r.usage.completion_tokens == native["meta_info"]["completion_tokens"]
    # the same text streamed
    chunks = list(
        client.completions.create(
            model="default", prompt=PROMPT, max_tokens=12, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == native["text"]


def test_stop_string_trims_and_reports_stop(client: openai.OpenAI) -> None:
    body: dict[str, Any] = {"model": "default", "prompt": PROMPT, "temperature": 0}
    full = client.completions.create(**body, max_tokens=16).choices[0].text
    words = full.split(" ")
    assert len(words) >= 4, full
    stop = " " + words[3]
    cut = full[: full.index(stop)]
    for stream in (False, True):
        if stream:
            chunks = list(
                client.completions.create(**body, max_tokens=16, stop=[stop], stream=True)
            )
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            choice = client.completions.create(**body, max_tokens=16, stop=stop).choices[0]
            text, finish = choice.text, choice.finish_reason
        assert (text, finish) == (cut, "stop")


def test_chat_greedy_unary_and_stream_agree(client: openai.OpenAI, url: str) -> None:
    """The stream carries what the unary reply does, the unary one on an empty prefix
    cache and the stream behind the prefix it left: the quantized default computes the
    same tokens either way (docs/determinism.md). A third run reuses the cached prefix
    and says so."""
    body: dict[str, Any] = {"model": "default", "messages": CHAT, "max_tokens": 24,
                            "temperature": 0}  # fmt: skip
    assert httpx.post(url + "/flush_cache", timeout=30).status_code == 200
    r = client.chat.completions.create(**body)
    content = r.choices[0].message.content
    assert content and "<|im" not in content
    assert r.choices[0].finish_reason in ("stop", "length")
    chunks = list(
        client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True})
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == content
    assert chunks[-1].usage is not None and r.usage is not None
    u, v = chunks[-1].usage, r.usage
    assert (u.prompt_tokens, u.completion_tokens) == (v.prompt_tokens, v.completion_tokens)
    # the same prompt again reuses the cached prefix blocks
    again = client.chat.completions.create(**body).usage
    assert again is not None and again.prompt_tokens_details is not None
    assert again.prompt_tokens_details.cached_tokens


def test_chat_logprobs_are_consistent(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="default", messages=CHAT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == r.usage.completion_tokens  # type: ignore[union-attr]
    for entry in content:
        tops = entry.top_logprobs
        assert len(tops) == 3 and [t.logprob for t in tops] == sorted(
            (t.logprob for t in tops), reverse=True
        )
        assert tops[0].token == entry.token  # greedy picks the most likely token
        assert math.isclose(tops[0].logprob, entry.logprob, abs_tol=1e-4)
        assert entry.logprob <= 0 and sum(math.exp(t.logprob) for t in tops) <= 1 + 1e-4


def test_completion_n2_seeded_sampling_and_echo_logprobs(client: openai.OpenAI) -> None:
    body: dict[str, Any] = {"model": "default", "prompt": PROMPT, "max_tokens": 8}
    a = client.completions.create(**body, n=2, temperature=0.9, seed=7)
    b = client.completions.create(**body, n=2, temperature=0.9, seed=7)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    r = client.completions.create(**body, temperature=0, logprobs=2, echo=True)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.tokens is not None
    assert r.choices[0].text.startswith(PROMPT)
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.token_logprobs[0] is None and all(v is not None for v in lp.token_logprobs[1:])
