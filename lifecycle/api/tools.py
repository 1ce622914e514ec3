"""Tool calls read back from a chat completion's text (docs/tools.md).

The model writes each call as the prompt showed it (``tool_prompt.py``), Hermes/Qwen
style::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A block whose body parses as a JSON object with a ``name`` among the request's tools and
an ``arguments`` object (absent reads as ``{}``) becomes an OpenAI tool call
(``{"id": "call_<24 alphanumerics>", "type": "function", "function": {"name",
"arguments": <the arguments as a JSON string>}}``); any other block (bad JSON, an unknown
name, no closing tag by the end) stays in the content as written. Whitespace touching a
call is dropped; the content is None when nothing else is left.

``ToolCallParser`` reads the text as it streams: content goes out as soon as it cannot be
the start of a ``<tool_call>`` (a possible partial opener, and trailing whitespace, are
held back), a block is held until its ``</tool_call>``, then sent as OpenAI streams a
call: one ``delta.tool_calls`` entry with ``index``, ``id``, ``type``, ``function.name``
and empty ``arguments``, then one with the whole arguments string. ``parse_tool_calls``
runs the same parser over a whole text, so a stream and its unary reply always agree.
"""

from __future__ import annotations

import json
import secrets
import string
from typing import Any

__all__ = [
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "TOOL_RESPONSE_CLOSE",
    "TOOL_RESPONSE_OPEN",
    "ToolCallParser",
    "call_id",
    "parse_tool_calls",
]

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"
_ID_ALPHABET = string.ascii_letters + string.digits


def call_id() -> str:
    """A tool call's id: ``call_`` and 24 random letters and digits (OpenAI's shape)."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


def _partial_opener(text: str) -> int:
    """The length of the longest suffix of ``text`` that starts ``<tool_call>``."""
    for k in range(min(len(text), len(TOOL_CALL_OPEN) - 1), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-k:]):
            return k
    return 0


def _call(body: str, names: frozenset[str]) -> dict[str, Any] | None:
    """The OpenAI tool call a block's body means, or None when it means none."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", {})
    if not isinstance(args, dict):
        return None
    return {
        "id": call_id(),
        "type": "function",
        # json.dumps' separators: what the grammar makes the model write (wire.grammar)
        "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)},
    }


class ToolCallParser:
    """One choice's text, fed in pieces; ``feed`` and ``finish`` return the OpenAI
    ``delta`` objects to send (``{"content": ...}`` or ``{"tool_calls": [...]}``)."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names
        self.calls: list[dict[str, Any]] = []  # the complete calls so far
        self.content = ""  # the content sent so far
        self._buf = ""  # text not decided yet (a partial opener, or a call's body)
        self._in_call = False  # after an opener, waiting for its closer
        self._ws = ""  # whitespace held back: dropped if a call follows
        self._after_call = False  # whitespace right after a call is dropped

    def feed(self, text: str) -> list[dict[str, Any]]:
        self._buf += text
        out: list[dict[str, Any]] = []
        while True:
            if self._in_call:
                end = self._buf.find(TOOL_CALL_CLOSE)
                if end < 0:
                    return out
                body, self._buf = self._buf[:end], self._buf[end + len(TOOL_CALL_CLOSE) :]
                self._in_call = False
                self._close(body, out)
                continue
            start = self._buf.find(TOOL_CALL_OPEN)
            if start < 0:
                keep = _partial_opener(self._buf)
                cut = len(self._buf) - keep
                self._text(self._buf[:cut], out)
                self._buf = self._buf[cut:]
                return out
            self._text(self._buf[:start], out)
            self._buf = self._buf[start + len(TOOL_CALL_OPEN) :]
            self._in_call = True

    def finish(self) -> list[dict[str, Any]]:
        """The text is complete: what was held back goes out as content."""
        out: list[dict[str, Any]] = []
        rest = (TOOL_CALL_OPEN if self._in_call else "") + self._buf
        self._buf, self._in_call = "", False
        self._text(rest, out)
        if self._ws:
            self._emit(self._ws, out)
            self._ws = ""
        return out

    def _close(self, body: str, out: list[dict[str, Any]]) -> None:
        call = _call(body, self.names)
        if call is None:  # not a call: the block is content as written
            self._text(TOOL_CALL_OPEN + body + TOOL_CALL_CLOSE, out)
            return
        self._ws, self._after_call = "", True
        index = len(self.calls)
        self.calls.append(call)
        fn = call["function"]
        head = {"index": index, "id": call["id"], "type": "function",
                "function": {"name": fn["name"], "arguments": ""}}  # fmt: skip
        out.append({"tool_calls": [head]})
        out.append({"tool_calls": [{"index": index, "function": {"arguments": fn["arguments"]}}]})

    def _text(self, text: str, out: list[dict[str, Any]]) -> None:
        """Content known not to be a call; its trailing whitespace waits for what follows."""
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        body = text.rstrip()
        if body:
            self._emit(self._ws + body, out)
            self._ws = ""
        self._ws += text[len(body) :]

    def _emit(self, text: str, out: list[dict[str, Any]]) -> None:
        self.content += text
        out.append({"content": text})


def parse_tool_calls(text: str, names: frozenset[str]) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole completion -> (its content, None when empty; its tool calls)."""
    parser = ToolCallParser(names)
    parser.feed(text)
    parser.finish()
    return parser.content or None, parser.calls
