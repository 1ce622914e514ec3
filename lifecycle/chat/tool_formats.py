"""Each model family's tool-call format (docs/tools.md, "Formats"): how a call is
found in the text, read back, and written by the grammar of a forcing ``tool_choice``.

A format names the texts that open a call region (``openers``, anywhere in the content;
``lead_openers``, only at the start of the output or right after a call) and reads one
region with ``take(buf, final)``: ``buf`` starts with an opener; the answer is None while
more text is needed, else a ``Take`` (the characters used, the calls found as
``(name, arguments)``, or ``ok=False`` for text that is not a call; ``cut=True`` for a
call the text ended inside of). ``tools.ToolCallParser`` drives it as the text streams.
Nothing here does I/O.

==========  ==================================================================================
hermes      ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`` (Hermes, Qwen)
llama3      ``{"name": "f", "parameters": {...}}`` at the start, or after ``<|python_tag|>``;
            several separated by ``;`` (Llama 3.1-3.3 JSON tool calling)
mistral     ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`` (v3 tokenizers) and
            ``[TOOL_CALLS]f[ARGS]{...}`` (v11+; ``[CALL_ID]id`` after the name is skipped)
deepseek    ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\\n```json\\n{...}\\n```
            <｜tool▁call▁end｜><｜tool▁calls▁end｜>`` (V3, R1) and V3.1's ``...begin｜>f<｜tool▁sep｜>{...}``
==========  ==================================================================================
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

__all__ = [
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "TOOL_FORMATS",
    "WHITESPACE",
    "Take",
    "ToolFormat",
    "detect_tool_format",
    "json_end",
    "tool_format",
]

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = (
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
)
WHITESPACE = " \t\r\n"  # JSON's whitespace, what may surround a call


@dataclass(frozen=True, slots=True)
class Take:
    """What ``ToolFormat.take`` read from the front of a region."""

    used: int  # characters of the buffer read
    calls: tuple[tuple[str, Any], ...] = ()  # (name, arguments as written)
    ok: bool = True  # False: buf[:used] is no call, content as written
    cut: bool = False  # the text ended inside a call


def json_end(text: str, start: int) -> int | None:
    """The index after the JSON object or array opening at ``text[start]``; None when
    the text ends first."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _named(obj: Any, *keys: str) -> tuple[str, Any] | None:
    """``(name, arguments)`` of ``{"name": ..., <key>: {...}}`` (the first key present)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in keys:
        if key in obj:
            return obj["name"], obj[key]
    return obj["name"], {}


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


class ToolFormat:
    """One family's format; subclasses read and write it."""

    name = ""
    openers: tuple[str, ...] = ()
    lead_openers: tuple[str, ...] = ()
    between = ""  # characters between two calls, dropped (besides whitespace)
    special = False  # the markers are special tokens: the text must keep them
    id_chars = 0  # a call id of this many letters and digits; 0: OpenAI's call_ + 24
    # the grammar: prefix, then calls joined by separator, then suffix
    prefix, separator, suffix = "", "\n", ""

    def take(self, buf: str, final: bool) -> Take | None:
        raise NotImplementedError

    def call_parts(self, name: str) -> tuple[str, str]:
        """The text a call of ``name`` writes before and after its arguments object."""
        raise NotImplementedError

    def write(self, name: str, arguments: str) -> str:
        head, tail = self.call_parts(name)
        return head + arguments + tail


class Hermes(ToolFormat):
    name = "hermes"
    openers = (TOOL_CALL_OPEN,)

    def take(self, buf: str, final: bool) -> Take | None:
        end = buf.find(TOOL_CALL_CLOSE)
        if end < 0 and not final:
            return None
        body = buf[len(TOOL_CALL_OPEN) : end if end >= 0 else len(buf)]
        call = _named(_loads(body), "arguments")
        used = end + len(TOOL_CALL_CLOSE) if end >= 0 else len(buf)
        if call is None:  # an unclosed block that does not parse: cut short
            return Take(used, ok=False, cut=end < 0)
        return Take(used, (call,))

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

    def take(self, buf: str, final: bool) -> Take | None:
        start = _skip(buf, len(PYTHON_TAG) if buf.startswith(PYTHON_TAG) else 0)
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
        call = _named(_loads(buf[start:end]), "parameters", "arguments")
        return Take(end, (call,)) if call is not None else Take(end, ok=False)

    def call_parts(self, name: str) -> tuple[str, str]:
        return f'{{"name": {json.dumps(name)}, "parameters": ', "}"


class Mistral(ToolFormat):
    name = "mistral"
    openers = (MISTRAL_CALLS,)
    special = True
    id_chars = 9  # Mistral's templates refuse a tool history with other ids
    prefix, separator, suffix = MISTRAL_CALLS + "[", ", ", "]"

    def take(self, buf: str, final: bool) -> Take | None:
        start = _skip(buf, len(MISTRAL_CALLS))
        if start == len(buf):
            return Take(len(buf), cut=True) if final else None
        if buf[start] == "[":  # the list form
            end = json_end(buf, start)
            if end is None:
                return Take(len(buf), ok=False, cut=True) if final else None
            items = _loads(buf[start:end])
            calls = [_named(c, "arguments") for c in items] if isinstance(items, list) else [None]
            if not calls or None in calls:
                return Take(end, ok=False)
            return Take(end, tuple(c for c in calls if c is not None))
        args = buf.find(MISTRAL_ARGS, start)
        if args < 0:
            return Take(len(buf), ok=False, cut=True) if final else None
        name = buf[start:args].split(MISTRAL_ID)[0].strip()
        body = _skip(buf, args + len(MISTRAL_ARGS))
        if body == len(buf):
            return Take(len(buf), ok=False, cut=True) if final else None
        end = json_end(buf, body) if buf[body] == "{" else body
        if end is None:
            return Take(len(buf), ok=False, cut=True) if final else None
        arguments = _loads(buf[body:end])
        if not name or arguments is None:
            return Take(max(end, args + len(MISTRAL_ARGS)), ok=False)
        return Take(end, ((name, arguments),))

    def call_parts(self, name: str) -> tuple[str, str]:
        return f'{{"name": {json.dumps(name)}, "arguments": ', "}"


_FENCE = re.compile(r"^\s*```(?:json)?\s*\n?(.*?)\n?\s*```\s*$", re.DOTALL)


class DeepSeek(ToolFormat):
    name = "deepseek"
    openers = (DS_CALLS_BEGIN, DS_CALL_BEGIN, DS_CALLS_END)
    special = True
    prefix, separator, suffix = DS_CALLS_BEGIN, "\n", DS_CALLS_END

    def take(self, buf: str, final: bool) -> Take | None:
        for marker in (DS_CALLS_BEGIN, DS_CALLS_END):  # the list's markers: dropped
            if buf.startswith(marker):
                return Take(len(marker))
        end = buf.find(DS_CALL_END)
        if end < 0:
            return Take(len(buf), ok=False, cut=True) if final else None
        used = end + len(DS_CALL_END)
        head, sep, rest = buf[len(DS_CALL_BEGIN) : end].partition(DS_SEP)
        if not sep:
            return Take(used, ok=False)
        if head.strip() == "function":  # V3 / R1: the name, then the arguments fenced
            name, _, rest = rest.partition("\n")
        else:  # V3.1: the name before the separator, the arguments bare
            name = head
        fenced = _FENCE.match(rest)
        arguments = _loads(fenced.group(1) if fenced else rest)
        if not name.strip() or arguments is None:
            return Take(used, ok=False)
        return Take(used, ((name.strip(), arguments),))

    def call_parts(self, name: str) -> tuple[str, str]:
        return (f"{DS_CALL_BEGIN}function{DS_SEP}{name}\n```json\n", f"\n```{DS_CALL_END}")


TOOL_FORMATS: dict[str, ToolFormat] = {
    f.name: f for f in (Hermes(), Llama3(), Mistral(), DeepSeek())
}
# SGLang's --tool-call-parser names for the same formats
_ALIASES = {"qwen": "hermes", "qwen25": "hermes", "llama4": "llama3", "deepseekv3": "deepseek",
            "deepseekv31": "deepseek", "deepseek-r1": "deepseek"}  # fmt: skip


def tool_format(name: str) -> ToolFormat:
    """The format of a ``--tool-call-parser`` name; ``ValueError`` names the known ones."""
    fmt = TOOL_FORMATS.get(_ALIASES.get(name, name))
    if fmt is None:
        known = ", ".join([*TOOL_FORMATS, *_ALIASES])
        raise ValueError(f"unknown tool-call parser {name!r} (known: {known})")
    return fmt


# What a template writes when it renders a family's calls, first match wins.
_MARKERS = (
    ("deepseek", ("tool▁calls▁begin", "tool▁call▁begin")),
    ("mistral", (MISTRAL_CALLS,)),
    ("hermes", (TOOL_CALL_OPEN,)),
    ("llama3", (PYTHON_TAG, "ipython")),
)


def detect_tool_format(template_source: str | None) -> ToolFormat:
    """The format a chat template's text shows; Hermes when it shows none (the format
    ``tool_prompt`` asks for when the template does not render tools itself)."""
    for name, markers in _MARKERS:
        if template_source and any(m in template_source for m in markers):
            return TOOL_FORMATS[name]
    return TOOL_FORMATS["hermes"]
