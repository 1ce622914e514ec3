"""Tool calls read back from a chat completion's text (docs/tools.md).

The model writes each call in its family's format (``tool_formats.py``; Hermes/Qwen's
by default, the one ``tool_prompt.py`` asks for)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A call whose ``name`` is among the request's tools and whose arguments are an object
(absent reads as ``{}``) becomes an OpenAI tool call (``{"id": "call_<24 alphanumerics>",
"type": "function", "function": {"name", "arguments": <the arguments as a JSON string>}}``);
any other block (bad JSON, an unknown name) stays in the content as written. Whitespace
touching a call is dropped; the content is None when nothing else is left.

A call begins once its name is a tool's and its arguments have opened (the format's
``partial`` reads it); from then on it is a call whatever follows. A call the text ends
inside of is never content: cut by the length limit (``truncated``), a begun call is kept
with its arguments as far as written (``finish_reason`` stays "length"), any other is
dropped; when the model stopped on its own it is read as far as it goes.

``ToolCallParser`` reads the text as it streams: content goes out as soon as it cannot be
the start of a call (a possible partial opener, and trailing whitespace, are held back);
``read`` / ``close`` give ``ToolEvent``s, a call's arguments as fragments as they are
written (``stream_deltas``: OpenAI's chunks; Anthropic's ``input_json_delta`` reads the
same events); ``feed`` / ``finish`` give each call whole at its end (``whole_deltas``).
The fragments of any split add up to the arguments of the whole text, and
``parse_tool_calls`` runs the same parser over a whole text, so a stream and its unary
reply always agree.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass
from typing import Any

from lifecycle.chat.tool_formats import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    TOOL_FORMATS,
    WHITESPACE,
    Schemas,
    Take,
    ToolFormat,
)
from lifecycle.core.detok import held_back

__all__ = [
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "TOOL_RESPONSE_CLOSE",
    "TOOL_RESPONSE_OPEN",
    "ArgumentsText",
    "CallEnd",
    "CallStart",
    "ContentText",
    "ToolCallParser",
    "ToolEvent",
    "call_id",
    "parse_tool_calls",
    "stream_deltas",
    "whole_deltas",
]

TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"
_ID_ALPHABET = string.ascii_letters + string.digits


def call_id(chars: int = 0) -> str:
    """A tool call's id: ``call_`` and 24 random letters and digits (OpenAI's shape), or
    ``chars`` of them alone where the family's template demands that (Mistral: 9)."""
    if chars:
        return "".join(secrets.choice(_ID_ALPHABET) for _ in range(chars))
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


def _call(name: str, args: Any, names: frozenset[str], id_chars: int = 0) -> dict[str, Any] | None:
    """The OpenAI tool call a parsed ``(name, arguments)`` means, or None."""
    if isinstance(args, str):  # some families write the arguments as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if name not in names or not isinstance(args, dict):
        return None
    return {
        "id": call_id(id_chars),
        "type": "function",
        # json.dumps' separators: what the grammar makes the model write (wire.grammar)
        "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
    }


@dataclass(frozen=True, slots=True)
class ContentText:
    """Content known not to be a call."""

    text: str


@dataclass(frozen=True, slots=True)
class CallStart:
    """A call begins: its index among the choice's calls, its id and its name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ArgumentsText:
    """The next fragment of a begun call's arguments (JSON text)."""

    index: int
    text: str


@dataclass(frozen=True, slots=True)
class CallEnd:
    """A call is complete: ``call`` is it whole, in OpenAI's shape."""

    index: int
    call: dict[str, Any]


ToolEvent = ContentText | CallStart | ArgumentsText | CallEnd


class ToolCallParser:
    """One choice's text, fed in pieces. ``read`` and ``close`` return ``ToolEvent``s (a
    call's arguments streamed as they are written); ``feed`` and ``finish`` return the
    OpenAI ``delta`` objects of whole calls (``{"content": ...}`` or
    ``{"tool_calls": [...]}``), ``stream_deltas`` those of streamed arguments."""

    def __init__(
        self, names: frozenset[str], fmt: ToolFormat | None = None, schemas: Schemas | None = None
    ) -> None:
        self.names = names
        self.fmt = fmt or TOOL_FORMATS["qwen25"]
        self.schemas: Schemas = schemas or {}
        self.calls: list[dict[str, Any]] = []  # the complete calls so far
        self.content = ""  # the content sent so far
        self._buf = ""  # text not decided yet (a partial opener, or a call region)
        self._region = False  # _buf starts with an opener: a call region being read
        self._at_start = True  # lead openers count here (the output's start, after a call)
        self._ws = ""  # whitespace held back: dropped if a call follows
        self._after_call = False  # whitespace (and separators) right after a call go
        self._open: list[tuple[str, str, str]] = []  # the region's begun calls: id, name, args
        self._base = 0  # the index of the region's first call
        self._read_at = 0  # the region's length when its calls were last read

    def read(self, text: str) -> list[ToolEvent]:
        self._buf += text
        out: list[ToolEvent] = []
        self._run(False, False, out)
        return out

    def close(self, truncated: bool = False) -> list[ToolEvent]:
        """The text is complete (``truncated``: cut by the length limit): a call still
        open is read (a begun one ends with its arguments as far as they were written) or
        dropped, what was held back goes out as content."""
        out: list[ToolEvent] = []
        self._run(True, truncated, out)
        rest, self._buf = self._buf, ""
        self._text(rest, out)
        if self._ws and not self._after_call:
            self._emit(self._ws, out)
        self._ws = ""
        return out

    def feed(self, text: str) -> list[dict[str, Any]]:
        return whole_deltas(self.read(text))

    def finish(self, truncated: bool = False) -> list[dict[str, Any]]:
        return whole_deltas(self.close(truncated))

    def _run(self, final: bool, truncated: bool, out: list[ToolEvent]) -> None:
        while True:
            if self._region:
                # a reading costs the region's length: read again once it grew by a 64th,
                # so a long call costs O(n log n), not O(n^2) (its fragments only coarsen)
                if not final and len(self._buf) - self._read_at < len(self._buf) >> 6:
                    return
                self._read_at = len(self._buf)
                take = self.fmt.take(self._buf, final)
                if take is None:
                    self._stream(self._buf, out)
                    return
                if take.cut and truncated:  # the limit cut a call: no markup in content
                    self._stream(self._buf, out)
                    self._buf, self._region = "", False
                    self._end_calls(out)
                    return
                self._apply(take, out)
                continue
            if self._after_call:
                self._buf = self._buf.lstrip(WHITESPACE + self.fmt.between)
                if not self._buf:
                    return
                self._after_call = False
            start = self._opener(final)
            if start is None:  # wait: what is held may still open a call
                return
            if start < 0:
                # a limit cut inside a marker's multi-byte character leaves U+FFFD
                tail = self._buf.rstrip("\ufffd") if truncated else self._buf
                keep = held_back(tail, self.fmt.openers)
                cut = len(tail) - keep
                self._text(self._buf[:cut], out)
                # the start of a marker the limit cut is dropped too; else it is text
                self._buf = "" if final and truncated else self._buf[cut:]
                if final and not truncated:
                    self._text(self._buf, out)
                    self._buf = ""
                return
            self._text(self._buf[:start], out)
            self._buf, self._region, self._read_at = self._buf[start:], True, 0

    def _opener(self, final: bool) -> int | None:
        """Where the next call region starts (-1: none yet; None: undecided)."""
        buf, fmt = self._buf, self.fmt
        if self._at_start and fmt.lead_openers:
            lead = len(buf) - len(buf.lstrip(WHITESPACE))
            rest = buf[lead:]
            if any(rest.startswith(o) for o in fmt.lead_openers):
                return lead
            if not final and any(o.startswith(rest) for o in fmt.lead_openers):
                return None
            self._at_start = False
        found = [i for i in (buf.find(o) for o in fmt.openers) if i >= 0]
        return min(found) if found else -1

    def _stream(self, region: str, out: list[ToolEvent]) -> None:
        """The calls of tools begun in ``region`` so far: each new one starts (ending the
        one before), each one's arguments grow by what was written since."""
        parts = [p for p in self.fmt.partial(region, self.schemas) if p.name in self.names]
        for k, part in enumerate(parts):
            if k == len(self._open):
                if self._open:
                    self._end_call(k - 1, out)
                else:
                    self._base = len(self.calls)
                self._open.append((call_id(self.fmt.id_chars), part.name, ""))
                out.append(CallStart(self._base + k, self._open[k][0], part.name))
            cid, name, sent = self._open[k]
            if len(part.arguments) > len(sent) and part.arguments.startswith(sent):
                self._open[k] = (cid, name, part.arguments)
                out.append(ArgumentsText(self._base + k, part.arguments[len(sent) :]))

    def _end_call(self, k: int, out: list[ToolEvent]) -> None:
        cid, name, args = self._open[k]
        call = {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
        self.calls.append(call)
        out.append(CallEnd(self._base + k, call))

    def _end_calls(self, out: list[ToolEvent]) -> None:
        """The region is over: its last begun call ends too."""
        if self._open:
            self._end_call(len(self._open) - 1, out)
        self._open = []

    def _apply(self, take: Take, out: list[ToolEvent]) -> None:
        region, self._buf = self._buf[: take.used], self._buf[take.used :]
        self._region = False
        self._stream(region, out)
        if self._open:  # calls begun: the region is theirs, whatever else it holds
            self._end_calls(out)
            self._ws, self._after_call, self._at_start = "", True, True
            return
        calls = [_call(name, args, self.names, self.fmt.id_chars) for name, args in take.calls]
        if not take.ok or None in calls:  # not a call: the region is content as written
            self._at_start = False
            self._text(region, out)
            return
        self._ws, self._after_call, self._at_start = "", True, True
        for call in calls:
            assert call is not None
            index = len(self.calls)
            self.calls.append(call)
            fn = call["function"]
            out += [CallStart(index, call["id"], fn["name"]),
                    ArgumentsText(index, fn["arguments"]), CallEnd(index, call)]  # fmt: skip

    def _text(self, text: str, out: list[ToolEvent]) -> None:
        """Content known not to be a call; its trailing whitespace waits for what follows."""
        body = text.rstrip()
        if body:
            self._emit(self._ws + body, out)
            self._ws = ""
            self._at_start = False
        self._ws += text[len(body) :]

    def _emit(self, text: str, out: list[ToolEvent]) -> None:
        self.content += text
        out.append(ContentText(text))


def whole_deltas(events: list[ToolEvent]) -> list[dict[str, Any]]:
    """OpenAI deltas with each call whole at its end: the head (``index``, ``id``,
    ``type``, ``function.name``, empty ``arguments``), then the whole arguments."""
    out: list[dict[str, Any]] = []
    for e in events:
        if isinstance(e, ContentText):
            out.append({"content": e.text})
        elif isinstance(e, CallEnd):
            fn = e.call["function"]
            out.append({"tool_calls": [_head(e.index, e.call["id"], fn["name"])]})
            out.append({"tool_calls": [{"index": e.index,
                                        "function": {"arguments": fn["arguments"]}}]})  # fmt: skip
    return out


def stream_deltas(events: list[ToolEvent]) -> list[dict[str, Any]]:
    """OpenAI deltas with each call's arguments streamed: the head as the call begins,
    then each fragment as it is written (their concatenation is the call's arguments)."""
    out: list[dict[str, Any]] = []
    for e in events:
        if isinstance(e, ContentText):
            out.append({"content": e.text})
        elif isinstance(e, CallStart):
            out.append({"tool_calls": [_head(e.index, e.id, e.name)]})
        elif isinstance(e, ArgumentsText) and e.text:
            out.append({"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]})
    return out


def _head(index: int, cid: str, name: str) -> dict[str, Any]:
    return {"index": index, "id": cid, "type": "function",
            "function": {"name": name, "arguments": ""}}  # fmt: skip


def parse_tool_calls(
    text: str,
    names: frozenset[str],
    fmt: ToolFormat | None = None,
    truncated: bool = False,
    schemas: Schemas | None = None,
) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole completion -> (its content, None when empty; its tool calls)."""
    parser = ToolCallParser(names, fmt, schemas)
    parser.feed(text)
    parser.finish(truncated)
    return parser.content or None, parser.calls
