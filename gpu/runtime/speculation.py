"""Speculative decoding (``--speculative ngram``): proposed tokens checked in one step,
every emitted token the one the request would have had without them.

A decoding sequence whose last tokens occurred earlier in its prompt or output (an
n-gram of ``ngram_max`` down to ``ngram_min`` tokens, the latest occurrence) is fed, in
one step, its last token and the tokens that followed that occurrence (the draft,
``Sequence.draft``): k + 1 rows, each a query over its own keys, as a prompt chunk's
rows are. On the CPU's native path a row's logits are one function of its prefix
(docs/determinism.md), so row j's logits are bit for bit those a plain decode step
would compute once the first j draft tokens were accepted.

Checking (``verify``) samples every row as the sampler samples a decode row, in order,
each seeded row from its own generator: row 0's token is emitted; row j's is emitted
when every draft token before it equals the token sampled at its position. The first
mismatch ends the group, and the generator of a sampled row is set back to where it
stands after the rows used (``rewind``): its next draws are those it would make
without speculation. So greedy and seeded requests get the same tokens with or
without it, alone or batched. For a sampled request this is exact rejection sampling
of a deterministic proposal: a draft token d is accepted with probability p(d), and on
a rejection the token drawn is a draw from p restricted to tokens other than d.

The KV the step wrote for rejected rows lies past the sequence's computed tokens and
is written over as it goes on (``Scheduler.accepted``). A request whose proposals keep
failing backs off (``Drafts``): no proposal for a number of steps that doubles with
each failure, so a request with nothing to look up pays only the lookup.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import torch

from wire.worker_options import SPECULATIVE_MODES

__all__ = ["DraftRow", "Drafts", "SpecTotals", "Speculation", "draft_rows", "rewind", "verify"]

# A request's proposals back off after this many in a row accepted nothing; the pause
# doubles with each such run, up to MAX_PAUSE steps.
MISSES = 2
MAX_PAUSE = 64


@dataclass(frozen=True, slots=True)
class Speculation:
    """``--speculative``'s mode and bounds (``wire/worker_options.py``), one value."""

    mode: str = "off"
    # the most draft tokens per request and step: on this CPU's packed kernels a step of
    # 13 rows costs about 2.1 decodes of SmolLM2 (1.9 of the 0.5B shape; 7 rows 1.4 and
    # 1.25), and a copying answer accepts most of them (grounded prompts, SmolLM2, one
    # stream, its greedy answers replayed through ``Drafts`` at those costs: 3.01x at 6,
    # 3.10x at 8, 3.27x at 12, 3.28x at 15; served, 2.86x at 12; 2026-12-07)
    tokens: int = 12
    ngram_min: int = 2
    ngram_max: int = 4
    # A step's rows at most, its decodes and their drafts, beyond which no draft is
    # proposed: the native kernels' cost of a row falls as rows are added up to about
    # 16 (the weights are unpacked once for all), and grows with each row after that, so
    # a step of many decodes gains nothing from checking drafts too.
    step_rows: int = 16

    @property
    def on(self) -> bool:
        return self.mode != "off"

    def __post_init__(self) -> None:
        if self.mode not in SPECULATIVE_MODES:
            raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE_MODES)}, "
                             f"got {self.mode!r}")  # fmt: skip
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("ngram sizes must satisfy 1 <= min <= max")
        if self.tokens < 1:
            raise ValueError("speculative tokens must be at least 1")


@dataclass(slots=True)
class SpecTotals:
    """Every request's proposals, as STATS reports them (``specs/wire.cddl``)."""

    draft_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0

    def load(self) -> dict[str, int]:
        return {
            "spec_num_proposed_drafts": self.draft_tokens,
            "spec_num_correct_drafts": self.accepted_tokens,
            "spec_verify_ct": self.verify_steps,
        }


@dataclass(slots=True)
class Drafts:
    """One sequence's n-gram index and its proposals' record.

    ``index[n]`` maps each n-gram of its tokens to the position after its latest
    occurrence, for every occurrence that ends before the last token (the last n tokens
    themselves are what is looked up)."""

    spec: Speculation
    index: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)
    indexed: int = 0  # positions whose n-grams ending there are in ``index``
    k: int = 0  # the next draft's most tokens (adapts to what was accepted)
    misses: int = 0  # proposals in a row that accepted nothing
    pause: int = 0  # steps left without a proposal
    backoff: int = 1  # the next pause
    drafted: int = 0
    accepted: int = 0
    verify_ct: int = 0

    def __post_init__(self) -> None:
        self.k = self.spec.tokens
        for n in range(self.spec.ngram_min, self.spec.ngram_max + 1):
            self.index[n] = {}

    def length(self, most: int) -> int:
        """The next draft's most tokens for this sequence: ``min(k, most)``, 0 while
        paused (a draft model's proposals, and ``propose``'s)."""
        if self.pause:
            self.pause -= 1
            return 0
        return max(0, min(self.k, most))

    def propose(self, tokens: list[int], most: int) -> list[int]:
        """Up to ``min(k, most)`` tokens that followed the latest earlier occurrence of
        the longest matching suffix of ``tokens`` (continued as a loop past the end);
        [] when none matches or paused (``length``'s rule: one for both proposers)."""
        want = self.length(most)
        if not want:
            return []
        end = len(tokens) - 1  # n-grams ending at positions < len(tokens)
        for i in range(self.indexed + 1, end + 1):
            for n, table in self.index.items():
                if i >= n:
                    table[tuple(tokens[i - n : i])] = i
        self.indexed = max(self.indexed, end)
        for n in range(self.spec.ngram_max, self.spec.ngram_min - 1, -1):
            if len(tokens) < n + 1:
                continue
            at = self.index[n].get(tuple(tokens[-n:]))
            if at is not None:
                return _continued(tokens, at, want)
        return []

    def checked(self, proposed: int, accepted: int) -> None:
        """A proposal of ``proposed`` tokens was checked and ``accepted`` kept: the next
        draft's length follows it, and a run of failures pauses proposals."""
        self.drafted += proposed
        self.accepted += accepted
        self.verify_ct += 1
        if accepted == proposed:
            self.k = min(self.spec.tokens, 2 * self.k)
            self.misses, self.backoff = 0, 1
            return
        self.k = max(1, accepted + 1)
        if accepted:
            self.misses, self.backoff = 0, 1
            return
        self.misses += 1
        if self.misses >= MISSES:
            self.pause, self.misses = self.backoff, 0
            self.backoff = min(MAX_PAUSE, 2 * self.backoff)

    def extra(self) -> dict[str, int]:
        """The terminal STEP entry's keys (``specs/wire.cddl``)."""
        return {
            "spec_num_proposed_drafts": self.drafted,
            "spec_num_correct_drafts": self.accepted,
            "spec_verify_ct": self.verify_ct,
        }


def _continued(tokens: list[int], at: int, want: int) -> list[int]:
    """``want`` tokens from ``tokens[at]`` on, going on past the end into the draft
    itself: a match near the end is a loop (``a b a b`` matched one period back), which
    the draft continues for its whole length instead of stopping at the last token."""
    draft = tokens[at : at + want]
    period = len(tokens) - at
    while len(draft) < want:
        draft.append(draft[len(draft) - period])
    return draft


class DraftRow:
    """Row j of a speculating sequence as the sampler reads it (``gpu.runtime.sampling.Row``):
    the sequence with the draft's first j tokens in its output, so a penalty or an
    end-of-generation mask (``min_new_tokens``) reads what its decode row would."""

    __slots__ = ("seq", "output")

    def __init__(self, seq: Any, output: list[int]) -> None:
        self.seq, self.output = seq, output

    def __getattr__(self, name: str) -> Any:  # params, prompt, generator, eog_ids, ...
        return getattr(self.seq, name)


def draft_rows(samplers: Seq[Any], drafts: Seq[tuple[int, Any, list[int]]]) -> list[Any]:
    """The sampler's rows of a step with speculating sequences: each group's rows past
    the first as ``DraftRow``s where the sequence's logits depend on its output (not
    ``plain``); ``samplers`` itself when none does."""
    if all(seq.plain for _, seq, _ in drafts):
        return list(samplers)
    rows = list(samplers)
    for first, seq, draft in drafts:
        if not seq.plain:
            out = seq.output
            for j in range(1, len(draft) + 1):
                rows[first + j] = DraftRow(seq, out + draft[:j])
    return rows


def verify(
    sampled: Seq[int], groups: Seq[tuple[int, Any, list[int]]]
) -> tuple[list[int], list[int]]:
    """Which rows of a step's sampled tokens are emitted: ``groups`` are each
    speculating sequence's (first sampler row, sequence, draft), its rows being that
    row and the next ``len(draft)``. Returns the emitted rows in order and each group's
    accepted draft tokens."""
    drop: set[int] = set()
    accepted: list[int] = []
    for first, _seq, draft in groups:
        a = 0
        while a < len(draft) and sampled[first + a] == draft[a]:
            a += 1
        accepted.append(a)
        drop.update(range(first + a + 1, first + len(draft) + 1))
    return [i for i in range(len(sampled)) if i not in drop], accepted


def rewind(generator: torch.Generator, state: torch.Tensor, rows: int, vocab: int,
           dtype: torch.dtype) -> None:  # fmt: skip
    """Set ``generator`` to where it stands after ``rows`` rows' draws from ``state``:
    the sampler draws ``vocab`` exponential values a sampled row (``gpu.runtime.sampling``),
    so the draws past the rows used are taken back."""
    generator.set_state(state)
    scratch = torch.empty(vocab, dtype=dtype, device=generator.device)
    for _ in range(rows):
        scratch.exponential_(generator=generator)
