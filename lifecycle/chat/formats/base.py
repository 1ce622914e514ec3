"""What every tool-call format shares (``lifecycle.chat.tool_formats`` lists them): the
reading contract, the JSON scanning helpers and the argument renderings.

A format reads one call region two ways. ``take(buf, final)`` decides the region: None
while more text is needed, else a ``Take`` (how much text it used, whether it is a call at
all, the calls read whole). ``partial(buf, schemas)`` reads the calls begun so far as
``Partial`` (the name, and the arguments as JSON text so far) and is *monotone*: for a
longer text the calls are the same ones, more may follow, and each call's arguments text
only grows. The parser streams arguments as the difference between two readings, so the
fragments of a text split anywhere add up to the arguments read from the whole text.
Nothing here does I/O.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lifecycle.core.detok import held_back
from wire.grammar import JSON_SEPARATORS

__all__ = [
    "COMPACT",
    "WHITESPACE",
    "Partial",
    "Schemas",
    "Take",
    "ToolFormat",
    "args_text",
    "json_end",
    "json_text",
    "lark_string",
    "loads",
    "named",
    "object_call",
    "skip",
]

WHITESPACE = " \t\r\n"  # JSON's whitespace, what may surround a call
Schemas = Mapping[str, Mapping[str, Any]]  # a tool's name -> its parameters' JSON schema
# The arguments JSON written exactly as json.dumps writes it, as for response_format.
COMPACT = {
    "whitespace_flexible": False,
    "item_separator": JSON_SEPARATORS[0],
    "key_separator": JSON_SEPARATORS[1],
}


@dataclass(frozen=True, slots=True)
class Take:
    """What ``ToolFormat.take`` read from the front of a region."""

    used: int  # characters of the buffer read
    calls: tuple[tuple[str, Any], ...] = ()  # (name, arguments as written)
    ok: bool = True  # False: buf[:used] is no call, content as written
    cut: bool = False  # the text ended inside a call


@dataclass(frozen=True, slots=True)
class Partial:
    """A call begun in a region: its name, and its arguments as JSON text so far."""

    name: str
    arguments: str


# a string (its closing quote as group 1; None: the text ends inside it), or a bracket;
# matched by the regex engine so a long string value costs no Python loop per character
_JSON_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*(")?|[\[\]{}]', re.DOTALL)


def json_end(text: str, start: int) -> int | None:
    """The index after the JSON object or array opening at ``text[start]``; None when
    the text ends first."""
    depth = 0
    for m in _JSON_TOKEN.finditer(text, start):
        c = m.group()
        if c[0] == '"':
            if m.group(1) is None:
                return None
        elif c in "{[":
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                return m.end()
    return None


_STRING_OR_NOT = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)|[^"]+', re.DOTALL)
_BLANKS = re.compile(r"[ \t\r\n]+")


def json_text(raw: str) -> str:
    """JSON text (or its beginning) with the whitespace between tokens as ``json.dumps``
    writes it (``", "``, ``": "``, none elsewhere); strings, numbers and literals as
    written. Each character maps on its own, so the rendering of a prefix is a prefix of
    the rendering of the whole: arguments stream as they arrive."""
    out = []
    for piece in _STRING_OR_NOT.findall(raw):
        if piece.startswith('"'):
            out.append(piece)
        else:
            out.append(_BLANKS.sub("", piece).replace(",", ", ").replace(":", ": "))
    return "".join(out)


def loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def named(obj: Any, *keys: str) -> tuple[str, Any] | None:
    """``(name, arguments)`` of ``{"name": ..., <key>: {...}}`` (the first key present)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in keys:
        if key in obj:
            return obj["name"], obj[key]
    return obj["name"], {}


def skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


# {"name": "f", "arguments": {  -- the name first, then an arguments object (streamable)
_NAME_FIRST = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)'
)


def args_text(buf: str, start: int, stop: str = "") -> str:
    """The arguments object opening at ``buf[start]`` as JSON text so far: up to its end,
    or up to ``stop`` (the marker that ends the region, met first in malformed JSON),
    or to the end of ``buf`` less what may begin ``stop``."""
    end = json_end(buf, start)
    at = buf.find(stop, start) if stop else -1
    if end is not None and (at < 0 or end <= at):
        return json_text(buf[start:end])
    if at >= 0:
        return json_text(buf[start:at])
    return json_text(buf[start : len(buf) - held_back(buf, (stop,))] if stop else buf[start:])


def object_call(buf: str, start: int, stop: str = "") -> tuple[Partial, int | None] | None:
    """The call begun by ``{"name": ..., "arguments": {...`` at ``buf[start:]``, and
    where its arguments object ends (None: not yet); None when it does not begin so
    (``stop`` as for ``args_text``)."""
    m = _NAME_FIRST.match(buf, start)
    if m is None:
        return None
    name = loads(f'"{m.group(1)}"')
    if not isinstance(name, str):
        return None
    return Partial(name, args_text(buf, m.end(), stop)), json_end(buf, m.end())


def lark_string(text: str) -> str:
    return json.dumps(text)  # a Lark string literal has JSON's escapes


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

    def partial(self, buf: str, schemas: Schemas) -> tuple[Partial, ...]:
        """The calls begun in the region ``buf`` (which starts with an opener)."""
        return ()

    def call_parts(self, name: str) -> tuple[str, str]:
        """The text a call of ``name`` writes before and after its arguments object."""
        raise NotImplementedError

    def write(self, name: str, arguments: Mapping[str, Any]) -> str:
        """One call as the family writes it (what the grammar admits)."""
        head, tail = self.call_parts(name)
        return head + json.dumps(arguments, ensure_ascii=False) + tail

    def call_rule(self, name: str, parameters: Mapping[str, Any]) -> str:
        """The Lark body of one call of ``name`` whose arguments match ``parameters``: its
        fixed text around ``%json`` of the schema (kept as the root of its own schema, so
        its ``$ref``s resolve)."""
        schema = {"type": "object", **parameters, "x-guidance": COMPACT}
        head, tail = self.call_parts(name)
        return f"{lark_string(head)} %json {json.dumps(schema)} {lark_string(tail)}"
