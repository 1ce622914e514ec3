"""A step's bookkeeping per row, kept to the least Python a row needs (issue 57).

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

from gpu.sampling import NON_FINITE
from gpu.scheduler import Sequence
from wire import StepEntry, pack_id

__all__ = ["quiet_ends", "token_entries"]

# A StepEntry from its four fields without NamedTuple's keyword-handling ``__new__``:
# 0.13 us a row against 0.21 (the same tuple).
_new_tuple = tuple.__new__


def quiet_ends(seq: Sequence, eog: Collection[int]) -> frozenset[int] | None:
    """For a started, quiet ``seq``: the sampled ids that end it or need the general
    path (its stop ids, the end-of-generation ids unless ``ignore_eos``, and
    ``NON_FINITE``); None for any other row. What it reads never changes once a
    sequence has started (``Engine._make_sequence`` sets it all)."""
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
