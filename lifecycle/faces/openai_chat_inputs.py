"""What a ``/v1/chat/completions`` body gives the chat template, checked once at the edge:
its ``messages`` as the template reads them (role and content, a ``name``, an assistant's
``tool_calls`` and reasoning, a tool message's ``tool_call_id``), and its variables
(``chat_template_kwargs``, and those its ``reasoning_effort`` sets). ``parse_chat``
(``openai_params``) checks the rest of the body and calls these; their refusals are
``OpenAIError``s, 400 with ``param`` the field at fault, as its own are.
"""

from __future__ import annotations

from typing import Any

from lifecycle.chat.tool_params import check_tool_answers, message_tool_calls
from lifecycle.faces.openai_errors import OpenAIError
from modelfile.chat import RESERVED_VARIABLES

__all__ = ["REASONING_EFFORTS", "chat_messages", "reasoning_variables", "template_kwargs"]

# OpenAI's reasoning_effort values, as the official SDK types them (its newer versions
# send "none", "minimal", "xhigh" and "max" too; DeepSeek V4's template reads "max").
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
_REASONING = ("reasoning_content", "reasoning", "thinking")  # an assistant turn's, by any name


def _bad(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(message, 400, param=param)


def _content(message: dict[str, Any], i: int) -> str | list[dict[str, str]]:
    """The text, or the list of text parts (the template decides: ``tool_prompt``)."""
    content = message.get("content")
    if content is None:
        return ""  # beside tool_calls: "" (vLLM's), which templates render; null breaks some
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise _bad(f"messages[{i}].content: only text parts are supported.", "messages")
            text = part.get("text")
            if not isinstance(text, str):
                raise _bad(f"messages[{i}].content: a text part needs a string text.", "messages")
            parts.append({"type": "text", "text": text})
        return parts
    raise _bad(f"messages[{i}].content must be a string or a list of parts.", "messages")


def chat_messages(raw: Any) -> list[dict[str, Any]]:
    """The messages as the chat template expects them: role and content (text or text
    parts), a ``name``, an assistant's ``tool_calls`` and reasoning, a tool message's
    ``tool_call_id`` (``tool_params``)."""
    if not isinstance(raw, list) or not raw:
        raise _bad("messages must be a non-empty list.", "messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(raw):
        role = m.get("role") if isinstance(m, dict) else None
        if not isinstance(role, str) or role not in _ROLES:
            raise _bad(
                f"messages[{i}] must be an object with a role in {sorted(_ROLES)}.", "messages"
            )
        role = "system" if role == "developer" else role
        message: dict[str, Any] = {"role": role, "content": _content(m, i)}
        if isinstance(m.get("name"), str):
            message["name"] = m["name"]
        if role == "assistant" and m.get("tool_calls") is not None:
            message["tool_calls"] = message_tool_calls(m["tool_calls"], i)
        for field in _REASONING if role == "assistant" else ():
            if isinstance(m.get(field), str):
                message[field] = m[field]  # the template reads it (modelfile/chat.py)
        if role == "tool":
            message["tool_call_id"] = m.get("tool_call_id")
        out.append(message)
    check_tool_answers(out)
    return out


def reasoning_variables(effort: str) -> dict[str, Any]:
    """The chat template variables a reasoning effort sets: ``reasoning_effort`` itself
    (gpt-oss', Solar's, Cohere's, DeepSeek V4's templates read it) and
    ``enable_thinking`` (Qwen3's, DeepSeek's, GLM's, SmolLM3's...), false only for
    ``none``. Every chat-shaped API maps its own control onto these (issue 56, point 4)."""
    return {"reasoning_effort": effort, "enable_thinking": effort != "none"}


def _reasoning_effort(body: dict[str, Any]) -> str | None:
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise _bad(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got "
                   f"{effort!r}.", "reasoning_effort")  # fmt: skip
    return effort


def template_kwargs(body: dict[str, Any]) -> dict[str, Any] | None:
    """``chat_template_kwargs``: extra variables for the chat template (vLLM's and
    SGLang's), e.g. Qwen3's ``enable_thinking``; the ones the server sets are refused.
    ``reasoning_effort`` adds its variables (``reasoning_variables``) under them: a
    variable the client sets in ``chat_template_kwargs`` wins."""
    raw = body.get("chat_template_kwargs")
    effort = _reasoning_effort(body)
    if raw is None:
        return None if effort is None else reasoning_variables(effort)
    if not isinstance(raw, dict):
        raise _bad("chat_template_kwargs must be an object.", "chat_template_kwargs")
    if clash := sorted(RESERVED_VARIABLES & raw.keys()):
        raise _bad(f"chat_template_kwargs cannot set {clash}: the server sets them.",
                   "chat_template_kwargs")  # fmt: skip
    return raw if effort is None else {**reasoning_variables(effort), **raw}
