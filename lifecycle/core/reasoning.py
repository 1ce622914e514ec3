"""How many of an output's tokens are its reasoning (``meta_info.reasoning_tokens`` and
``usage.completion_tokens_details.reasoning_tokens``), and the reasoning format that
count reads (docs/api.md, "Reasoning").

A reasoning model writes its thinking first, between a start and an end tag
(``<think>`` ... ``</think>``), then its answer. The reasoning's tokens are those up to
and including the one that completes the end tag, the tags included (SGLang counts up
to the end-of-thinking token); all of them while it never closes; 0 when no reasoning
opened. It opens when the prompt already opened it (``ReasoningFormat.opened_by``) or
when the output starts with the start tag (after whitespace), never in the middle. The
count reads the tokens' texts one by one and keeps a few characters, so a stream pays
O(1) per token. Nothing here does I/O; the splitting of the text into reasoning and
content is the API's (``lifecycle.chat.reasoning``).

A thinking budget (``thinking_token_budget``, Anthropic's ``budget_tokens``) travels to
the worker as the format's tags in token ids (``budget_option``), which the worker
closes the reasoning with (``wire/reasoning_budget.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from lifecycle.core.detok import TokenizerLike
from wire import ReasoningBudget

__all__ = ["ReasoningCount", "ReasoningFormat", "budget_option", "reasoning_tokens"]

log = logging.getLogger(__name__)
_unread = [True]  # a budget on a model without reasoning not logged yet (logged once)


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    """How one family writes its reasoning."""

    name: str
    start: str = "<think>"
    end: str = "</think>"
    forced: bool = False  # the output starts inside the reasoning (SGLang's force_reasoning)

    def opened_by(self, prompt: str) -> bool:
        """Whether the output of ``prompt`` starts inside the reasoning."""
        tail = prompt.rstrip()
        if tail.endswith(self.start):
            return True
        return self.forced and not tail.endswith(self.end)


class ReasoningCount:
    """One output's reasoning tokens, fed token text by token text."""

    __slots__ = ("_done", "_fmt", "_inside", "_lead", "_tail", "count")

    def __init__(self, fmt: ReasoningFormat, inside: bool) -> None:
        self._fmt = fmt
        self._inside = inside
        self._done = False  # the count is final: the reasoning closed, or never opened
        self._lead = ""  # the output's start, whitespace dropped, while it may still open
        self._tail = ""  # the reasoning's last characters: an end tag may span tokens
        self.count = 0  # tokens read so far (the answer while inside)

    @property
    def tokens(self) -> int:
        return self.count if self._inside else 0

    def feed(self, piece: str) -> None:
        if self._done:
            return
        self.count += 1
        fmt = self._fmt
        if not self._inside:
            self._lead = (self._lead + piece).lstrip()
            if self._lead.startswith(fmt.start):
                self._inside, piece = True, self._lead
            elif not fmt.start.startswith(self._lead):
                self._done = True  # the output started with something else: no reasoning
                return
            else:
                return
        text = self._tail + piece
        if fmt.end in text:
            self._done = True
        else:
            self._tail = text[-(len(fmt.end) - 1) :] if len(fmt.end) > 1 else ""


def reasoning_tokens(token_texts: Iterable[str], fmt: ReasoningFormat, inside: bool) -> int:
    """How many of an output's tokens (given by their texts) are its reasoning."""
    count = ReasoningCount(fmt, inside)
    for piece in token_texts:
        count.feed(piece)
    return count.tokens


def budget_option(
    tokens: int | None, fmt: ReasoningFormat | None, inside: bool, tok: TokenizerLike
) -> ReasoningBudget | None:
    """The worker's thinking budget for a request's ``tokens`` (None: no budget): the end
    tag forced after a newline (as SGLang's thinking-budget processor writes it), the
    start tag the model opens it with unless the prompt did (``inside``). A budget on a
    model without a reasoning format is kept by every output: ignored, logged once."""
    if tokens is None:
        return None
    if fmt is None:
        if _unread[0]:
            _unread[0] = False
            log.info("a thinking budget is ignored: this model writes no reasoning "
                     "(no --reasoning-parser, and its chat template shows none)")  # fmt: skip
        return None

    def ids(text: str) -> tuple[int, ...]:
        return tuple(tok.encode(text, add_special_tokens=False))

    start = () if inside else ids(fmt.start)
    return ReasoningBudget(tokens, ids(fmt.end), ids("\n" + fmt.end), start)
