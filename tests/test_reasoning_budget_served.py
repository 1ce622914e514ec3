"""A thinking budget end to end (issue 56, point 4): a server whose chat template shows
``<think>`` (the qwen3 reasoning parser is on) and the scripted worker, which echoes the
prompt one token a step and forces the reasoning's end as the model's worker does. The
prompt holds a whole reasoning block, so the echoed output opens it with ``<think>``;
with a budget of k the reasoning is its first k tokens, then the forced ``\\n</think>``,
then the echo goes on as the answer. Chat's ``thinking_token_budget`` and Anthropic's
``thinking.budget_tokens`` give the same split, unary and streamed, and ``/generate``'s
``max_thinking_tokens`` the same text; without a budget the reasoning is whole;
``thinking: disabled`` reaches the template."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from lifecycle.chat.reasoning import REASONING_PARSERS, split_reasoning
from lifecycle.testing.pytest_plugin import LiveServer, start_server

pytestmark = pytest.mark.timeout(120)

# the comment shows <think> (the qwen3 parser is on); enable_thinking false is written out
TEMPLATE = ("{#- <think> -#}{% if enable_thinking is defined and not enable_thinking %}"
            "NOTHINK {% endif %}{{ messages[-1]['content'] }}")  # fmt: skip
PROMPT = "<think>\nalpha beta gamma delta epsilon zeta eta theta\n</think>\n\nThe answer."
QWEN3 = REASONING_PARSERS["qwen3"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    path = Path(tmp_path_factory.mktemp("tpl")) / "think.jinja"
    path.write_text(TEMPLATE)
    with start_server("--scripted-worker", "--chat-template", str(path)) as srv:
        yield srv


def _ids(server: LiveServer, text: str) -> list[int]:
    r = httpx.post(server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False})
    assert r.status_code == 200, r.text
    return list(r.json()["tokens"])


def _text(server: LiveServer, ids: list[int]) -> str:
    r = httpx.post(server.url + "/detokenize", json={"tokens": ids})
    assert r.status_code == 200, r.text
    return str(r.json()["text"])


def _echo(server: LiveServer, prompt: list[int], k: int | None) -> str:
    """The text the worker echoes for ``prompt`` with a budget of ``k``."""
    start, force = _ids(server, "<think>"), _ids(server, "\n</think>")
    n = len(start)
    opened = next(i for i in range(n - 1, len(prompt)) if prompt[i - n + 1 : i + 1] == start)
    out = list(prompt)
    if k is not None:  # the forced ids take the place of the echo's next ones
        at = opened + 1 + k
        out[at : at + len(force)] = force
        assert _text(server, prompt[opened + 1 : at]).strip()  # some reasoning is kept
    return _text(server, out)


def _expected(server: LiveServer, k: int | None) -> tuple[str, str, int]:
    """(reasoning, content, output tokens) of the echo with a budget of ``k``."""
    prompt = _ids(server, PROMPT)
    reasoning, content = split_reasoning(_echo(server, prompt, k), QWEN3)
    return reasoning, content, len(prompt)


def _chat(server: LiveServer, **extra: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    n = len(_ids(server, PROMPT))
    body: dict[str, Any] = {"model": "m", "max_tokens": n,
                            "messages": [{"role": "user", "content": PROMPT}]}  # fmt: skip
    unary = client.chat.completions.create(**body, extra_body=extra).model_dump()
    stream = client.chat.completions.create(**body, extra_body=extra, stream=True)
    deltas = [c.choices[0].delta.model_dump() for c in stream if c.choices]
    return unary, deltas


@pytest.mark.parametrize("k", [2, 5])
def test_chat_thinking_token_budget_closes_the_reasoning(server: LiveServer, k: int) -> None:
    reasoning, content, n = _expected(server, k)
    unary, deltas = _chat(server, thinking_token_budget=k)
    message = unary["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (reasoning, content)
    assert "theta" not in reasoning and content.endswith("The answer.")
    assert unary["usage"]["completion_tokens"] == n
    streamed = "".join(d.get("reasoning_content") or "" for d in deltas)
    assert streamed == reasoning
    assert "".join(d.get("content") or "" for d in deltas) == content


def test_without_a_budget_the_reasoning_is_whole(server: LiveServer) -> None:
    reasoning, content, _ = _expected(server, None)
    assert reasoning == "alpha beta gamma delta epsilon zeta eta theta"
    message = _chat(server)[0]["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (reasoning, content)


def test_anthropic_budget_tokens_closes_the_thinking_block(server: LiveServer) -> None:
    reasoning, content, n = _expected(server, 3)
    client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=60)
    body: dict[str, Any] = {"model": "m", "max_tokens": n,
                            "messages": [{"role": "user", "content": PROMPT}],
                            "thinking": {"type": "enabled", "budget_tokens": 3}}  # fmt: skip
    r = client.messages.create(**body)
    assert [b.type for b in r.content] == ["thinking", "text"], r
    assert r.content[0].thinking == reasoning  # type: ignore[union-attr]
    assert r.content[1].text == content  # type: ignore[union-attr]
    events = list(client.messages.create(**body, stream=True))
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == reasoning
    off = client.messages.create(**{**body, "thinking": {"type": "disabled"}})
    assert [b.type for b in off.content] == ["text"]  # the template wrote NOTHINK first
    assert off.content[0].text.startswith("NOTHINK <think>")  # type: ignore[union-attr]


def test_generate_max_thinking_tokens_closes_it_in_the_text(server: LiveServer) -> None:
    r = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT})
    prompt = list(r.json()["tokens"])  # as /generate tokenizes it
    body = {"text": PROMPT, "max_thinking_tokens": 4,
            "sampling_params": {"max_new_tokens": len(prompt)}}  # fmt: skip
    out = httpx.post(server.url + "/generate", json=body, timeout=60)
    assert out.status_code == 200, out.text
    assert out.json()["text"] == _echo(server, prompt, 4)  # never split on /generate
    assert "theta" not in split_reasoning(out.json()["text"], QWEN3)[0]
