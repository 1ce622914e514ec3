"""A reasoning model's thinking, split from its answer (docs/api.md, "Reasoning").

Qwen3, QwQ and the DeepSeek-R1 distills write their reasoning first, between ``<think>``
and ``</think>``, then the answer. ``ReasoningSplitter`` reads a choice's text as it
streams and says which pieces are reasoning and which are content; it never awaits and
never reads anything but the text it is fed (a sans-IO core), so a stream and its unary
reply, which runs the same splitter over the whole text, always agree.

- The output starts inside the reasoning when the prompt already opened it (a template
  ending its generation prompt with ``<think>``, as DeepSeek-R1's and Qwen3-Thinking's
  do), or when the parser is one of SGLang's forced ones (``deepseek-r1``,
  ``qwen3-thinking``) and the prompt did not close it; otherwise a reasoning block is
  read only at the very start of the output (after whitespace), never in the middle.
- The tags are dropped, and the whitespace next to them (``<think>\\n...\\n</think>\\n\\n``
  leaves the reasoning and the answer without their newlines).
- A tag split across chunks (or tokens) is held back until it is known: ``</th`` waits
  for what follows.
- Reasoning never closed (the length limit cut it) is all reasoning; the content is None.

``ReasoningFormat`` and the count of the reasoning's tokens (``reasoning_tokens``) are
the request core's (``lifecycle.core.reasoning``): ``/generate``'s ``meta_info`` reports
the count too.
"""

from __future__ import annotations

import enum

from lifecycle.core.detok import held_back
from lifecycle.core.reasoning import ReasoningFormat, reasoning_tokens

__all__ = [
    "REASONING_PARSERS",
    "ReasoningFormat",
    "ReasoningSplitter",
    "detect_reasoning",
    "reasoning_format",
    "reasoning_in_effect",
    "reasoning_tokens",
    "split_reasoning",
]


# SGLang's --reasoning-parser names that write <think> blocks (gpt-oss's channels are not).
REASONING_PARSERS: dict[str, ReasoningFormat] = {
    f.name: f
    for f in (
        ReasoningFormat("qwen3"),
        ReasoningFormat("qwen3-thinking", forced=True),
        ReasoningFormat("deepseek-r1", forced=True),
        ReasoningFormat("deepseek-v3"),
        ReasoningFormat("glm45"),
        ReasoningFormat("step3", forced=True),
        ReasoningFormat("minimax", forced=True),
        ReasoningFormat("kimi", start="◁think▷", end="◁/think▷"),
    )
}


def reasoning_format(name: str) -> ReasoningFormat:
    """The format of a ``--reasoning-parser`` name; ``ValueError`` names the known ones."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        known = ", ".join(REASONING_PARSERS)
        raise ValueError(f"unknown reasoning parser {name!r} (known: {known})") from None


def reasoning_in_effect(parser: str | None, template_source: str | None) -> ReasoningFormat | None:
    """A server's reasoning format: its ``--reasoning-parser`` (``ValueError`` for an
    unknown name), else what its chat template shows; None: not a reasoning model."""
    if parser is not None:
        return reasoning_format(parser)
    return detect_reasoning(template_source) if template_source is not None else None


def detect_reasoning(template_source: str) -> ReasoningFormat | None:
    """The reasoning format a chat template's text shows (None: not a reasoning model)."""
    for fmt in (REASONING_PARSERS["kimi"], REASONING_PARSERS["qwen3"]):
        if fmt.end in template_source or fmt.start in template_source:
            return fmt
    return None


class _At(enum.Enum):
    OPENING = "opening"  # the output's start: a reasoning block may open here
    REASONING = "reasoning"
    CONTENT = "content"


class ReasoningSplitter:
    """One choice's text, fed in pieces; ``feed`` and ``finish`` return
    ``(kind, text)`` pieces, ``kind`` "reasoning" or "content", in order."""

    def __init__(self, fmt: ReasoningFormat, inside: bool = False) -> None:
        self.fmt = fmt
        self._at = _At.REASONING if inside else _At.OPENING
        self._fresh = True  # nothing of the current part sent yet: its leading space goes
        self._buf = ""  # text not decided yet
        self.seen = inside  # a reasoning block was opened
        self.closed = False  # ... and closed

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._buf += text
        out: list[tuple[str, str]] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[tuple[str, str]]:
        """The text is complete: what was held back goes out as what it was read as."""
        out: list[tuple[str, str]] = []
        rest, self._buf = self._buf, ""
        if self._at is _At.REASONING:
            self._emit("reasoning", rest.rstrip(), out)
        else:
            self._emit("content", rest, out)
        return out

    def _step(self, out: list[tuple[str, str]]) -> bool:
        """Decide what can be decided; True when the state moved on (step again)."""
        fmt, buf = self.fmt, self._buf
        if self._at is _At.CONTENT:
            self._emit("content", buf, out)
            self._buf = ""
            return False
        if self._fresh:  # a reasoning part's start: a (repeated) opening tag may come
            lead = buf.lstrip()
            if not lead or (len(lead) < len(fmt.start) and fmt.start.startswith(lead)):
                return False  # wait: it may still be the tag
            if lead.startswith(fmt.start):
                self._at, self.seen = _At.REASONING, True
                self._buf = lead[len(fmt.start) :]
                return True
            if self._at is _At.OPENING:  # no reasoning: the text is content as written
                self._at, self._fresh = _At.CONTENT, False
                return True
        end = buf.find(fmt.end)
        if end >= 0:
            self._emit("reasoning", buf[:end].rstrip(), out)
            self._at, self.closed, self._fresh = _At.CONTENT, True, True
            self._buf = buf[end + len(fmt.end) :]
            return True
        keep = held_back(buf, (fmt.end,))
        body = buf[: len(buf) - keep]
        sent = body.rstrip()  # trailing space waits: it is dropped before the end tag
        self._emit("reasoning", sent, out)
        self._buf = buf[len(sent) :]
        return False

    def _emit(self, kind: str, text: str, out: list[tuple[str, str]]) -> None:
        if self._fresh:
            text = text.lstrip()
        if not text:
            return
        self._fresh = False
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + text)
        else:
            out.append((kind, text))


def split_reasoning(text: str, fmt: ReasoningFormat, inside: bool = False) -> tuple[str, str]:
    """A whole output -> (its reasoning, its content), each "" when absent."""
    splitter = ReasoningSplitter(fmt, inside)
    parts = splitter.feed(text) + splitter.finish()
    reasoning = "".join(t for k, t in parts if k == "reasoning")
    return reasoning, "".join(t for k, t in parts if k == "content")
