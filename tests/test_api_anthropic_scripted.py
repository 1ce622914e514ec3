"""``/v1/messages`` against a real server and the scripted worker, which echoes its
prompt cyclically: a reasoning model's output (the template shows ``<think>``, so the
qwen3 reasoning parser is on) comes back as a ``thinking`` block before the ``text``
block, unary and streamed alike; an abort (``/abort_request``) is an error, never a
stop reason that passes the cut reply off as finished."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from lifecycle.testing.pytest_plugin import LiveServer, start_server

# the comment shows the template's <think>: the qwen3 reasoning parser is on
TEMPLATE = "{#- <think> -#}{{ messages[-1]['content'] }}"
THINK = "<think>\nhmm\n</think>\n\nHello there."


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    path = Path(tmp_path_factory.mktemp("tpl")) / "echo.jinja"
    path.write_text(TEMPLATE)
    args = ("--scripted-worker", "--chat-template", str(path),
            "--worker-args", "--step-delay 0.01")  # fmt: skip
    with start_server(*args) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


def _body(prompt: str, max_tokens: int) -> dict[str, Any]:
    return {"model": "m", "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": prompt}]}  # fmt: skip


def test_reasoning_is_a_thinking_block_unary_and_streamed(client: anthropic.Anthropic) -> None:
    body = _body(THINK, 20)  # the prompt is 15 tokens: all of it, then its start again
    r = client.messages.create(**body)
    assert [b.type for b in r.content] == ["thinking", "text"], r
    thinking, text = r.content[0], r.content[1]
    assert thinking.thinking == "hmm" and thinking.signature == ""  # type: ignore[union-attr]
    assert text.text.startswith("Hello there.")  # type: ignore[union-attr]
    assert r.stop_reason == "max_tokens"
    events = list(client.messages.create(**body, stream=True))
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "text"]
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == "hmm"
    assert "".join(d.text for d in deltas if d.type == "text_delta") == text.text  # type: ignore[union-attr]
    with client.messages.stream(**body) as stream:
        final = stream.get_final_message()
    assert [b.model_dump(exclude={"parsed_output"}) for b in final.content] == [
        b.model_dump() for b in r.content
    ]


def _abort_soon(server: LiveServer) -> threading.Timer:
    def abort() -> None:
        httpx.post(server.url + "/abort_request", json={"abort_all": True}, timeout=10)

    timer = threading.Timer(0.3, abort)
    timer.start()
    return timer


def test_an_aborted_stream_ends_with_an_error_event(server: LiveServer) -> None:
    timer = _abort_soon(server)
    body = {**_body("one two three four five", 500), "stream": True}
    r = httpx.post(server.url + "/v1/messages", json=body, timeout=60)
    timer.join()
    lines = r.text.splitlines()
    names = [x[len("event: ") :] for x in lines if x.startswith("event:")]
    assert names[0] == "message_start" and "content_block_delta" in names
    assert names[-1] == "error" and "message_stop" not in names, names[-4:]
    last = json.loads(next(x for x in reversed(lines) if x.startswith("data:"))[len("data: ") :])
    assert last["error"] == {"type": "api_error", "message": (
        "The request was aborted (/abort_request) before it finished.")}  # fmt: skip


def test_an_aborted_unary_request_is_an_api_error(client: anthropic.Anthropic,
                                                  server: LiveServer) -> None:  # fmt: skip
    timer = _abort_soon(server)
    with pytest.raises(anthropic.InternalServerError) as info:
        client.messages.create(**_body("one two three four five", 500))
    timer.join()
    assert info.value.status_code == 500
    assert info.value.body["error"]["type"] == "api_error"  # type: ignore[index]
