"""A SUBMIT entry made a sequence, or refused: the engine's admission (``Engine.submit``).

Its prompt and options are checked against the model (token ids in the vocabulary) and
the engine's bounds (the context, the credits), and what the sequence needs every step is
worked out once here: its generator, stop window and patterns, grammar matcher, reasoning
budget, and how much of its prompt the prefix cache may give it.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from gpu.runtime.grammar import Grammars
from gpu.runtime.sampling import parse_request
from gpu.runtime.scheduler import Sequence
from wire import MAX_N, SubmitEntry, ids_to_list
from wire.options import RequestOptions
from wire.reasoning_budget import BudgetState
from wire.sampling import STOP_REGEX_WINDOW

__all__ = ["Admission", "ProtocolError", "TooLong", "declared_n", "prefills"]

# A request's options as this one object when they are all defaults (most requests): a
# step reads every row's options, and one object stays in the cache where a batch of
# equal copies would each be read cold.
_PLAIN = RequestOptions()


class ProtocolError(ValueError):
    """The frontend broke the protocol (e.g. reused a live rid): the connection must close."""


class TooLong(ValueError):
    """The request can never fit the context or the KV budget (REQ-ERROR "too_long")."""


def prefills(seq: Sequence) -> bool:
    """Whether a request must run its prompt: always unless it asks for no tokens, and
    then still when it embeds or scores the prompt (SGLang's prompt logprobs with
    ``max_new_tokens`` 0)."""
    o = seq.options
    return (
        seq.params.max_new_tokens > 0
        or o.embed is not None
        or (o.return_logprob and o.logprob_start_len >= 0)
    )


def declared_n(e: SubmitEntry) -> int:
    """The entry's n when it is a usable count (else 1): how many rids an error covers."""
    n = e.sampling.get("n", 1) if isinstance(e.sampling, dict) else 1
    return n if type(n) is int and 1 <= n <= MAX_N else 1


class Admission:
    """What an engine admits requests against: the model's vocabulary and end ids, the
    largest context, the credits, the grammars and where a request's generator comes
    from (``Engine.generator``)."""

    def __init__(self, vocab: int, eog: tuple[int, ...], max_context: int, max_pending: int,
                 grammars: Grammars,
                 generator: Callable[[int | None], torch.Generator | None]) -> None:  # fmt: skip
        self.vocab, self.eog = vocab, eog
        self.max_context, self.max_pending = max_context, max_pending
        self.grammars, self.generator = grammars, generator

    def sequence(self, e: SubmitEntry, held: Callable[[int], bool], live: int) -> Sequence:
        """``e`` as a sequence; ``held``: whether a rid is live, ``live``: how many are.
        ``ProtocolError`` for a live rid, ``TooLong`` past the context, ``ValueError`` for
        anything else it refuses."""
        v = self.vocab
        prompt = ids_to_list(e.prompt)
        params, opts = parse_request(e.sampling, e.options, v, len(prompt))
        if opts == _PLAIN:
            opts = _PLAIN
        if any(held(r) for r in range(e.rid, e.rid + params.n)):
            raise ProtocolError(f"rid {e.rid} (n={params.n}) overlaps a live request")
        if not prompt:
            raise ValueError("the prompt is empty")
        if min(prompt) < 0 or max(prompt) >= v:
            raise ValueError(f"prompt has token ids outside [0, {v - 1}]")
        total = len(prompt) + (0 if opts.embed is not None else params.max_new_tokens)
        if total > self.max_context:
            raise TooLong(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({params.max_new_tokens}) = {total} "
                f"exceeds the maximum context of {self.max_context} tokens"
            )
        if live + params.n > self.max_pending:
            raise ValueError(
                f"credit limit exceeded: {live} rids live, max_pending {self.max_pending}"
            )
        seq = Sequence(e.rid, prompt, len(prompt), params, opts, self.generator(params.seed))
        seq.eog_ids = self.eog
        seq.forks = params.n - 1
        if opts.reasoning_budget is not None:
            seq.budget = BudgetState(opts.reasoning_budget)
        if opts.return_logprob and opts.logprob_start_len >= 0:
            # Positions whose logits score prompt tokens must be computed, not reused.
            seq.prefix_limit = max(opts.logprob_start_len - 1, 0)
        if opts.embed is not None and opts.embed.pooling == "mean":
            seq.prefix_limit = 0  # every position's hidden state is pooled: none is reused
        if params.stop:
            seq.stop_window = max(len(s) for s in params.stop) + 2
        if params.stop_regex:  # checked by from_wire: bounded, valid
            seq.stop_patterns = tuple(re.compile(p) for p in params.stop_regex)
            seq.stop_window = max(seq.stop_window, STOP_REGEX_WINDOW)
        if params.grammar is not None:
            compiled = self.grammars.compile(params.grammar)
            seq.matcher = compiled.matcher
            seq.grammar_info = {
                "grammar_compile_ms": round(compiled.compile_ms, 3),
                "grammar_cached": compiled.cached,
            }
        return seq
