"""Responses bodies (``POST /v1/responses``) as the chat body they mean (docs/api.md).

A Responses body becomes a ``/v1/chat/completions`` body (``chat_body``), checked by the
same ``parse_chat`` and rendered by the same chat template: ``input`` (a string, or a
list of messages with text parts) is the messages, ``instructions`` a system message
first, ``max_output_tokens`` chat's ``max_completion_tokens``, ``text.format`` its
``response_format`` and ``reasoning.effort`` its ``reasoning_effort``; ``model``,
``stream`` and the sampling fields keep their names, and the fields the reply only
echoes (``metadata``, ``user``, ...) are accepted. Function tools, written flat, are
nested as chat writes them; ``function_call`` and ``function_call_output`` input items
are the assistant's ``tool_calls`` and ``tool`` messages. What it cannot serve
(``previous_response_id``: responses are not stored; ``background``, built-in tools,
non-text parts, an unknown field the process's policy refuses) is a 400 that says so,
raised as ``OpenAIError``. The route and its reply are ``lifecycle.api.responses``.
"""

from __future__ import annotations

from typing import Any

from lifecycle.core.fields import accept_unknown
from lifecycle.faces.openai_errors import OpenAIError

__all__ = ["chat_body", "reasoning_effort"]

# Responses field -> chat completions field (same meaning).
_SAME = ("model", "temperature", "top_p", "presence_penalty", "frequency_penalty", "seed",
         "stream", "top_k", "min_p", "repetition_penalty", "stop", "logit_bias")  # fmt: skip
_ECHOED = ("metadata", "user", "parallel_tool_calls", "truncation", "store", "service_tier")
_ACCEPTED = {"input", "instructions", "max_output_tokens", "text", "tools", "tool_choice",
             "reasoning", "previous_response_id", "include", "background", "prompt_cache_key",
             *_SAME, *_ECHOED}  # fmt: skip


def _bad(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(message, 400, param=param)


def chat_body(body: Any) -> dict[str, Any]:
    """The ``/v1/chat/completions`` body a Responses request means; raises OpenAIError."""
    if not isinstance(body, dict):
        raise _bad("The request body must be a JSON object.")
    for key in body:
        if key not in _ACCEPTED and not accept_unknown("/v1/responses", key):
            raise _bad(f"Unrecognized request argument supplied: {key}", key)
    if body.get("previous_response_id") is not None:
        raise _bad("previous_response_id is not supported: responses are not stored.",
                   "previous_response_id")  # fmt: skip
    if body.get("background"):
        raise _bad("background responses are not supported.", "background")
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    response_format = _format(fmt)
    messages = _messages(body.get("input"))
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _bad("instructions must be a string.", "instructions")
        messages.insert(0, {"role": "system", "content": instructions})
    chat: dict[str, Any] = {"messages": messages, **_tool_fields(body)}
    for key in _SAME:
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if reasoning_effort(body) is not None:  # chat's reasoning_effort: the template's variables
        chat["reasoning_effort"] = reasoning_effort(body)
    if response_format is not None:
        chat["response_format"] = response_format
    return chat


def reasoning_effort(body: dict[str, Any]) -> Any:
    """``reasoning.effort``, the Responses API's name for chat's ``reasoning_effort``."""
    reasoning = body.get("reasoning")
    return reasoning.get("effort") if isinstance(reasoning, dict) else None


def _format(fmt: Any) -> dict[str, Any] | None:
    """``text.format`` -> chat's ``response_format``: the Responses API writes the JSON
    schema's fields (name, schema, strict) beside its type, chat nests them."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise _bad("text.format must have type 'text', 'json_object' or 'json_schema'.",
               "text.format")  # fmt: skip


def _tool_fields(body: dict[str, Any]) -> dict[str, Any]:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` as chat writes them: a
    Responses function tool is flat (``name``, ``parameters`` beside ``type``), chat's is
    nested under ``function``. Built-in tools (web search, files, ...) are refused."""
    out: dict[str, Any] = {}
    raw = body.get("tools")
    if raw is not None:
        if not isinstance(raw, list):
            raise _bad("tools must be a list.", "tools")
        tools = []
        for i, tool in enumerate(raw):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise _bad(f"tools[{i}]: only tools of type 'function' are supported, "
                           f"got {kind!r}.", "tools")  # fmt: skip
            fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
            tools.append({"type": "function", "function": fn})
        if tools:
            out["tools"] = tools
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None and out.get("tools"):
        out["tool_choice"] = choice
    if body.get("parallel_tool_calls") is not None and out.get("tools"):
        out["parallel_tool_calls"] = body["parallel_tool_calls"]
    return out


def _tool_items(item: dict[str, Any], i: int, out: list[dict[str, Any]]) -> None:
    """A ``function_call`` input item joins the assistant message before it (or opens
    one); a ``function_call_output`` is a ``tool`` message."""
    if item["type"] == "function_call":
        call = {"id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")}}  # fmt: skip
        if out and out[-1]["role"] == "assistant" and out[-1].get("_calls"):
            out[-1]["tool_calls"].append(call)
        else:
            out.append({"role": "assistant", "content": None, "tool_calls": [call], "_calls": True})
        return
    output = item.get("output")
    if not isinstance(output, str):
        raise _bad(f"input[{i}].output must be a string.", "input")
    out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})


def _messages(raw: Any) -> list[dict[str, Any]]:
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise _bad("input must be a string or a non-empty list of messages.", "input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(raw):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind in ("function_call", "function_call_output"):
            _tool_items(item, i, out)
            continue
        if kind != "message":
            raise _bad(f"input[{i}]: only messages, function_call and function_call_output "
                       "items are supported.", "input")  # fmt: skip
        content = item.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in ("input_text", "output_text", "text"):
                    raise _bad(f"input[{i}].content: only text parts are supported.", "input")
                parts.append({"type": "text", "text": part.get("text")})
            content = parts
        out.append({"role": item.get("role"), "content": content})
    for m in out:
        m.pop("_calls", None)
    return out
