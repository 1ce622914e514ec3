"""A thinking budget (``specs/wire.cddl`` ``reasoning-budget``): the reasoning section of
one request closed after a number of tokens, as SGLang's thinking-budget logit processor,
vLLM's ``thinking_token_budget`` and llama.cpp's reasoning budget close it.

The frontend knows the reasoning format and whether the prompt opened the reasoning; it
sends the budget with the ids of the tags, tokenized by its tokenizer. Both workers (the
model's, ``gpu/runtime/engine.py``, and the scripted one) apply the same ``BudgetState``, one per
sample, to each token they append; nothing here reads a tensor.

- The count starts at the output's start when ``start`` is empty (the prompt opened the
  reasoning), else just after the output first holds the ``start`` ids (the model opened
  it); it counts every token after that point.
- The reasoning is over as soon as the output's tail holds the ``end`` ids, written by
  the model: nothing is forced.
- Once ``tokens`` tokens were counted and it is not over, the next ``len(force)`` tokens
  are replaced, one per step, by the ``force`` ids (the end tag after a newline); then
  the sample goes on as sampled (its answer). The budget acts once per sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from wire.frames import pack_ids
from wire.sampling import get_int, token_ids

__all__ = ["MAX_REASONING_BUDGET", "MAX_TAG_IDS", "BudgetState", "ReasoningBudget"]

MAX_TAG_IDS = 32  # ids per tag at most: a tag is a few characters
MAX_REASONING_BUDGET = 1 << 31


@dataclass(frozen=True, slots=True)
class ReasoningBudget:
    tokens: int  # reasoning tokens allowed before the end is forced
    end: tuple[int, ...]  # the end tag's ids: the model writing them ends the reasoning
    force: tuple[int, ...]  # what is forced once the budget is spent
    start: tuple[int, ...] = ()  # the start tag's ids; empty: the prompt opened it

    def to_wire(self) -> dict[str, Any]:
        o: dict[str, Any] = {
            "tokens": self.tokens,
            "end": pack_ids(self.end),
            "force": pack_ids(self.force),
        }
        if self.start:
            o["start"] = pack_ids(self.start)
        return o

    @classmethod
    def from_wire(cls, raw: Any, vocab_size: int) -> ReasoningBudget:
        """Read and check the map; ``ValueError`` with a message for REQ-ERROR."""
        if not isinstance(raw, dict):
            raise ValueError("reasoning_budget must be a map.")
        budget = cls(
            tokens=get_int(raw, "tokens", -1, 0, MAX_REASONING_BUDGET),
            end=token_ids(raw.get("end"), "reasoning_budget.end", vocab_size),
            force=token_ids(raw.get("force"), "reasoning_budget.force", vocab_size),
            start=()
            if raw.get("start") is None
            else token_ids(raw["start"], "reasoning_budget.start", vocab_size),
        )
        budget.check(vocab_size)
        return budget

    def check(self, vocab_size: int) -> None:
        get_int({"tokens": self.tokens}, "tokens", 0, 0, MAX_REASONING_BUDGET)
        for name in ("end", "force", "start"):
            ids = getattr(self, name)
            if name != "start" and not ids:
                raise ValueError(f"reasoning_budget.{name} must hold at least one id.")
            if len(ids) > MAX_TAG_IDS:
                raise ValueError(f"reasoning_budget.{name} holds more than {MAX_TAG_IDS} ids.")
            token_ids(list(ids), f"reasoning_budget.{name}", vocab_size)


class BudgetState:
    """One sample's progress through its budget, fed each token it appends."""

    __slots__ = ("_at", "_budget", "_count", "_open", "_tail", "done")

    def __init__(self, budget: ReasoningBudget) -> None:
        self._budget = budget
        self._open = not budget.start  # counting (the reasoning is open)
        self._count = 0  # tokens counted since it opened
        self._tail: list[int] = []  # the last output ids, as long as the longest tag
        self._at = -1  # the index in ``force`` of the next forced id; -1: not forcing
        self.done = False  # over: closed by the model, or its end forced whole
        if self._open and budget.tokens == 0:
            self._at = 0

    @property
    def forcing(self) -> bool:
        """Whether the next token appended is replaced (it must not stay on the device)."""
        return self._at >= 0

    def copy(self) -> BudgetState:
        twin = BudgetState(self._budget)
        twin._open, twin._count, twin._tail = self._open, self._count, list(self._tail)
        twin._at, twin.done = self._at, self.done
        return twin

    def next(self, sampled: int) -> int:
        """The token to append in place of ``sampled`` (itself unless forcing)."""
        if self.done:
            return sampled
        b = self._budget
        if self._at >= 0:
            tok = b.force[self._at]
            self._at += 1
            if self._at == len(b.force):
                self._at, self.done = -1, True
            return tok
        self._tail.append(sampled)
        del self._tail[: -max(len(b.end), len(b.start), 1)]
        if not self._open:
            self._open = _ends_with(self._tail, b.start)
            if self._open and b.tokens == 0:
                self._at = 0
            return sampled
        self._count += 1
        if _ends_with(self._tail, b.end):
            self.done = True
        elif self._count >= b.tokens:
            self._at = 0
        return sampled


def _ends_with(tail: list[int], ids: tuple[int, ...]) -> bool:
    return len(tail) >= len(ids) and tuple(tail[len(tail) - len(ids) :]) == ids
