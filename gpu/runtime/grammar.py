"""Grammar-constrained sampling: one llguidance matcher per constrained sample.

A SUBMIT entry's ``grammar`` (``wire/grammar.py``) is compiled against the worker's
tokenizer into an ``llguidance.LLMatcher``; each step, the rows of constrained samples get
the matcher's allowed-token mask (computed for all of them in one parallel call, on the
CPU, while nothing else runs) applied to their logits in place before sampling (a C loop
that skips all-allowed words, ``gpu/kernels/csrc/token_mask.c``; torch ops without it), and the sampled
token is then consumed by the matcher. Rows without a grammar are not touched: a batch
with no constrained sample runs exactly as before.

Compiling is the costly part (a JSON schema takes about a millisecond, a large grammar
more), so compiled matchers are kept by their (kind, source), least recently used first
out, and each request gets a ``deep_copy`` of one in its initial state; a forked sample
(``n`` > 1) copies its parent's, which has consumed nothing yet.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

from modelfile.tokenizer import Tokenizer
from wire.grammar import to_llguidance

__all__ = [
    "CompiledGrammar",
    "Constrained",
    "Grammars",
    "advance",
    "allowed_tokens",
    "draft_matchers",
]


class CompiledGrammar:
    """A fresh matcher for one request, and how it was had (for the request's trace)."""

    __slots__ = ("cached", "compile_ms", "matcher")

    def __init__(self, matcher: object, compile_ms: float, cached: bool) -> None:
        self.matcher = matcher
        self.compile_ms = compile_ms
        self.cached = cached


class Grammars:
    """The worker's grammar compiler: the tokenizer view, built on first use (about
    0.3 s for a 49k vocabulary), and the compiled matchers by source."""

    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, eog_ids: Sequence[int], cache_size: int = 128
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eog = list(eog_ids)
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._cache_size = cache_size
        self._lltok: Any = None
        self._executor: Any = None

    def _llguidance_tokenizer(self) -> Any:
        if self._lltok is None:
            import llguidance

            self._lltok = llguidance.LLTokenizer(
                self._tokenizer.backend.to_str(), n_vocab=self.vocab_size, eos_token=self._eog
            )
            self._executor = llguidance.LLExecutor()
        return self._lltok

    def compile(self, grammar: tuple[str, str]) -> CompiledGrammar:
        """A matcher for one request; ``ValueError`` with the library's message when the
        grammar does not compile (the request's REQ-ERROR ``invalid``)."""
        import llguidance

        t0 = time.perf_counter()
        base = self._cache.get(grammar)
        cached = base is not None
        if base is None:
            matcher = llguidance.LLMatcher(self._llguidance_tokenizer(), to_llguidance(*grammar))
            if matcher.is_error():
                raise ValueError(f"{grammar[0]} does not compile: {matcher.get_error()}")
            base = self._cache[grammar] = matcher
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(grammar)
        fresh = base.deep_copy()  # type: ignore[attr-defined]
        return CompiledGrammar(fresh, (time.perf_counter() - t0) * 1e3, cached)

    def masks(self, matchers: Sequence[object]) -> torch.Tensor:
        """The packed allowed-token masks of each matcher's next position: int32
        [K, ceil(vocab / 32)], token ``t`` at bit ``t % 32`` of word ``t // 32``."""
        from llguidance.numpy import fill_next_token_bitmask_par

        self._llguidance_tokenizer()
        words = (self.vocab_size + 31) // 32
        bitmask = np.zeros((len(matchers), words), dtype=np.int32)
        fill_next_token_bitmask_par(
            self._executor,
            [(m, i) for i, m in enumerate(matchers)],  # type: ignore[misc]
            bitmask,
        )
        return torch.from_numpy(bitmask)

    def constrain(
        self, samples: Sequence[Constrained], matchers: Sequence[object] | None = None
    ) -> tuple[list[int], torch.Tensor] | None:
        """The step's constrained rows and their masks, for ``gpu.runtime.sampling.sample``.
        ``matchers``: each row's matcher when not its sample's own (a speculating
        sample's rows past its first: ``draft_matchers``)."""
        each = [s.matcher for s in samples] if matchers is None else matchers
        rows = [i for i, m in enumerate(each) if m is not None]
        if not rows:
            return None
        return rows, self.masks([each[i] for i in rows])


class Constrained(Protocol):
    matcher: Any
    grammar_done: bool


def advance(sample: Constrained, token: int) -> str | None:
    """Feed the sampled token to the sample's matcher: None, or why it was refused (a
    token outside the mask: a bug, reported as the sample's abort)."""
    m = sample.matcher
    if m is None:
        return None
    if not m.consume_token(token):
        return f"the grammar refused token {token}: {m.get_error()}"
    sample.grammar_done = m.is_stopped()
    return None


def draft_matchers(
    samples: Sequence[Constrained], drafts: Sequence[tuple[int, Constrained, list[int]]]
) -> list[object] | None:
    """Each row's matcher in a step with speculating samples (``drafts``: first row,
    sample, draft): row j of a constrained sample's group is its matcher after the
    draft's first j tokens (a copy; the draft was cut where the grammar refuses it).
    None when no speculating sample is constrained."""
    if not any(s.matcher is not None for _, s, _ in drafts):
        return None
    matchers = [s.matcher for s in samples]
    for first, s, draft in drafts:
        if s.matcher is None:
            continue
        m = s.matcher.deep_copy()
        for j, tok in enumerate(draft, 1):
            m.consume_token(tok)
            matchers[first + j] = m if j == len(draft) else m.deep_copy()
    return matchers


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """llguidance's packed mask (int32 words, token ``i`` at bit ``i % 32`` of word
    ``i // 32``, little-endian) -> bool [K, vocab_size]."""
    packed = bitmask.contiguous().numpy().view(np.uint8)
    bits = np.unpackbits(packed, axis=1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(bits.view(np.bool_))
