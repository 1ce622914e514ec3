"""Anthropic's Messages API with the real model (SmolLM2-135M) through the official
``anthropic`` client: one server process for the module, run with ``--api-key`` (the
client sends it as ``x-api-key``). The client (1.13) no longer has ``temperature`` among
its arguments (Anthropic's newest models refuse it); greedy requests send it as
``extra_body``, as a client of an older API version sends it in the body."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from .scripted import lifecycle_server
from .tool_cases import WEATHER

pytestmark = [pytest.mark.model, pytest.mark.timeout(300)]

KEY = "sk-anthropic-test"
GREEDY = {"temperature": 0}
ASK: Any = [{"role": "user", "content": "Name three colours."}]
WEATHER_TOOL: Any = {"name": "get_weather", "description": "The current weather in a city.",
                     "input_schema": WEATHER}  # fmt: skip


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with lifecycle_server(
        "--device", "cpu", "--max-running", "8", "--api-key", KEY, "--open-admin-routes"
    ) as base:
        yield base


@pytest.fixture(scope="module")
def client(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=120)


def _create(client: anthropic.Anthropic, **kw: Any) -> Any:
    body: dict[str, Any] = {"model": "default", "messages": ASK, "max_tokens": 16,
                            "extra_body": GREEDY, **kw}  # fmt: skip
    return client.messages.create(**body)


def _text(message: Any) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


@pytest.fixture(scope="module")
def greedy(client: anthropic.Anthropic) -> Any:
    return _create(client)


def test_create_is_a_message(greedy: Any) -> None:
    assert greedy.type == "message" and greedy.role == "assistant"
    assert greedy.id.startswith("msg_")
    assert [b.type for b in greedy.content] == ["text"] and _text(greedy)
    assert greedy.stop_reason in ("end_turn", "max_tokens")
    assert greedy.stop_sequence is None
    u = greedy.usage
    assert u.output_tokens > 0 and u.input_tokens + (u.cache_read_input_tokens or 0) > 0


def test_greedy_is_repeatable(client: anthropic.Anthropic, greedy: Any) -> None:
    again = _create(client)
    assert _text(again) == _text(greedy)
    assert again.usage.output_tokens == greedy.usage.output_tokens
    assert again.id != greedy.id


def test_system_as_string_and_as_blocks(client: anthropic.Anthropic, greedy: Any) -> None:
    system = "You are a pirate."
    as_string = _create(client, system=system)
    as_blocks = _create(client, system=[{"type": "text", "text": system}])
    assert _text(as_string) == _text(as_blocks)
    counts = [
        client.messages.count_tokens(model="default", messages=ASK, system=s).input_tokens
        for s in (system, [{"type": "text", "text": system}], system + " Arr!")
    ]
    assert counts[0] == counts[1] < counts[2]  # the system prompt is rendered, as given


def test_stop_reasons(client: anthropic.Anthropic, greedy: Any) -> None:
    cut = _create(client, max_tokens=3)
    assert (cut.stop_reason, cut.usage.output_tokens) == ("max_tokens", 3)
    short = [{"role": "user", "content": "What is 2+2?"}]  # answered in a dozen tokens
    long = _create(client, messages=short, max_tokens=128)
    assert long.stop_reason == "end_turn", long
    text = _text(long)
    word = " " + text.split()[3]
    stopped = _create(client, messages=short, max_tokens=128, stop_sequences=["zzzz", word])
    assert stopped.stop_reason == "stop_sequence"
    assert stopped.stop_sequence == word
    assert _text(stopped) == text[: text.index(word)]


def test_count_tokens_equals_the_prompt(client: anthropic.Anthropic, url: str) -> None:
    count = client.messages.count_tokens(model="default", messages=ASK)
    assert httpx.post(url + "/flush_cache", headers={"x-api-key": KEY}).status_code == 200
    first = _create(client)
    assert (first.usage.input_tokens, first.usage.cache_read_input_tokens) == (
        count.input_tokens,
        0,
    )
    again = _create(client)  # the prefix cache holds the prompt now
    u = again.usage
    assert u.input_tokens + (u.cache_read_input_tokens or 0) == count.input_tokens
    assert (u.cache_read_input_tokens or 0) > 0


def test_stream_events_and_text_equal_unary(client: anthropic.Anthropic) -> None:
    greedy = _create(client)  # the unary reply, on the prefix cache the stream finds too
    body: dict[str, Any] = {"model": "default", "messages": ASK, "max_tokens": 16,
                            "extra_body": GREEDY}  # fmt: skip
    events = list(client.messages.create(**body, stream=True))
    kinds = [e.type for e in events]
    n = len(kinds)
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[2 : n - 3] == ["content_block_delta"] * (n - 5)
    assert kinds[n - 3 :] == ["content_block_stop", "message_delta", "message_stop"]
    assert events[0].message.id.startswith("msg_") and events[0].message.stop_reason is None
    streamed = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert streamed == _text(greedy)
    assert events[-2].delta.stop_reason == greedy.stop_reason
    assert events[-2].usage.output_tokens == greedy.usage.output_tokens
    with client.messages.stream(**body) as stream:
        final = stream.get_final_message()
    assert _text(final) == _text(greedy) and final.stop_reason == greedy.stop_reason


def test_raw_stream_is_named_events_with_a_ping(url: str) -> None:
    body = {"model": "default", "messages": ASK, "max_tokens": 4, "stream": True}
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    # as Claude Code sends it: ?beta=true and an anthropic-beta header
    headers["anthropic-beta"] = "interleaved-thinking-2025-05-14"
    r = httpx.post(url + "/v1/messages?beta=true", json=body, headers=headers, timeout=120)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    names = [line[len("event: ") :] for line in r.text.splitlines() if line.startswith("event:")]
    assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop"


def test_forced_tool_use_then_a_tool_result_turn(client: anthropic.Anthropic) -> None:
    ask: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = {"type": "tool", "name": "get_weather"}
    r = _create(client, messages=ask, tools=[WEATHER_TOOL], tool_choice=forced, max_tokens=64)
    assert r.stop_reason == "tool_use", r
    (call,) = [b for b in r.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    assert set(call.input) == {"city", "unit"}
    streamed = list(client.messages.create(model="default", messages=ask, tools=[WEATHER_TOOL],
                                           tool_choice=forced, max_tokens=64, extra_body=GREEDY,
                                           stream=True))  # fmt: skip
    starts = [e.content_block for e in streamed if e.type == "content_block_start"]
    assert [b.type for b in starts] == ["tool_use"] and starts[0].name == "get_weather"
    partial = "".join(e.delta.partial_json for e in streamed if e.type == "content_block_delta")
    assert json.loads(partial) == call.input
    turn: Any = [*ask, {"role": "assistant", "content": [c.model_dump() for c in r.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                               "content": "Sunny, 21 degrees."}]}]  # fmt: skip
    answer = _create(client, messages=turn, tools=[WEATHER_TOOL], max_tokens=24)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    with_result = client.messages.count_tokens(model="default", messages=turn, tools=[WEATHER_TOOL])
    turn[-1]["content"][0]["content"] = "Sunny, 21 degrees, a light wind from the west."
    longer = client.messages.count_tokens(model="default", messages=turn, tools=[WEATHER_TOOL])
    assert longer.input_tokens > with_result.input_tokens  # the template rendered the result


def test_prefill_is_continued(client: anthropic.Anthropic, greedy: Any) -> None:
    text = _text(greedy)
    head = text[: len(text) // 2].rstrip()
    turn: Any = [*ASK, {"role": "assistant", "content": head}]
    r = _create(client, messages=turn, max_tokens=8)
    assert _text(r) and not _text(r).startswith(head)


@pytest.mark.parametrize(
    "change",
    [
        {"max_tokens": None},
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {
                                "type": "base64",
                                "media_type": "image/png",
                                "data": "iVBORw0KGgo=",
                            },
                        }
                    ],
                }
            ]
        },  # fmt: skip
        {"messages": [{"role": "system", "content": "hi"}]},
    ],
    ids=["missing-max-tokens", "image-block", "bad-role"],
)
def test_invalid_requests_are_bad_request(client: anthropic.Anthropic, change: Any) -> None:
    body: dict[str, Any] = {"model": "default", "messages": ASK, "max_tokens": 8, **change}
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(anthropic.BadRequestError) as info:  # the client's own checks skipped
        client.post("/v1/messages", cast_to=anthropic.types.Message, body=body)
    err = info.value
    assert err.status_code == 400
    assert isinstance(err.body, dict) and err.body["type"] == "error"
    assert err.body["error"]["type"] == "invalid_request_error"
    assert err.body["error"]["message"]


def test_image_block_message_says_text_only(url: str) -> None:
    body = {"model": "default", "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]}  # fmt: skip
    r = httpx.post(url + "/v1/messages", json=body, headers={"x-api-key": KEY})
    assert r.status_code == 400
    assert "image content blocks are not supported" in r.json()["error"]["message"]


def test_wrong_key_is_authentication_error(url: str) -> None:
    wrong = anthropic.Anthropic(base_url=url, api_key="not-the-key", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        wrong.messages.create(model="default", messages=ASK, max_tokens=4)
    assert info.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    bearer = httpx.post(url + "/v1/messages/count_tokens", json={"messages": ASK},
                        headers={"authorization": f"Bearer {KEY}"})  # fmt: skip
    assert bearer.status_code == 200 and bearer.json()["input_tokens"] > 0


def test_reply_id_finds_its_trace(url: str, greedy: Any) -> None:
    r = httpx.get(url + f"/debug/requests/{greedy.id}", headers={"x-api-key": KEY})
    assert r.status_code == 200, r.text
    trace = r.json()
    assert (trace["request_id"], trace["route"]) == (greedy.id.removeprefix("msg_"), "/v1/messages")
    metrics = httpx.get(url + "/metrics", headers={"x-api-key": KEY}).text
    counted = re.search(r'http_requests_total\{endpoint="/v1/messages",method="POST",'
                        r'model_name="[^"]+",status="200"\} (\d+)', metrics)  # fmt: skip
    assert counted is not None and int(counted.group(1)) > 0


def test_a_deadline_mid_stream_is_an_error_event(client: anthropic.Anthropic, url: str) -> None:
    """The stream began (message_start), then the request's deadline passed: an
    ``error`` event ends it, no message_stop; the client raises it."""
    count = [{"role": "user", "content": "Count from 1 to 300, separated by commas."}]
    body = {"model": "default", "messages": count, "max_tokens": 400, "stream": True,
            "temperature": 0}  # fmt: skip
    headers = {"x-api-key": KEY, "x-request-timeout": "0.5"}
    r = httpx.post(url + "/v1/messages", json=body, headers=headers, timeout=120)
    assert r.status_code == 200
    lines = r.text.splitlines()
    names = [line[len("event: ") :] for line in lines if line.startswith("event:")]
    assert names[0] == "message_start" and names[-1] == "error", r.text[-600:]
    assert "message_stop" not in names
    last = json.loads(next(x for x in reversed(lines) if x.startswith("data:"))[len("data: ") :])
    assert last["type"] == "error" and last["error"]["type"] == "timeout_error"
    with pytest.raises(anthropic.APIStatusError) as info:
        sdk = {k: v for k, v in body.items() if k != "temperature"}
        list(client.messages.create(**sdk, extra_body=GREEDY, extra_headers=headers))
    assert info.value.body["error"]["type"] == "timeout_error"  # type: ignore[index]
