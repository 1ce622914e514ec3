"""Reasoning and each family's tool calls through the real server and the official
``openai`` client, on the scripted worker. The server runs a chat template that renders
only the last message's text and ``<|im_end|>``, and the worker echoes the prompt, so
the "model" writes exactly the text a test sends, in its family's format; the template's
markers choose the formats (``<think>``: qwen3 reasoning; ``[TOOL_CALLS]``: mistral ...)
as they do for a real model's template."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from lifecycle.chat.reasoning import REASONING_PARSERS

from .scripted import lifecycle_server
from .tool_cases import TOOLS

PARIS = {"city": "Paris", "unit": "celsius"}
SUM = {"a": 1, "b": 2}
THINK = "<think>\nThe user wants two things.\n</think>\n\n"
DS = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>{}\n```json\n{}\n```<｜tool▁call▁end｜>"
# family -> (the marker its template shows, the model's text after the reasoning)
FAMILIES = {
    "qwen25": ("<tool_call>", "Checking.\n<tool_call>\n"
               + json.dumps({"name": "get_weather", "arguments": PARIS})
               + "\n</tool_call>\n<tool_call>\n" + json.dumps({"name": "add", "arguments": SUM})
               + "\n</tool_call>"),
    "llama3": ("<|python_tag|>", json.dumps({"name": "get_weather", "parameters": PARIS})
               + "; " + json.dumps({"name": "add", "parameters": SUM})),
    "mistral": ("[TOOL_CALLS]", "Checking.[TOOL_CALLS]get_weather[ARGS]" + json.dumps(PARIS)
                + "[TOOL_CALLS]add[ARGS]" + json.dumps(SUM)),
    "deepseekv31": ("<｜tool▁calls▁begin｜>", "Checking."
                 + DS.format("get_weather", json.dumps(PARIS))
                 + DS[len("<｜tool▁calls▁begin｜>"):].format("add", json.dumps(SUM))
                 + "<｜tool▁calls▁end｜>"),
}  # fmt: skip
CONTENT = {"qwen25": "Checking.", "llama3": None, "mistral": "Checking.",
           "deepseekv31": "Checking."}  # fmt: skip
CALLS = [("get_weather", PARIS), ("add", SUM)]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def server(request: Any, tmp_path_factory: Any) -> Iterator[tuple[str, str, openai.OpenAI]]:
    family = request.param
    path = Path(tmp_path_factory.mktemp("tpl")) / "echo.jinja"
    marker = FAMILIES[family][0]
    # the comment shows the template's formats; tools are rendered by nothing else
    path.write_text("{#- tools " + marker + " <think> -#}{{ messages[-1]['content'] }}<|im_end|>")
    with lifecycle_server("--scripted-worker", "--chat-template", str(path)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
        yield family, url, client


def _body(url: str, text: str, **extra: Any) -> dict[str, Any]:
    end = httpx.post(url + "/tokenize", json={"prompt": "<|im_end|>"}).json()["tokens"]
    return {"model": "m", "messages": [{"role": "user", "content": text}], "tools": TOOLS,
            "max_tokens": 400, "extra_body": {"stop_token_ids": end, **extra}}  # fmt: skip


def _calls(calls: Any) -> list[tuple[str, Any]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls or ()]


def test_unary_reasoning_and_calls(server: tuple[str, str, openai.OpenAI]) -> None:
    family, url, client = server
    r = client.chat.completions.create(**_body(url, THINK + FAMILIES[family][1]))
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.model_extra["reasoning_content"] == "The user wants two things."
    assert choice.message.content == CONTENT[family]
    assert _calls(choice.message.tool_calls) == CALLS
    ids = [c.id for c in choice.message.tool_calls or ()]
    if family == "mistral":  # Mistral's templates take ids of 9 letters and digits only
        assert all(len(i) == 9 and i.isalnum() for i in ids), ids
    else:
        assert all(i.startswith("call_") for i in ids), ids
    think = httpx.post(url + "/tokenize", json={"prompt": THINK.rstrip()}).json()["tokens"]
    assert r.usage is not None and r.usage.completion_tokens_details is not None
    assert r.usage.completion_tokens_details.reasoning_tokens == len(think)


def test_streamed_reasoning_and_calls(server: tuple[str, str, openai.OpenAI]) -> None:
    family, url, client = server
    body = _body(url, THINK + FAMILIES[family][1])
    reasoning, content, finish = "", "", None
    calls: dict[int, dict[str, str]] = {}
    for chunk in client.chat.completions.create(**body, stream=True):
        for c in chunk.choices:
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or ():
                if tc.id is not None:  # id and name come first
                    assert tc.index not in calls and tc.function and tc.function.name
                    calls[tc.index] = {"name": tc.function.name, "arguments": ""}
                if tc.function and tc.function.arguments:
                    calls[tc.index]["arguments"] += tc.function.arguments
            finish = c.finish_reason or finish
    assert reasoning == "The user wants two things."
    assert (content or None) == CONTENT[family]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == CALLS
    assert finish == "tool_calls"


def test_a_call_cut_by_max_tokens_leaves_no_markup(
    server: tuple[str, str, openai.OpenAI],
) -> None:
    """Cut inside the second call: the first stays, the cut one too with its arguments
    as far as written (finish ``length``, as OpenAI's), and nothing of its markup is in
    the content."""
    family, url, client = server
    text = FAMILIES[family][1]
    cut = text[: text.rindex('"b"')]  # inside the second call's arguments
    ids = httpx.post(url + "/tokenize", json={"prompt": cut}).json()["tokens"]
    body = {**_body(url, text), "max_tokens": len(ids)}
    r = client.chat.completions.create(**body)
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content == CONTENT[family]
    first, cut_call = choice.message.tool_calls or []
    assert _calls([first]) == CALLS[:1] and cut_call.function.name == "add"
    assert json.dumps(SUM).startswith(cut_call.function.arguments), cut_call
    assert cut_call.function.arguments.startswith('{"a": 1')
    streamed = "".join(
        c.delta.content or ""
        for chunk in client.chat.completions.create(**body, stream=True)
        for c in chunk.choices
    )
    assert (streamed or None) == CONTENT[family]


def test_separate_reasoning_false_keeps_it_in_content(
    server: tuple[str, str, openai.OpenAI],
) -> None:
    family, url, client = server
    if family != "qwen25":
        pytest.skip("one family is enough")
    body = _body(url, THINK + "Plain answer.", separate_reasoning=False)
    body.pop("tools")
    message = client.chat.completions.create(**body).choices[0].message
    assert message.content == THINK + "Plain answer."
    assert "reasoning_content" not in (message.model_extra or {})


def test_responses_api_reasoning_item(server: tuple[str, str, openai.OpenAI]) -> None:
    family, url, client = server
    if family != "qwen25":
        pytest.skip("one family is enough")
    # no stop_token_ids here: the limit ends the echo right after the text
    ids = httpx.post(url + "/tokenize", json={"prompt": THINK + "Four."}).json()["tokens"]
    kw: dict[str, Any] = {"model": "m", "input": THINK + "Four.", "max_output_tokens": len(ids)}
    r = client.responses.create(**kw)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "The user wants two things."  # type: ignore[union-attr,index]
    assert r.output_text == "Four."
    assert r.usage is not None and r.usage.output_tokens_details.reasoning_tokens > 0
    events = list(client.responses.create(**kw, stream=True))
    deltas = "".join(
        getattr(e, "delta", "") for e in events if e.type == "response.reasoning_text.delta"
    )
    assert deltas == "The user wants two things."
    # The limit ended the echo: response.completed carrying status incomplete (docs/api.md:
    # what SGLang sends and the official client's stream helper reads)
    done = events[-1]
    assert done.type == "response.completed" and done.response.status == "incomplete"
    assert [item.type for item in done.response.output] == ["reasoning", "message"]


def test_model_info_names_the_formats_in_effect(server: tuple[str, str, openai.OpenAI]) -> None:
    """Detected from the template (no option given): its marker's family, and qwen3's
    <think> reasoning."""
    family, url, _ = server
    info = httpx.get(url + "/model_info", timeout=10).json()
    assert (info["reasoning_parser"], info["tool_call_parser"]) == ("qwen3", family)


def test_generate_meta_info_counts_reasoning_tokens(
    server: tuple[str, str, openai.OpenAI],
) -> None:
    """``/generate`` reports ``meta_info.reasoning_tokens`` as SGLang does: the output's
    tokens through the end tag under the reasoning format in effect (here qwen3's, from
    the template), unary and in a stream's frames; 0 for an output that opens none."""
    _, url, _ = server
    think = httpx.post(url + "/tokenize", json={"prompt": THINK.rstrip()}).json()["tokens"]
    text = THINK + "Plain answer."
    n = len(httpx.post(url + "/tokenize", json={"prompt": text}).json()["tokens"])
    body = {"text": text, "sampling_params": {"max_new_tokens": n}}
    meta = httpx.post(url + "/generate", json=body, timeout=30).json()["meta_info"]
    assert (meta["completion_tokens"], meta["reasoning_tokens"]) == (n, len(think))
    with httpx.stream("POST", url + "/generate", json={**body, "stream": True}) as r:
        frames = [json.loads(line[6:]) for line in r.iter_lines() if line[6:].startswith("{")]
    counts = [f["meta_info"]["reasoning_tokens"] for f in frames]
    assert counts == sorted(counts) and counts[-1] == len(think), counts
    plain = {"text": "Plain answer.", "sampling_params": {"max_new_tokens": 3}}
    meta = httpx.post(url + "/generate", json=plain, timeout=30).json()["meta_info"]
    assert meta["reasoning_tokens"] == 0


@pytest.fixture(scope="module", params=sorted(REASONING_PARSERS))
def parser_server(request: Any, tmp_path_factory: Any) -> Iterator[tuple[str, str, openai.OpenAI]]:
    """A server with ``--reasoning-parser NAME`` and the echo template (no tools)."""
    path = Path(tmp_path_factory.mktemp("tpl")) / "echo.jinja"
    path.write_text("{{ messages[-1]['content'] }}<|im_end|>")
    with lifecycle_server("--scripted-worker", "--chat-template", str(path),
                          "--reasoning-parser", request.param) as url:  # fmt: skip
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
        yield request.param, url, client


def test_every_reasoning_parser_unary_and_streamed(
    parser_server: tuple[str, str, openai.OpenAI],
) -> None:
    """Each ``--reasoning-parser`` on a reply in its family's format, through the real
    server and the official client: a forced one (DeepSeek-R1, Qwen3-Thinking, ...)
    starts inside the reasoning, so its reply has no start tag; Kimi's tags are its own.
    The reasoning and the answer come apart the same way unary and streamed, and the
    usage counts the reasoning's tokens, its tags included."""
    name, url, client = parser_server
    fmt = REASONING_PARSERS[name]
    thought = f"{fmt.start}\n" if not fmt.forced else ""
    thought += f"The user wants two things.\n{fmt.end}"
    end = httpx.post(url + "/tokenize", json={"prompt": "<|im_end|>"}).json()["tokens"]
    body = {"model": "m", "messages": [{"role": "user", "content": thought + "\n\nAnswer."}],
            "max_tokens": 200, "extra_body": {"stop_token_ids": end}}  # fmt: skip
    r = client.chat.completions.create(**body)
    message = r.choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == (
        "The user wants two things.", "Answer.",
    ), name  # fmt: skip
    ids = httpx.post(url + "/tokenize", json={"prompt": thought}).json()["tokens"]
    assert r.usage is not None and r.usage.completion_tokens_details is not None
    assert r.usage.completion_tokens_details.reasoning_tokens == len(ids), name
    reasoning = content = ""
    for chunk in client.chat.completions.create(**body, stream=True):
        for c in chunk.choices:
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            content += c.delta.content or ""
    assert (reasoning, content) == ("The user wants two things.", "Answer."), name
