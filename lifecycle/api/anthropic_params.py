"""Anthropic Messages bodies (``/v1/messages``, ``/v1/messages/count_tokens``) as the
chat body they mean, and Anthropic's error envelope (docs/api.md, "Messages API").

A Messages body becomes a ``/v1/chat/completions`` body, checked by the same
``parse_chat`` and rendered by the same chat template: ``system`` (a string or text
blocks) is a system message first; a ``tool_result`` block is a ``tool`` message that
answers its ``tool_use_id``; an assistant's ``tool_use`` blocks are its ``tool_calls``
and its ``thinking`` its reasoning; a trailing assistant message is a prefill
(``continue_final_message``: the reply continues it). ``tools`` (``input_schema``) are
chat's function tools, ``tool_choice`` ``auto`` / ``any`` / ``tool`` / ``none`` chat's
``auto`` / ``required`` / a named function / ``none``, ``disable_parallel_tool_use``
``parallel_tool_calls: false``. ``thinking`` is the template's ``enable_thinking`` and
its ``budget_tokens`` chat's ``thinking_token_budget``. Image and document blocks are
refused (a text model).

Errors are raised as ``OpenAIError`` (one error class for every request parser) and
answered in Anthropic's envelope (``anthropic_reply``): ``{"type": "error", "error":
{"type": "invalid_request_error", "message": ...}}``, the type named by the status.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson

from lifecycle.core.fields import accept_unknown
from lifecycle.core.states import Cause
from lifecycle.faces.openai_errors import OpenAIError
from transport import JSONResponse, Response

__all__ = [
    "ANTHROPIC_ROUTES",
    "anthropic_error",
    "anthropic_reply",
    "error_event",
    "error_type",
    "messages_chat_body",
]

ANTHROPIC_ROUTES = frozenset({"/v1/messages", "/v1/messages/count_tokens"})

# Messages field -> chat completions field (same meaning).
_SAME = {"model": "model", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
         "stream": "stream", "stop_sequences": "stop"}  # fmt: skip
# Accepted and ignored: bookkeeping that changes nothing here (no prompt-cache control,
# no tiers).
_IGNORED = ("metadata", "service_tier", "cache_control", "inference_geo")
_ACCEPTED = frozenset({"messages", "system", "max_tokens", "tools", "tool_choice",
                       "output_config", "thinking", *_SAME, *_IGNORED})  # fmt: skip
_NOT_READ = ("image", "document", "search_result", "container_upload")

# HTTP status -> Anthropic's error type (docs.anthropic.com, "Errors").
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
          503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}  # fmt: skip
OVERLOADED_STATUS = 529  # Anthropic's status for an overloaded server (ours is 503)


def _bad(message: str) -> OpenAIError:
    return OpenAIError(message, 400)


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status."""
    return _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def _envelope(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def anthropic_error(exc: OpenAIError) -> Response:
    headers = [("retry-after", str(exc.retry_after))] if exc.retry_after else None
    status = OVERLOADED_STATUS if exc.code == Cause.OVERLOADED.value else exc.status
    return JSONResponse(_envelope(status, exc.message), status, headers)


def anthropic_reply(response: Response) -> Response:
    """An error answered in OpenAI's shape (the shared call helpers', the API-key
    check's) in Anthropic's envelope, its headers kept; any other response as it is."""
    if response.status < 400 or response.status == 499:  # 499: nobody reads it
        return response
    try:
        err = orjson.loads(response.body).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        err = None
    err = err if isinstance(err, dict) else {}
    message = err.get("message") if isinstance(err.get("message"), str) else None
    status = response.status
    if err.get("code") == Cause.OVERLOADED.value:
        status = OVERLOADED_STATUS
    body = _envelope(status, message or f"HTTP {response.status}")
    headers = [h for h in response.headers if h[0] != "content-type"]
    return JSONResponse(body, status, headers)


def error_event(cause: Cause, message: str) -> dict[str, Any]:
    """A stream's ``error`` event after the stream began."""
    status = OVERLOADED_STATUS if cause is Cause.OVERLOADED else cause.status
    return _envelope(status, message)


def messages_chat_body(body: Any, *, count: bool = False) -> dict[str, Any]:
    """The ``/v1/chat/completions`` body a Messages body means (``count``: a
    ``count_tokens`` body, which has no ``max_tokens``); raises ``OpenAIError``."""
    if not isinstance(body, dict):
        raise _bad("The request body must be a JSON object.")
    where = "/v1/messages/count_tokens" if count else "/v1/messages"
    for key in body:
        if key not in _ACCEPTED and not accept_unknown(where, key):
            raise _bad(f"{key}: Extra inputs are not permitted")
    messages = _system(body.get("system")) + _messages(body.get("messages"))
    chat: dict[str, Any] = {"messages": messages, **_tool_fields(body), **_thinking(body)}
    if messages[-1]["role"] == "assistant":
        chat["continue_final_message"] = True  # a prefill: the reply continues it
    stops = body.get("stop_sequences")
    if stops is not None and (not isinstance(stops, list)
                              or not all(isinstance(x, str) for x in stops)):  # fmt: skip
        raise _bad("stop_sequences: must be a list of strings")
    for key, name in _SAME.items():
        if body.get(key) is not None:
            chat[name] = body[key]
    if not count:
        max_tokens = body.get("max_tokens")
        if max_tokens is None:
            raise _bad("max_tokens: Field required")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise _bad(f"max_tokens: must be an integer of at least 1, got {max_tokens!r}")
        chat["max_tokens"] = max_tokens
    response_format = _output_format(body.get("output_config"))
    if response_format is not None:
        chat["response_format"] = response_format
    return chat


def _text(raw: Any, where: str) -> str | list[dict[str, str]]:
    """A string, or text blocks as chat's text parts (one block: its text)."""
    if isinstance(raw, str):
        return raw
    if not isinstance(raw, list):
        raise _bad(f"{where}: must be a string or a list of content blocks")
    parts = []
    for at, kind, block in _blocks(raw, where):
        if kind != "text" or not isinstance(block.get("text"), str):
            raise _bad(f"{at}: expected a text block with a string text")
        parts.append({"type": "text", "text": block["text"]})
    return parts[0]["text"] if len(parts) == 1 else parts


def _blocks(blocks: list[Any], where: str) -> Iterator[tuple[str, Any, Any]]:
    """``(where, type, block)`` of each content block; an image or a document is a 400."""
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in _NOT_READ:
            raise _bad(f"{where}.{j}: {kind} content blocks are not supported: this server's "
                       "model reads text only.")  # fmt: skip
        yield f"{where}.{j}", kind, block


def _system(raw: Any) -> list[dict[str, Any]]:
    if raw is None:
        return []
    return [{"role": "system", "content": _text(raw, "system")}]


def _messages(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise _bad("messages: must be a non-empty list of messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(raw):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise _bad(f"messages.{i}.role: Input should be 'user' or 'assistant'")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif not isinstance(content, list):
            raise _bad(f"messages.{i}.content: must be a string or a list of content blocks")
        elif role == "user":
            out += _user(content, f"messages.{i}.content")
        else:
            out.append(_assistant(content, f"messages.{i}.content"))
    return out


def _user(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    """A user turn: its tool results as ``tool`` messages, then its text (if any)."""
    answers: list[dict[str, Any]] = []
    texts: list[Any] = []
    for at, kind, block in _blocks(blocks, where):
        if kind == "text":
            texts.append(block)
        elif kind == "tool_result":
            content = block.get("content")
            text = _text(content if content is not None else "", f"{at}.content")
            answers.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": text})  # fmt: skip
        else:
            raise _bad(f"{at}: a user message holds text and tool_result blocks, "
                       f"got {kind!r}")  # fmt: skip
    return answers + ([{"role": "user", "content": _text(texts, where)}] if texts else [])


def _assistant(blocks: list[Any], where: str) -> dict[str, Any]:
    """An assistant turn: its text, ``tool_use`` blocks as tool calls, ``thinking`` as
    its reasoning (which the template may render)."""
    texts: list[Any] = []
    calls: list[dict[str, Any]] = []
    thinking: list[str] = []
    for at, kind, block in _blocks(blocks, where):
        if kind == "text":
            texts.append(block)
        elif kind == "tool_use":
            args = block.get("input", {})
            if not isinstance(block.get("id"), str) or not isinstance(args, dict):
                raise _bad(f"{at}: a tool_use block needs an id, a name and an input "
                           "object")  # fmt: skip
            calls.append({"id": block["id"], "type": "function", "function": {
                "name": block.get("name"), "arguments": orjson.dumps(args).decode()}})  # fmt: skip
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            thinking.append(block["thinking"])
        elif kind != "redacted_thinking":
            raise _bad(f"{at}: an assistant message holds text, tool_use and thinking "
                       f"blocks, got {kind!r}")  # fmt: skip
    out: dict[str, Any] = {"role": "assistant", "content": _text(texts, where) if texts else ""}
    if calls:
        out["tool_calls"] = calls
    if thinking:
        out["reasoning_content"] = "\n".join(thinking)
    return out


def _tool_fields(body: dict[str, Any]) -> dict[str, Any]:
    """``tools`` and ``tool_choice`` as chat writes them."""
    raw = body.get("tools")
    if raw is None:
        return {}
    if not isinstance(raw, list):
        raise _bad("tools: must be a list of tools")
    tools = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict) or tool.get("type", "custom") not in ("custom", None):
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise _bad(f"tools.{i}: only custom tools (name, input_schema) are supported, "
                       f"got type {kind!r}")  # fmt: skip
        fn = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        tools.append({"type": "function", "function": fn})
    out: dict[str, Any] = {"tools": tools} if tools else {}
    choice = body.get("tool_choice")
    if choice is None:
        return out
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise _bad("tool_choice: type must be 'auto', 'any', 'tool' or 'none'")
    if kind == "tool":
        out["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    else:
        out["tool_choice"] = {"any": "required"}.get(kind, kind)
    if choice.get("disable_parallel_tool_use") is True and kind != "none":
        out["parallel_tool_calls"] = False
    return out


def _thinking(body: dict[str, Any]) -> dict[str, Any]:
    """``thinking`` as chat's fields: ``enabled`` turns the template's thinking on
    (``enable_thinking``, which Qwen3's, DeepSeek's and GLM's templates read) with its
    ``budget_tokens`` as the thinking budget (``thinking_token_budget``); ``disabled``
    turns it off; ``adaptive`` turns it on without a budget. Anthropic's floor of 1024
    budget tokens is not kept: a small local model may be given less."""
    raw = body.get("thinking")
    if raw is None:
        return {}
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind not in ("enabled", "disabled", "adaptive"):
        raise _bad("thinking.type: must be 'enabled', 'disabled' or 'adaptive'")
    chat: dict[str, Any] = {"chat_template_kwargs": {"enable_thinking": kind != "disabled"}}
    if kind == "enabled":
        budget = raw.get("budget_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise _bad(f"thinking.budget_tokens: must be an integer of at least 0, got "
                       f"{budget!r}")  # fmt: skip
        chat["thinking_token_budget"] = budget
    return chat


def _output_format(raw: Any) -> dict[str, Any] | None:
    """``output_config.format`` (structured outputs: a JSON schema) as chat's
    ``response_format``; its ``effort`` changes nothing here."""
    if raw is None:
        return None
    fmt = raw.get("format") if isinstance(raw, dict) else None
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise _bad("output_config.format: type must be 'json_schema'")
    return {"type": "json_schema", "json_schema": {"name": "output",
                                                   "schema": fmt.get("schema")}}  # fmt: skip
