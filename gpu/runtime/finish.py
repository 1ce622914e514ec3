"""Why a sequence ends after its newest token, if it does (``Engine``'s stop checks)."""

from __future__ import annotations

from collections.abc import Callable, Collection
from collections.abc import Sequence as Seq
from typing import Any

from gpu.runtime.scheduler import Sequence
from wire import Finish

__all__ = ["finish_reason"]


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
