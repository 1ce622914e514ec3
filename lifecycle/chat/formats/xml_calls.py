"""The formats that write each argument in a tag of its own: Qwen3-Coder's
``<function=f><parameter=k>v</parameter></function>`` and GLM-4.5's
``f<arg_key>k</arg_key><arg_value>v</arg_value>``, both in ``<tool_call>`` blocks (the
table in ``lifecycle.chat.tool_formats``). A value is text: it is read by the type the
tool's parameters schema gives it (``typed_value``), as SGLang's detectors read it."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lifecycle.chat.formats.base import (
    COMPACT,
    Partial,
    Schemas,
    Take,
    ToolFormat,
    lark_string,
)
from lifecycle.chat.formats.json_calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from lifecycle.core.detok import held_back

__all__ = ["Glm45", "Qwen3Coder", "typed_value"]

_KINDS: dict[str, tuple[type, ...]] = {
    "integer": (int,), "number": (int, float), "boolean": (bool,), "object": (dict,),
    "array": (list,), "null": (type(None),),
}  # fmt: skip


def _types(schema: Mapping[str, Any] | None) -> list[str]:
    kind = (schema or {}).get("type")
    return [kind] if isinstance(kind, str) else [k for k in kind or () if isinstance(k, str)]


def typed_value(text: str, schema: Mapping[str, Any] | None) -> Any:
    """A value written as text, read by its schema's type: a string stays the text; an
    integer, number, boolean, object or array is read as JSON when it reads as one of
    them (else it stays the text); without a type, JSON when the text is JSON."""
    kinds = _types(schema)
    if "string" in kinds:
        return text
    try:
        value = json.loads(text)
    except ValueError:
        lowered = text.strip().lower()  # Python's True / False / None
        value = {"true": True, "false": False, "none": None}.get(lowered, text)
    if not kinds:
        return value
    for kind in kinds:
        wanted = _KINDS.get(kind, ())
        if isinstance(value, wanted) and not (isinstance(value, bool) and kind != "boolean"):
            return value
    return text


def _render(pairs: list[tuple[str, Any]], closed: bool) -> str:
    body = ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}"
                     for k, v in pairs)  # fmt: skip
    return "{" + body + ("}" if closed else "")


_TEXT = "/[^<]*/"


def _value_rule(schema: Mapping[str, Any]) -> str:
    """A value's Lark: text without ``<`` for a string, one of the texts of an enum of
    strings, else JSON of its schema."""
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(e, str) for e in enum):
        return "(" + " | ".join(lark_string(e) for e in enum) + ")"
    if "string" in _types(schema) or (not _types(schema) and "enum" not in schema):
        return _TEXT
    return f"%json {json.dumps({**schema, 'x-guidance': COMPACT})}"


@dataclass(slots=True)
class _Read:
    """A block read so far: the name, the complete pairs (key, value text), whether the
    arguments are closed, and a value begun but not closed (key, its text so far)."""

    name: str
    pairs: list[tuple[str, str]]
    closed: bool
    open_value: tuple[str, str] | None = None


class _Tagged(ToolFormat):
    """A ``<tool_call>`` block whose name is found by ``head`` and whose arguments are
    pairs (a key, then a value between ``value_open`` and ``value_close``), closed by
    ``close``. A string value streams as it is written (what may begin a closing tag held
    back); any other value once closed."""

    openers = (TOOL_CALL_OPEN,)
    head = re.compile("")
    value_open = re.compile("")  # a value's opening tag(s), its key as group 1
    value_close = ""
    pair: re.Pattern[str]  # a whole pair: value_open, the value (group 2), value_close
    close = ""

    def __init_subclass__(cls) -> None:
        cls.pair = re.compile(
            cls.value_open.pattern + r"(.*?)" + re.escape(cls.value_close) + r"\s*", re.DOTALL
        )

    def _read(self, buf: str) -> _Read | None:
        limit = buf.find(TOOL_CALL_CLOSE)
        ended = limit >= 0
        limit = limit if ended else len(buf)
        m = self.head.match(buf, len(TOOL_CALL_OPEN), limit)
        if m is None:
            return None
        pairs, i = [], m.end()
        while (p := self.pair.match(buf, i, limit)) is not None:
            pairs.append((p.group(1).strip(), self.value_text(p.group(2))))
            i = p.end()
        read = _Read(m.group(1).strip(), pairs, buf.startswith(self.close, i))
        if (v := self.value_open.match(buf, i, limit)) is not None:  # a value not closed yet
            raw = buf[v.end() : limit]
            if not ended:  # what may begin a closing tag, and what value_text may drop
                raw = raw[: len(raw) - held_back(raw, (self.value_close, TOOL_CALL_CLOSE))]
                raw = raw.removesuffix("\n")
            read.open_value = (v.group(1).strip(), self.value_text(raw))
        return read

    def value_text(self, raw: str) -> str:
        return raw

    def take(self, buf: str, final: bool) -> Take | None:
        end = buf.find(TOOL_CALL_CLOSE)
        if end < 0 and not final:
            return None
        used = end + len(TOOL_CALL_CLOSE) if end >= 0 else len(buf)
        read = self._read(buf[:used])
        if read is None:
            return Take(used, ok=False, cut=end < 0)
        return Take(used, ((read.name, {k: typed_value(v, None) for k, v in read.pairs}),))

    def partial(self, buf: str, schemas: Schemas) -> tuple[Partial, ...]:
        read = self._read(buf)
        if read is None:
            return ()
        props = (schemas.get(read.name) or {}).get("properties") or {}
        typed = [(k, typed_value(v, props.get(k))) for k, v in read.pairs]
        text = _render(typed, read.closed)
        if read.open_value is not None and not read.closed:
            key, value = read.open_value
            if "string" in _types(props.get(key)):  # a string streams as it is written
                quoted = json.dumps(value, ensure_ascii=False)[:-1]
                text += (", " if typed else "") + f"{json.dumps(key, ensure_ascii=False)}: {quoted}"
        return (Partial(read.name, text),)

    def pair_rule(self, key: str, value: str) -> str:
        head, tail = self.pair_text(key, "\0").split("\0")
        if value == _TEXT:  # a terminal is as long as it can be: the text takes the newline
            tail = tail.removeprefix("\n")
        return f"{lark_string(head)} {value} {lark_string(tail)}"

    def pair_text(self, key: str, value: str) -> str:
        raise NotImplementedError

    def write(self, name: str, arguments: Mapping[str, Any]) -> str:
        head, tail = self.call_parts(name)
        pairs = [self.pair_text(k, v if isinstance(v, str) else json.dumps(v, ensure_ascii=False))
                 for k, v in arguments.items()]  # fmt: skip
        return head + "".join(pairs) + tail

    def call_rule(self, name: str, parameters: Mapping[str, Any]) -> str:
        props = parameters.get("properties") or {}
        required = set(parameters.get("required") or ())
        parts = []
        for key, schema in props.items():
            rule = self.pair_rule(key, _value_rule(schema))
            parts.append(rule if key in required else f"({rule})?")
        head, tail = self.call_parts(name)
        return " ".join([lark_string(head), *parts, lark_string(tail)])


class Qwen3Coder(_Tagged):
    name = "qwen3_coder"
    head = re.compile(r"\s*<function=([^>\n]+)>\s*")
    value_open, value_close = re.compile(r"<parameter=([^>\n]+)>"), "</parameter>"
    close = "</function>"

    def value_text(self, raw: str) -> str:
        # the template writes "\n" + value + "\n"
        return raw.removeprefix("\n").removesuffix("\n")

    def pair_text(self, key: str, value: str) -> str:
        return f"<parameter={key}>\n{value}\n</parameter>\n"

    def call_parts(self, name: str) -> tuple[str, str]:
        return f"{TOOL_CALL_OPEN}\n<function={name}>\n", f"</function>\n{TOOL_CALL_CLOSE}"


class Glm45(_Tagged):
    name = "glm45"
    head = re.compile(r"\s*([^<>\n]+?)\s*(?=\n|<arg_key>|</tool_call>)\s*")
    value_open = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>", re.DOTALL)
    value_close = "</arg_value>"
    close = TOOL_CALL_CLOSE

    def pair_text(self, key: str, value: str) -> str:
        return f"<arg_key>{key}</arg_key>\n<arg_value>{value}</arg_value>\n"

    def call_parts(self, name: str) -> tuple[str, str]:
        return f"{TOOL_CALL_OPEN}{name}\n", TOOL_CALL_CLOSE
