"""Tool calling's reply shapes through the official ``openai`` client on the scripted
worker, which echoes the prompt back: unary and streamed calls, ``tool_choice`` none,
and an unknown tool name refused before anything is queued."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from .scripted import lifecycle_server
from .tool_cases import SUM, TOOLS, USER

# -- the reply shapes, on the scripted worker --------------------------------------------
# The scripted worker echoes the prompt: a system message holding a call comes back as
# the reply's text, so the call is parsed out of it (sample j starts j tokens on).


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with lifecycle_server("--scripted-worker", "--max-pending", "8") as base:
        yield base


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)


def _echo_body(url: str) -> dict[str, Any]:
    end = httpx.post(url + "/tokenize", json={"prompt": "<|im_end|>"}).json()["tokens"]
    system = {"role": "system", "content": SUM}
    return {"model": "m", "messages": [system, *USER], "tools": TOOLS, "max_tokens": 600,
            "extra_body": {"stop_token_ids": end}, "n": 2}  # fmt: skip


def test_unary_reply_has_tool_calls(url: str, client: openai.OpenAI) -> None:
    r = client.chat.completions.create(**_echo_body(url))
    assert len(r.choices) == 2
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        calls = choice.message.tool_calls or []
        assert [(c.type, c.function.name, c.function.arguments) for c in calls] == [
            ("function", "add", '{"a": 1, "b": 2}')
        ]
        # the rest of the system turn, the tools' description, is content
        assert choice.message.content and "# Tools" in choice.message.content


def test_streamed_reply_reassembles_to_the_unary_one(url: str, client: openai.OpenAI) -> None:
    body = _echo_body(url)
    unary = client.chat.completions.create(**body)
    state = ChatCompletionStreamState()
    chunks = list(client.chat.completions.create(**body, stream=True))
    for chunk in chunks:
        state.handle_chunk(chunk)
    final = state.get_final_completion()
    for u, s in zip(unary.choices, sorted(final.choices, key=lambda c: c.index), strict=True):
        assert s.finish_reason == u.finish_reason == "tool_calls"
        assert s.message.content == u.message.content
        ucalls, scalls = u.message.tool_calls or [], s.message.tool_calls or []
        assert [(c.function.name, c.function.arguments) for c in scalls] == [
            (c.function.name, c.function.arguments) for c in ucalls
        ]
    heads = [tc for c in chunks for ch in c.choices for tc in (ch.delta.tool_calls or ())
             if tc.id is not None]  # fmt: skip
    assert len(heads) == 2 and all(h.function.arguments == "" and h.type == "function"
                                   for h in heads)  # fmt: skip


def test_no_tool_choice_none_no_parsing(url: str, client: openai.OpenAI) -> None:
    body = {**_echo_body(url), "tool_choice": "none", "n": 1}
    choice = client.chat.completions.create(**body).choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert choice.message.content == "system\n" + SUM


def requests_seen(url: str) -> tuple[float, float]:
    """Generation requests the server has a record of, (past validation, refused by it):
    ``lifecycle_requests_total`` by outcome, ``invalid`` apart (a refused request is
    traced and counted with that cause; it never reaches the queue)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    counts = [
        (s.labels.get("outcome") == "invalid", s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "lifecycle_requests_total"
    ]
    return sum(v for bad, v in counts if not bad), sum(v for bad, v in counts if bad)


def test_unknown_tool_name_is_400_before_anything_is_queued(
    url: str, client: openai.OpenAI
) -> None:
    body = {**_echo_body(url), "tool_choice": {"type": "function", "function": {"name": "rm"}}}
    body.update(body.pop("extra_body"))
    client.chat.completions.create(**{**_echo_body(url), "n": 1, "max_tokens": 2})
    ran, refused = requests_seen(url)
    assert ran > 0
    r = httpx.post(url + "/v1/chat/completions", json=body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "tool_choice" and "'rm', which is not in tools" in err["message"]
    assert requests_seen(url) == (ran, refused + 1)  # traced as refused, nothing ran
