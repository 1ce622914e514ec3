"""The pythonic format (SGLang's ``pythonic``, alias ``llama4``): a Python list of calls
with keyword arguments, ``[get_weather(city="Paris"), add(a=1, b=2)]``, as Llama 3.2's
and 4's templates ask for it (Llama 4 may wrap it in ``<|python_start|>`` ...
``<|python_end|>``). Each argument value is a Python literal, read by
``ast.literal_eval`` and written as JSON as soon as its ``,`` or ``)`` arrives."""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from typing import Any

from lifecycle.chat.formats.base import Partial, Schemas, Take, ToolFormat, skip

__all__ = ["PY_END", "PY_START", "Pythonic"]

PY_START, PY_END = "<|python_start|>", "<|python_end|>"
_CALL_OPEN = re.compile(r"\s*([A-Za-z_][\w.-]*)\s*\(")
_KEYWORD = re.compile(r"\s*([A-Za-z_]\w*)\s*=")
_MAYBE_OPEN = re.compile(r"\s*[A-Za-z_][\w.-]*\s*\Z|\s*\Z")


# a quoted string (its closing quote as group 1 or 2), a bracket or a comma
_PY_TOKEN = re.compile(
    r"""'[^'\\\n]*(?:\\.[^'\\\n]*)*(')?|"[^"\\\n]*(?:\\.[^"\\\n]*)*(")?|[()\[\]{},]""",
    re.DOTALL,
)


def _value_end(text: str, i: int) -> int | None:
    """Where the Python literal starting at ``text[i]`` ends: at the ``,`` or ``)`` at
    its own depth (None: the text ends first; -1: a bracket closes what never opened)."""
    depth = 0
    for m in _PY_TOKEN.finditer(text, i):
        c = m.group()
        if c[0] in "'\"":
            if m.group(1) is None and m.group(2) is None:
                # the text ends inside it (maybe inside an escape), or a newline does
                return None if text[m.end() :] in ("", "\\") else -1
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            if depth == 0:
                return m.start() if c == ")" else -1
            depth -= 1
        elif depth == 0:
            return m.start()
    return None


def _literal(text: str) -> tuple[bool, Any]:
    """A Python literal's value (JSON's true / false / null read too)."""
    try:
        return True, ast.literal_eval(text.strip())
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        try:
            return True, json.loads(text)
        except ValueError:
            return False, None


Call = tuple[str, list[tuple[str, Any]], bool]  # name, arguments so far, closed


@dataclass(slots=True)
class _Read:
    """The calls of a list read so far; ``end``: after its ``]`` (None: not yet);
    ``stop``: where it stopped being a call list (None: it has not)."""

    calls: list[Call]
    end: int | None = None
    stop: int | None = None

    @property
    def confirmed(self) -> list[Call]:
        """The calls that are calls whatever follows: an argument or the ``)`` read."""
        return [c for c in self.calls if c[1] or c[2]]


def _read(buf: str, start: int) -> _Read:
    """The calls of the list at ``buf[start]`` (``[``)."""
    read = _Read([])
    i = start + 1
    while True:
        m = _CALL_OPEN.match(buf, i)
        if m is None:
            read.stop = None if _MAYBE_OPEN.fullmatch(buf, i) else i
            return read
        args: list[tuple[str, Any]] = []
        read.calls.append((m.group(1), args, False))
        i = skip(buf, m.end())
        while i < len(buf) and buf[i] != ")":
            key = _KEYWORD.match(buf, i)
            end = _value_end(buf, key.end()) if key is not None else None
            if key is None or end is None or end < 0:
                wait = (key is not None and end is None) or _MAYBE_OPEN.fullmatch(buf, i)
                read.stop = None if wait else i
                return read
            ok, value = _literal(buf[key.end() : end])
            if not ok:
                read.stop = i
                return read
            args.append((key.group(1), value))
            i = skip(buf, end + 1 if buf[end] == "," else end)
        if i == len(buf):
            return read
        read.calls[-1] = (m.group(1), args, True)
        i = skip(buf, i + 1)
        if buf.startswith("]", i):
            read.end = i + 1
            return read
        if not buf.startswith(",", i):
            read.stop = None if i == len(buf) else i
            return read
        i += 1


def _arguments(args: list[tuple[str, Any]], closed: bool) -> str:
    body = ", ".join(f"{json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}" for k, v in args)
    return "{" + body + ("}" if closed else "")


class Pythonic(ToolFormat):
    name = "pythonic"
    openers = ("[", PY_START)
    prefix, separator, suffix = "[", ", ", "]"

    def _start(self, buf: str) -> int:
        return skip(buf, len(PY_START)) if buf.startswith(PY_START) else 0

    def take(self, buf: str, final: bool) -> Take | None:
        start = self._start(buf)
        if not buf.startswith("[", start):
            if start == len(buf) and not final:
                return None
            return Take(len(buf) if start == len(buf) else max(start, 1), ok=False)
        read = _read(buf, start)
        if read.stop is not None:  # not a call list: content (a call confirmed: dropped)
            return Take(read.stop if read.confirmed else start + 1, ok=False)
        if read.end is None:
            return Take(len(buf), ok=False, cut=True) if final else None
        end, after = read.end, skip(buf, read.end)
        if start and buf.startswith(PY_END, after):
            end = after + len(PY_END)
        return Take(end, tuple((name, dict(args)) for name, args, _ in read.calls))

    def partial(self, buf: str, schemas: Schemas) -> tuple[Partial, ...]:
        start = self._start(buf)
        if not buf.startswith("[", start):
            return ()
        return tuple(Partial(n, _arguments(a, c)) for n, a, c in _read(buf, start).confirmed)

    def call_parts(self, name: str) -> tuple[str, str]:
        return f"{name}(", ")"

    def write(self, name: str, arguments: Any) -> str:
        pairs = (f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in arguments.items())
        return f"{name}({', '.join(pairs)})"

    def call_rule(self, name: str, parameters: Any) -> str:
        # keyword arguments in the order of the schema, each a JSON literal (read back as
        # JSON where Python reads it otherwise: true, false, null)
        props = parameters.get("properties") or {}
        required = set(parameters.get("required") or ())
        parts = []
        for i, (key, schema) in enumerate(props.items()):
            sep = json.dumps(", " if i else "")
            rule = f"{sep} {json.dumps(key + '=')} %json {json.dumps(schema)}"
            parts.append(f"{rule}" if key in required else f"({rule})?")
        return " ".join([json.dumps(f"{name}("), *parts, json.dumps(")")])
