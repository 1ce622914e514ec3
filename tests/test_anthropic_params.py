"""The Messages API's cores without a server: a Messages body read as the chat body it
means, the stream's content blocks from chat deltas, stop reasons, Anthropic's error
envelope, and the SSE framing of a named event (exact bytes)."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from lifecycle.api.anthropic import _Blocks, stop_reason
from lifecycle.api.anthropic_params import anthropic_reply, error_event, messages_chat_body
from lifecycle.core.states import Cause
from lifecycle.faces.openai_errors import OpenAIError
from transport import JSONResponse, SSEEvent
from transport.sse import frame_event

USER = {"role": "user", "content": "Weather in Paris?"}
TOOL = {"name": "get_weather", "description": "The weather.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}  # fmt: skip


def test_a_conversation_with_a_tool_round_trip_is_the_chat_body() -> None:
    body = {
        "model": "m", "max_tokens": 8, "system": [{"type": "text", "text": "Be brief."}],
        "stop_sequences": ["END"], "temperature": 0, "top_k": 5, "metadata": {"user_id": "u"},
        "tools": [TOOL], "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [
            USER,
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Call it.", "signature": "s"},
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"},
                {"type": "text", "text": "And tomorrow?"}]},
        ],
    }  # fmt: skip
    chat = messages_chat_body(body)
    assert chat == {
        "model": "m", "max_tokens": 8, "stop": ["END"], "temperature": 0, "top_k": 5,
        "tools": [{"type": "function", "function": {
            "name": "get_weather", "parameters": TOOL["input_schema"],
            "description": "The weather."}}],
        "tool_choice": "required", "parallel_tool_calls": False,
        "messages": [
            {"role": "system", "content": "Be brief."},
            USER,
            {"role": "assistant", "content": "Let me look.", "reasoning_content": "Call it.",
             "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
                 "name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny"},
            {"role": "user", "content": "And tomorrow?"},
        ],
    }  # fmt: skip


@pytest.mark.parametrize(
    ("choice", "chat"),
    [
        ({"type": "auto"}, {"tool_choice": "auto"}),
        ({"type": "none"}, {"tool_choice": "none"}),
        ({"type": "tool", "name": "get_weather"},
         {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
        ({"type": "auto", "disable_parallel_tool_use": True},
         {"tool_choice": "auto", "parallel_tool_calls": False}),
    ],
)  # fmt: skip
def test_tool_choice_is_chats(choice: Any, chat: Any) -> None:
    body = {"max_tokens": 4, "messages": [USER], "tools": [TOOL], "tool_choice": choice}
    out = messages_chat_body(body)
    assert {k: out[k] for k in chat} == chat and out.keys() - chat.keys() == {
        "messages", "max_tokens", "tools"}  # fmt: skip


def test_a_trailing_assistant_message_is_a_prefill() -> None:
    body = {"max_tokens": 4, "messages": [USER, {"role": "assistant", "content": "It is"}]}
    assert messages_chat_body(body)["continue_final_message"] is True
    assert "continue_final_message" not in messages_chat_body({**body, "messages": [USER]})


def test_count_tokens_needs_no_max_tokens() -> None:
    assert "max_tokens" not in messages_chat_body({"messages": [USER]}, count=True)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"max_tokens": None}, "max_tokens: Field required"),
        ({"max_tokens": 0}, "max_tokens: must be an integer of at least 1, got 0"),
        ({"messages": [{"role": "system", "content": "x"}]},
         "messages.0.role: Input should be 'user' or 'assistant'"),
        ({"messages": []}, "messages: must be a non-empty list of messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
         "messages.0.content.0: image content blocks are not supported: this server's model "
         "reads text only."),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                     "content": [{"type": "document"}]}]}]},
         "messages.0.content.0.content.0: document content blocks are not supported: this "
         "server's model reads text only."),
        ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t"}]}]},
         "messages.0.content.0: a user message holds text and tool_result blocks, got "
         "'tool_use'"),
        ({"stop_sequences": "END"}, "stop_sequences: must be a list of strings"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
         "tools.0: only custom tools (name, input_schema) are supported, got type "
         "'web_search_20250305'"),
        ({"tools": [TOOL], "tool_choice": {"type": "required"}},
         "tool_choice: type must be 'auto', 'any', 'tool' or 'none'"),
    ],
)  # fmt: skip
def test_bad_bodies_say_what_is_wrong(change: dict[str, Any], message: str) -> None:
    body = {k: v for k, v in {"max_tokens": 4, "messages": [USER], **change}.items()
            if v is not None}  # fmt: skip
    with pytest.raises(OpenAIError) as info:
        messages_chat_body(body)
    assert (info.value.status, info.value.message) == (400, message)


def _events(blocks: _Blocks, *deltas: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    out = [e for d in deltas for e in blocks.events(d)] + blocks.close()
    return [(e.name, json.loads(e.data)) for e in out]


def test_stream_blocks_follow_the_deltas() -> None:
    """Reasoning, text and a call streamed in fragments (the arguments of a call may
    come whole or in pieces: each non-empty piece is one input_json_delta)."""
    head = {"index": 0, "id": "call_abc", "type": "function",
            "function": {"name": "get_weather", "arguments": ""}}  # fmt: skip
    got = _events(_Blocks(), {"reasoning_content": "Hmm"}, {"reasoning_content": "."},
                  {"content": "Hi"}, {"tool_calls": [head]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]})  # fmt: skip
    assert [(n, e.get("index"), (e.get("delta") or e.get("content_block") or {}).get("type"))
            for n, e in got] == [
        ("content_block_start", 0, "thinking"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, "text"),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, "tool_use"),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None),
    ]  # fmt: skip
    assert got[7][1]["content_block"] == {"type": "tool_use", "id": "toolu_abc",
                                          "name": "get_weather", "input": {}}  # fmt: skip
    partial = "".join(e["delta"]["partial_json"] for n, e in got[8:10])
    assert json.loads(partial) == {"city": "Paris"}
    assert all(e["type"] == n for n, e in got)


@pytest.mark.parametrize(
    ("finish", "called", "expected"),
    [
        ({"type": "length"}, True, ("max_tokens", None)),
        ({"type": "stop", "matched": 2}, True, ("tool_use", None)),
        ({"type": "stop", "matched": "END"}, False, ("stop_sequence", "END")),
        ({"type": "stop", "matched": "<|im_end|>"}, False, ("end_turn", None)),
        ({"type": "stop", "matched": 2}, False, ("end_turn", None)),
    ],
)
def test_stop_reasons(finish: Any, called: bool, expected: tuple[str, str | None]) -> None:
    assert stop_reason(finish, called, ("END",)) == expected


def test_errors_in_anthropics_envelope() -> None:
    overloaded = OpenAIError.from_cause(Cause.OVERLOADED, "busy")
    overloaded.retry_after = 1
    reply = anthropic_reply(JSONResponse(overloaded.body(), 503, [("retry-after", "1")]))
    assert reply.status == 529 and ("retry-after", "1") in reply.headers
    assert orjson.loads(reply.body) == {
        "type": "error", "error": {"type": "overloaded_error", "message": "busy"}}  # fmt: skip
    for status, kind in [(400, "invalid_request_error"), (401, "authentication_error"),
                         (404, "not_found_error"), (413, "request_too_large"),
                         (500, "api_error"), (504, "timeout_error")]:  # fmt: skip
        body = orjson.loads(anthropic_reply(JSONResponse({"error": {"message": "m"}}, status)).body)
        assert body == {"type": "error", "error": {"type": kind, "message": "m"}}
    assert error_event(Cause.DEADLINE, "late")["error"] == {"type": "timeout_error",
                                                            "message": "late"}  # fmt: skip


def test_a_named_event_is_framed_with_its_type() -> None:
    assert frame_event(SSEEvent("ping", b'{"type": "ping"}')) == (
        b'event: ping\ndata: {"type": "ping"}\n\n'
    )
    assert frame_event(SSEEvent("x", "a\nb")) == b"event: x\ndata: a\ndata: b\n\n"
