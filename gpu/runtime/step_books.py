"""A step's bookkeeping per row, kept to the least Python a row needs (issue 57): the
STEP entries of its rows and the requests they end (``Books``; why one ends after its
newest token: ``finish_reason``).

At batch 256 every line that runs once per row of every step costs about 0.1 ms of the
step, which on a GPU is the whole limit. Almost every row of a decode step is "quiet":
started, without a grammar, stop strings or patterns, or a reasoning budget, and asking
no logprobs or hidden states. What decides such a row's entry is read from its request
once (``quiet_ends``, when its first entry is made) instead of from its parameters every
step; ``token_entries`` makes the entries of a batch, every row that is not quiet or that
ends going to the engine's general path.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from collections.abc import Sequence as Seq
from functools import partial
from typing import Any

import torch

from gpu.runtime.grammar import advance
from gpu.runtime.logprobs import prompt_extra, token_extra
from gpu.runtime.sampling import NON_FINITE
from gpu.runtime.scheduler import Sequence
from wire import Finish, StepEntry, pack_f32s, pack_id
from wire.faults import active_plan, fault_point

__all__ = [
    "NON_FINITE_MESSAGE",
    "Books",
    "finish_reason",
    "quiet_ends",
    "terminal",
    "token_entries",
]

NON_FINITE_MESSAGE = "the model produced non-finite logits (NaN or inf) for this request"

# A StepEntry from its four fields without NamedTuple's keyword-handling ``__new__``:
# 0.13 us a row against 0.21 (the same tuple).
_new_tuple = tuple.__new__


def finish_reason(
    seq: Sequence, eog_ids: Collection[int], decode: Callable[[Seq[int]], str], grammar_end: int
) -> list[Any] | None:
    """The STEP entry's finish (``specs/wire.cddl``) or None: a grammar's refusal, a stop
    id or end of generation, a finished grammar (ended with ``grammar_end``), a stop
    string or pattern in the decoded tail of the output, the length."""
    p, tok = seq.params, seq.tokens[-1]
    if seq.grammar_error is not None:
        return [Finish.ABORT, seq.grammar_error]
    if tok in p.stop_token_ids or (not p.ignore_eos and tok in eog_ids):
        return [Finish.STOP, tok]
    if seq.grammar_done:  # nothing but the end could follow: end now, a step sooner
        return [Finish.STOP, grammar_end]
    if seq.stop_window:
        tail = decode(seq.output[-seq.stop_window :])
        for s in p.stop:
            if s in tail:
                return [Finish.STOP, s]
        for i, pattern in enumerate(seq.stop_patterns):
            m = next((m for m in pattern.finditer(tail) if m.end() > m.start()), None)
            if m is not None:
                return [Finish.STOP, m.group(0), i]
    if seq.num_output >= p.max_new_tokens:
        return [Finish.LENGTH, p.max_new_tokens]
    return None


def quiet_ends(seq: Sequence, eog: Collection[int]) -> frozenset[int] | None:
    """For a started, quiet ``seq``: the sampled ids that end it or need the general
    path (its stop ids, the end-of-generation ids unless ``ignore_eos``, and
    ``NON_FINITE``); None for any other row. What it reads never changes once a
    sequence has started (``gpu.runtime.admission.Admission.sequence`` sets it all)."""
    if not seq.started or seq.stop_window or seq.matcher is not None or seq.budget is not None:
        return None
    p = seq.params
    return frozenset((*p.stop_token_ids, *(() if p.ignore_eos else eog), NON_FINITE))


def token_entries(
    samplers: Seq[Sequence],
    sampled: Seq[int],
    seqs: dict[int, Sequence],
    general: Callable[[Sequence, int, int], StepEntry | None],
    quiet: bool,
) -> list[StepEntry]:
    """Each sampler's STEP entry for its new token ``sampled[i]``, in row order, from
    ``general(seq, i, tok)`` (None: no entry). ``quiet``: the step has no per-token
    extras and no fault plan, so a live quiet row that goes on (its token not in its
    ``ends``, ``max_new_tokens`` not reached) appends the token and gets the plain entry
    here, the one ``general`` would give it."""
    if not quiet:
        rows = enumerate(zip(samplers, sampled, strict=False))
        return [e for i, (seq, tok) in rows if (e := general(seq, i, tok)) is not None]
    out: list[StepEntry] = []
    for i, (seq, tok) in enumerate(zip(samplers, sampled, strict=False)):
        tokens, ends = seq.tokens, seq.ends
        if (
            ends is not None
            and tok not in ends
            and len(tokens) < seq.max_len - 1
            and seqs.get(seq.rid) is seq
        ):
            tokens.append(tok)
            out.append(_new_tuple(StepEntry, (seq.rid, pack_id(tok), None, None)))
        elif (entry := general(seq, i, tok)) is not None:
            out.append(entry)
    return out


def terminal(
    seq: Sequence, new: bytes, finish: list[Any], extra: dict[str, Any] | None = None
) -> StepEntry:
    """``seq``'s terminal STEP entry: ``new`` ids, ``finish`` and its extras, with the
    retractions (and the prompt's length when it never started)."""
    extra = dict(extra or {})
    extra["num_retractions"] = seq.num_retractions
    if seq.drafts is not None:  # it speculated: its proposals' record
        extra.update(seq.drafts.extra())
    if not seq.started:
        extra["prompt_tokens"] = seq.prompt_len
    return StepEntry(seq.rid, new, finish, extra)


class Books:
    """The STEP entries of a step's rows and the requests they end, over the engine's
    live requests (``seqs``, and ``reserved``: rids of forks not yet made, by parent).

    ``end``: a request that ended leaves the live ones and the scheduler; ``fail``: the
    engine's way to end one as failed (an error, no entry)."""

    def __init__(self, seqs: dict[int, Sequence], reserved: dict[int, Sequence],
                 end: Callable[[Sequence], None], fail: Callable[[Sequence, str], None],
                 eog: tuple[int, ...], decode: Callable[[Seq[int]], str],
                 grammar_end: int) -> None:  # fmt: skip
        """``eog``: the model's end-of-generation ids; ``decode``: the tokenizer's (stop
        strings); ``grammar_end``: the id a finished grammar reports."""
        self.seqs, self.reserved, self.end, self.fail = seqs, reserved, end, fail
        self.eog, self._eog_set = eog, frozenset(eog)
        self.decode, self.grammar_end = decode, grammar_end
        # The usual ends (no stop ids; with or without the EOG ids) as one object each, not
        # one per request: each quiet row reads its ends every step, cold after the model.
        usual = (frozenset((*eog, NON_FINITE)), frozenset((NON_FINITE,)))
        self._usual_ends = {ends: ends for ends in usual}

    def embedded(self, seq: Sequence, vec: torch.Tensor) -> StepEntry:
        """An embed request's one STEP entry; its blocks are released now."""
        assert seq.options.embed is not None
        if seq.options.embed.normalize:
            vec = vec / vec.norm().clamp_min(1e-12)
        self.end(seq)
        extra = {
            "cached_tokens": seq.cached_tokens,
            "embedding": pack_f32s(vec.cpu().numpy()),
        }
        return terminal(seq, b"", [Finish.EMBED, vec.numel()], extra)

    def scored(self, seq: Sequence) -> list[StepEntry]:
        """A ``max_new_tokens`` 0 request whose prompt is computed: its terminal entries,
        with the prompt logprobs (one per rid when n > 1); its blocks are released now."""
        self.end(seq)
        extra = {"cached_tokens": seq.cached_tokens, **prompt_extra(seq)}
        out = [terminal(seq, b"", [Finish.LENGTH, 0], extra)]
        for r in [r for r, p in self.reserved.items() if p is seq]:
            del self.reserved[r]
            out.append(terminal(seq, b"", [Finish.LENGTH, 0], extra)._replace(rid=r))
        return out

    def entries(
        self, samplers: Seq[Sequence], sampled: Seq[int], lp: torch.Tensor | None,
        hidden: torch.Tensor | None,
    ) -> list[StepEntry]:  # fmt: skip
        """Each sampler's new token appended and its STEP entry (a terminal one when it
        ended); a sampler whose request ended since its row was scheduled has none."""
        quiet = lp is None and hidden is None and active_plan() is None
        rows = partial(self.entry, lp=lp, hidden=hidden)
        return token_entries(samplers, sampled, self.seqs, rows, quiet)

    def entry(self, seq: Sequence, i: int, tok: int, lp: torch.Tensor | None = None,
              hidden: torch.Tensor | None = None) -> StepEntry | None:  # fmt: skip
        """Row ``i``'s token appended to ``seq`` and its entry; None when it has none."""
        if self.seqs.get(seq.rid) is not seq:
            return None
        if tok == NON_FINITE:
            self.fail(seq, NON_FINITE_MESSAGE)
            return None
        if seq.budget is not None:  # the reasoning's end forced in place of the sample
            tok = seq.budget.next(tok)
        extra = token_extra(seq, i, tok, lp, hidden) if lp is not None or hidden is not None else {}
        if (f := fault_point("worker.sample", seq.rid)) is not None and f.apply():
            extra = {**extra, "logprobs": b"\x01\x02\x03"}  # a malformed field
        tokens, ends = seq.tokens, seq.ends
        tokens.append(tok)
        if seq.matcher is not None:
            seq.grammar_error = advance(seq, tok)
        elif ends is not None and tok not in ends and len(tokens) < seq.max_len:
            # goes on: what emit gives when finish_reason finds nothing
            return StepEntry(seq.rid, pack_id(tok), None, extra or None)
        return self.emit(seq, tok, extra)

    def emit(self, seq: Sequence, tok: int, extra: dict[str, Any]) -> StepEntry:
        """The STEP entry of ``seq``'s new token ``tok``: a terminal one when it ended."""
        if not seq.started:
            seq.started = True
            ends = quiet_ends(seq, self._eog_set)
            seq.ends = ends if ends is None else self._usual_ends.get(ends, ends)
            extra["prompt_tokens"] = seq.prompt_len
            extra["cached_tokens"] = seq.cached_tokens
            extra.update(prompt_extra(seq))
            extra.update(seq.grammar_info)
        finish = finish_reason(seq, self.eog, self.decode, self.grammar_end)
        if finish is None:
            return StepEntry(seq.rid, pack_id(tok), None, extra or None)
        if seq.grammar_done:
            extra["grammar_done"] = True
        self.end(seq)
        return terminal(seq, pack_id(tok), finish, extra)
