"""A step as one value (issue 57): what the scheduler's batch becomes before the model
runs, and what the model gives back, in one place.

``lay_out`` turns a batch of (sequence, rows) into a ``Step``: the runner's input
(``StepInput``: token ids and positions in row order, the decode rows and prompt
chunks, which rows need logits, the KV copies to make first) and the host's books of
it (which sequences sample, score their prompt or pool it, and the logprob rows). The
engine runs ``step.input`` and records the model's output on it (``ran``, with the embed
vectors ``pool`` makes of it); what is then left is the host's: ``Engine._settle``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import Tensor

from gpu.cache.kv_cache import PrefillChunk
from gpu.runtime.logprobs import LogprobRows, prompt_logprob_rows
from gpu.runtime.overlap import InFlight
from gpu.runtime.runner import StepInput, StepOutput
from gpu.runtime.scheduler import Sequence

__all__ = ["Step", "lay_out", "pool"]


@dataclass(slots=True)
class Step:
    """One engine step: its batch, the runner's input, the host's books and, once run,
    the model's output."""

    batch: list[tuple[Sequence, int]]
    input: StepInput = field(default_factory=StepInput)
    rows: LogprobRows = field(default_factory=LogprobRows)
    samplers: list[Sequence] = field(default_factory=list)  # rows that sample a token
    scored: list[Sequence] = field(default_factory=list)  # max_new_tokens 0: prompt only
    pooling: list[tuple[Sequence, int, int]] = field(default_factory=list)  # seq, row, rows
    logits: Tensor | None = None  # of ``input.logit_rows``, once run
    hidden: Tensor | None = None
    pooled: list[tuple[Sequence, Tensor]] = field(default_factory=list)  # embed requests
    # Speculating sequences (``gpu/runtime/speculation.py``): (first of its rows in
    # ``samplers``, the sequence, its draft); its rows are that one and ``len(draft)`` more.
    drafts: list[tuple[int, Sequence, list[int]]] = field(default_factory=list)

    def ran(self, out: StepOutput, pooled: list[tuple[Sequence, Tensor]]) -> None:
        """The model's output for this step (and the embed requests' pooled vectors)."""
        self.logits, self.hidden, self.pooled = out.logits, out.hidden, pooled


def lay_out(
    batch: list[tuple[Sequence, int]],
    prev: InFlight | None,
    copies: list[tuple[int, int, int]] | None = None,
    loads: list[tuple[int, Tensor, Tensor]] | None = None,
) -> Step:
    """``batch``'s rows in order: a decode that samples (the common row) takes the short
    way; prompt chunks add their prompt-logprob rows, the last row of a finished prompt
    samples (or scores, or pools). ``prev``: the overlapped step still in flight, whose
    sampled tokens some rows read on the device; ``copies``: the KV copies the
    scheduler decided for this step (``Scheduler.take_copies``), in order; ``loads``: the
    blocks read back from disk for it (``Scheduler.take_loads``), written first."""
    step = Step(batch, StepInput(copies=copies or [], loads=loads or []))
    inp, rows, samplers = step.input, step.rows, step.samplers
    ids, pos, decodes, prefills = inp.ids, inp.pos, inp.decodes, inp.prefills
    future_rows: list[int] = []  # rows whose input the step in flight sampled
    future_src: list[int] = []
    sample_rows = rows.sample_rows
    for seq, n in batch:
        c, row = seq.num_computed, len(ids)
        if seq.future is not None and c + n == len(seq.tokens):
            future_rows.append(row + n - 1)
            future_src.append(seq.future)
        if n == 1 and seq.started and c + 1 == len(seq.tokens):
            ids.append(seq.tokens[c])
            pos.append(c)
            decodes.append((seq.block_table, c + 1))
            sample_rows.append(row)
            samplers.append(seq)
            continue
        if seq.draft:  # its last token and the draft, every row sampled
            step.drafts.append((len(samplers), seq, seq.draft))
            ids.append(seq.tokens[c])
            ids += seq.draft
            pos += range(c, c + n)
            prefills.append(PrefillChunk(seq.block_table, c, n))
            sample_rows += range(row, row + n)
            samplers += [seq] * n
            continue
        ids += seq.tokens[c : c + n]
        pos += range(c, c + n)
        if n == 1:
            decodes.append((seq.block_table, c + 1))
        else:
            prefills.append(PrefillChunk(seq.block_table, c, n))
        if seq.options.embed is not None:
            step.pooling.append((seq, row, n))  # prefill only: nothing is sampled
            continue
        if not seq.started:
            prompt_logprob_rows(seq, c, n, row, rows)
        if c + n == len(seq.tokens) and seq.params.max_new_tokens == 0:
            step.scored.append(seq)
        elif c + n == len(seq.tokens):
            rows.add_sample(row + n - 1)
            samplers.append(seq)
    if future_rows:
        assert prev is not None, "a placeholder token with no step in flight"
        inp.future = (future_rows, future_src, prev.on_device)
    inp.logit_rows = rows.indices
    inp.want_hidden = any(s.options.return_hidden_states for s in samplers)
    inp.all_sampled_decodes = len(samplers) == len(decodes) == len(batch)
    return step


def pool(
    final_norm: Callable[[Tensor], Tensor], x: Tensor, pooling: list[tuple[Sequence, int, int]]
) -> list[tuple[Sequence, Tensor]]:
    """Pool this step's final hidden rows ``x`` (each embed request: its sequence, first
    row, rows); the vectors of those whose prefill this step completes. Mean pooling sums
    over the chunks, in fp32."""
    done = []
    for seq, row, n in pooling:
        last = seq.num_computed + n == len(seq.tokens)
        if seq.options.embed is None or seq.options.embed.pooling == "last":
            if last:
                done.append((seq, final_norm(x[row + n - 1]).float()))
            continue
        part = final_norm(x[row : row + n]).float().sum(0)
        seq.pooled = part if seq.pooled is None else seq.pooled + part
        if last:
            done.append((seq, seq.pooled / len(seq.tokens)))
    return done
