"""The formats that write each call as a JSON object with its name and arguments:
Qwen2.5/Hermes' ``<tool_call>`` blocks, Llama 3's bare JSON, Mistral's ``[TOOL_CALLS]``
and Phi-4-mini's ``functools[...]`` (the table in ``lifecycle.chat.tool_formats``)."""

from __future__ import annotations

import json
import re

from lifecycle.chat.formats.base import (
    Partial,
    Schemas,
    Take,
    ToolFormat,
    json_end,
    json_text,
    loads,
    named,
    object_call,
    skip,
)

__all__ = [
    "MISTRAL_CALLS",
    "PYTHON_TAG",
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "Llama3",
    "Mistral",
    "Phi4MiniJson",
    "Qwen25",
]

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
FUNCTOOLS = "functools"


def _list_take(buf: str, start: int, final: bool) -> Take | None:
    """A JSON list of ``{"name", "arguments"}`` objects at ``buf[start]``."""
    end = json_end(buf, start)
    if end is None:
        return Take(len(buf), ok=False, cut=True) if final else None
    items = loads(buf[start:end])
    calls = [named(c, "arguments", "parameters") for c in items] if isinstance(items, list) else []
    if not calls or None in calls:
        return Take(end, ok=False)
    return Take(end, tuple(c for c in calls if c is not None))


def _list_partial(buf: str, start: int) -> tuple[Partial, ...]:
    """The calls begun in the JSON list at ``buf[start]`` (``[`` included)."""
    out: list[Partial] = []
    i = start + 1
    while True:
        found = object_call(buf, i)
        if found is None:
            return tuple(out)
        out.append(found[0])
        end = json_end(buf, skip(buf, i))  # the object's end
        if end is None:
            return tuple(out)
        i = skip(buf, end)
        if i >= len(buf) or buf[i] != ",":
            return tuple(out)
        i += 1


class Qwen25(ToolFormat):
    name = "qwen25"
    openers = (TOOL_CALL_OPEN,)

    def take(self, buf: str, final: bool) -> Take | None:
        end = buf.find(TOOL_CALL_CLOSE)
        if end < 0 and not final:
            return None
        body = buf[len(TOOL_CALL_OPEN) : end if end >= 0 else len(buf)]
        call = named(loads(body), "arguments")
        used = end + len(TOOL_CALL_CLOSE) if end >= 0 else len(buf)
        if call is None:  # an unclosed block that does not parse: cut short
            return Take(used, ok=False, cut=end < 0)
        return Take(used, (call,))

    def partial(self, buf: str, schemas: Schemas) -> tuple[Partial, ...]:
        found = object_call(buf, len(TOOL_CALL_OPEN), TOOL_CALL_CLOSE)
        return (found[0],) if found is not None else ()

    def call_parts(self, name: str) -> tuple[str, str]:
        return (f'{TOOL_CALL_OPEN}\n{{"name": {json.dumps(name)}, "arguments": ',
                f"}}\n{TOOL_CALL_CLOSE}")  # fmt: skip


_CALL_HEAD = '{"name":'


class Llama3(ToolFormat):
    name = "llama3"
    openers = (PYTHON_TAG,)
    lead_openers = ("{",)
    between = ";"
    special = True
    separator = ";"

    def _start(self, buf: str) -> int:
        return skip(buf, len(PYTHON_TAG) if buf.startswith(PYTHON_TAG) else 0)

    def take(self, buf: str, final: bool) -> Take | None:
        start = self._start(buf)
        if start == len(buf):
            return Take(len(buf), cut=True) if final else None
        if buf[start] != "{":
            return Take(start or 1, ok=False)  # <|python_tag|> then code: content
        end = json_end(buf, start)
        if end is None:
            if not final:
                return None
            # a JSON answer the limit cut stays content; a call it cut (or may have) does not
            head = re.sub(r"\s+", "", buf[start : start + 64])
            return Take(len(buf), ok=False, cut=_CALL_HEAD.startswith(head[:8]))
        call = named(loads(buf[start:end]), "parameters", "arguments")
        return Take(end, (call,)) if call is not None else Take(end, ok=False)

    def partial(self, buf: str, schemas: Schemas) -> tuple[Partial, ...]:
        found = object_call(buf, self._start(buf))
        return (found[0],) if found is not None else ()

    def call_parts(self, name: str) -> tuple[str, str]:
        return f'{{"name": {json.dumps(name)}, "parameters": ', "}"


class Mistral(ToolFormat):
    name = "mistral"
    openers = (MISTRAL_CALLS,)
    special = True
    id_chars = 9  # Mistral's templates refuse a tool history with other ids
    prefix, separator, suffix = MISTRAL_CALLS + "[", ", ", "]"

    def take(self, buf: str, final: bool) -> Take | None:
        start = skip(buf, len(MISTRAL_CALLS))
        if start == len(buf):
            return Take(len(buf), cut=True) if final else None
        if buf[start] == "[":  # the list form
            return _list_take(buf, start, final)
        args = buf.find(MISTRAL_ARGS, start)
        if args < 0:
            return Take(len(buf), ok=False, cut=True) if final else None
        name = buf[start:args].split(MISTRAL_ID)[0].strip()
        body = skip(buf, args + len(MISTRAL_ARGS))
        if body == len(buf):
            return Take(len(buf), ok=False, cut=True) if final else None
        end = json_end(buf, body) if buf[body] == "{" else body
        if end is None:
            return Take(len(buf), ok=False, cut=True) if final else None
        arguments = loads(buf[body:end])
        if not name or arguments is None:
            return Take(max(end, args + len(MISTRAL_ARGS)), ok=False)
        return Take(end, ((name, arguments),))

    def partial(self, buf: str, schemas: Schemas) -> tuple[Partial, ...]:
        start = skip(buf, len(MISTRAL_CALLS))
        if start < len(buf) and buf[start] == "[":
            return _list_partial(buf, start)
        args = buf.find(MISTRAL_ARGS, start)
        body = skip(buf, args + len(MISTRAL_ARGS)) if args >= 0 else len(buf)
        if body == len(buf) or buf[body] != "{":
            return ()
        name = buf[start:args].split(MISTRAL_ID)[0].strip()
        end = json_end(buf, body)
        return (Partial(name, json_text(buf[body : end if end is not None else len(buf)])),)

    def call_parts(self, name: str) -> tuple[str, str]:
        return f'{{"name": {json.dumps(name)}, "arguments": ', "}"


class Phi4MiniJson(ToolFormat):
    """vLLM's ``phi4_mini_json``: ``functools[{"name": ..., "arguments": {...}}, ...]``."""

    name = "phi4_mini_json"
    openers = (FUNCTOOLS,)
    prefix, separator, suffix = FUNCTOOLS + "[", ", ", "]"

    def take(self, buf: str, final: bool) -> Take | None:
        start = skip(buf, len(FUNCTOOLS))
        if start == len(buf):
            return Take(len(buf), ok=False, cut=True) if final else None
        if buf[start] != "[":
            return Take(len(FUNCTOOLS), ok=False)  # the word in prose
        return _list_take(buf, start, final)

    def partial(self, buf: str, schemas: Schemas) -> tuple[Partial, ...]:
        start = skip(buf, len(FUNCTOOLS))
        return _list_partial(buf, start) if buf[start : start + 1] == "[" else ()

    def call_parts(self, name: str) -> tuple[str, str]:
        return f'{{"name": {json.dumps(name)}, "arguments": ', "}"
