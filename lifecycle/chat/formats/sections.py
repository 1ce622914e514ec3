"""The formats that wrap each call in special tokens inside a calls section: DeepSeek
V3/R1's and V3.1's, and Kimi-K2's (the table in ``lifecycle.chat.tool_formats``). The
section's own markers are dropped; each call is a region of its own."""

from __future__ import annotations

import re

from lifecycle.chat.formats.base import (
    Partial,
    Schemas,
    Take,
    ToolFormat,
    args_text,
    loads,
    skip,
)

__all__ = ["DS_CALLS_BEGIN", "KIMI_SECTION_BEGIN", "DeepSeekV3", "DeepSeekV31", "KimiK2"]

DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = (
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
)
KIMI_SECTION_BEGIN, KIMI_SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL_BEGIN, KIMI_CALL_END = "<|tool_call_begin|>", "<|tool_call_end|>"
KIMI_ARGS = "<|tool_call_argument_begin|>"

_FENCE = re.compile(r"^\s*```(?:json)?\s*\n?(.*?)\n?\s*```\s*$", re.DOTALL)
_FENCE_OPEN = re.compile(r"\s*```(?:json)?[ \t]*\n?\s*(?=\{)")


class _Section(ToolFormat):
    """Calls between ``call_begin`` and ``call_end``, the name and the arguments split by
    ``sep``, inside a section whose markers are dropped."""

    special = True
    section = ("", "")
    call_begin = call_end = sep = ""

    def __init_subclass__(cls) -> None:
        cls.openers = (*cls.section, cls.call_begin)
        cls.prefix, cls.suffix = cls.section

    def take(self, buf: str, final: bool) -> Take | None:
        for marker in self.section:  # the section's markers: dropped
            if buf.startswith(marker):
                return Take(len(marker))
        end = buf.find(self.call_end)
        if end < 0:
            return Take(len(buf), ok=False, cut=True) if final else None
        used = end + len(self.call_end)
        head, sep, rest = buf[len(self.call_begin) : end].partition(self.sep)
        name, raw = self.split(head, rest) if sep else ("", "")
        fenced = _FENCE.match(raw)
        arguments = loads(fenced.group(1) if fenced else raw)
        if not name or arguments is None:
            return Take(used, ok=False)
        return Take(used, ((name, arguments),))

    def split(self, head: str, rest: str) -> tuple[str, str]:
        """The name and the arguments' text of a call, from around its ``sep``."""
        return head.strip(), rest

    def args_start(self, buf: str, after_sep: int) -> tuple[str, int] | None:
        """The name and where the arguments object opens (None: not known yet)."""
        i = skip(buf, after_sep)
        return (self.split(buf[len(self.call_begin) : after_sep - len(self.sep)], "")[0], i)

    def partial(self, buf: str, schemas: Schemas) -> tuple[Partial, ...]:
        sep = buf.find(self.sep) if buf.startswith(self.call_begin) else -1
        end = buf.find(self.call_end)
        if sep < 0 or (0 <= end < sep):
            return ()
        found = self.args_start(buf, sep + len(self.sep))
        if found is None or buf[found[1] : found[1] + 1] != "{" or not found[0]:
            return ()
        return (Partial(found[0], args_text(buf, found[1], self.call_end)),)


class DeepSeekV31(_Section):
    name = "deepseekv31"
    section = (DS_CALLS_BEGIN, DS_CALLS_END)
    call_begin, call_end, sep = DS_CALL_BEGIN, DS_CALL_END, DS_SEP

    def split(self, head: str, rest: str) -> tuple[str, str]:
        if head.strip() == "function":  # V3 / R1: the name, then the arguments fenced
            name, _, rest = rest.partition("\n")
            return name.strip(), rest
        return head.strip(), rest  # V3.1: the name before the separator, the arguments bare

    def args_start(self, buf: str, after_sep: int) -> tuple[str, int] | None:
        head = buf[len(self.call_begin) : after_sep - len(self.sep)]
        if head.strip() != "function":
            return head.strip(), skip(buf, after_sep)
        line = buf.find("\n", after_sep)
        fence = _FENCE_OPEN.match(buf, line + 1) if line >= 0 else None
        return (buf[after_sep:line].strip(), fence.end()) if fence is not None else None

    def call_parts(self, name: str) -> tuple[str, str]:
        return f"{DS_CALL_BEGIN}{name}{DS_SEP}", DS_CALL_END


class DeepSeekV3(DeepSeekV31):
    name = "deepseekv3"

    def call_parts(self, name: str) -> tuple[str, str]:
        return (f"{DS_CALL_BEGIN}function{DS_SEP}{name}\n```json\n", f"\n```{DS_CALL_END}")


class KimiK2(_Section):
    """``functions.NAME:INDEX`` is the call's id in Kimi's template; the name is read
    from it."""

    name = "kimi_k2"
    section = (KIMI_SECTION_BEGIN, KIMI_SECTION_END)
    call_begin, call_end, sep = KIMI_CALL_BEGIN, KIMI_CALL_END, KIMI_ARGS

    def split(self, head: str, rest: str) -> tuple[str, str]:
        name = head.strip().removeprefix("functions.")
        return name.rpartition(":")[0] if ":" in name else name, rest

    def call_parts(self, name: str) -> tuple[str, str]:
        return f"{KIMI_CALL_BEGIN}functions.{name}:0{KIMI_ARGS}", KIMI_CALL_END
