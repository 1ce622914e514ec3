"""A draft model's proposals (``--speculative draft``, ``gpu/runtime/speculation.py``).

The draft model keeps a KV cache of its own with the served model's block layout: the
same number of blocks and block size, read through the same block tables. Every step
the served model runs, the draft model runs too, on the same rows (``mirror``), so the
draft KV of every block is there whenever the served model's is: after prefix hits,
copy-on-write copies, forks and preemptions alike. Before a step whose batch has
speculating sequences, ``fill`` runs the draft model k times on them, one row each, and
takes its greedy tokens as their drafts; those rows write draft KV past the sequences'
computed tokens. Of such a sequence's check rows the mirror then runs only the last
(its last draft token): ``fill`` wrote the others from the same inputs, one row at a
time, which is the same bits as the check's rows together (the kernels' batch
invariance, docs/determinism.md).
"""

from __future__ import annotations

from dataclasses import replace

from gpu.cache.kv_cache import PrefillChunk
from gpu.model.loader import LoadedModel
from gpu.runtime.engine_config import EngineConfig
from gpu.runtime.runner import ModelRunner, StepInput
from gpu.runtime.sampling import sample_greedy
from gpu.runtime.scheduler import Sequence
from gpu.runtime.step import Step

__all__ = ["DraftMismatch", "Drafter"]


class DraftMismatch(ValueError):
    """A draft model that cannot serve beside the served one (its vocabulary or its
    context): the worker refuses to start with the reason."""


class Drafter:
    """The draft model and its cache, beside an engine whose ``config`` it shares (its
    blocks); run eagerly (no graphs), without a disk tier."""

    def __init__(self, draft: LoadedModel, config: EngineConfig, max_context: int,
                 vocab: int) -> None:  # fmt: skip
        if draft.config.vocab_size != vocab:
            raise DraftMismatch(f"the draft model's vocabulary has {draft.config.vocab_size} "
                             f"tokens, the served model's {vocab}: they must be the same")  # fmt: skip
        if draft.config.context_length < max_context:
            raise DraftMismatch(f"the draft model serves {draft.config.context_length} tokens, "
                             f"the served model {max_context}: give --context-length "
                             f"{draft.config.context_length} or less")  # fmt: skip
        eager = replace(config, decode_graphs="off", mixed_graphs="off", prefix_cache_dir=None)
        self.model = draft
        self.runner = ModelRunner(draft, eager, max_context)

    def mirror(self, step: Step) -> None:
        """The draft model's KV of the served model's step: the same rows, no logits;
        of each check's rows (``step.drafts``: ``fill`` ran them this step) only the
        last, the others written by ``fill`` already."""
        bare = replace(step.input, logit_rows=[], want_hidden=False, loads=[])
        self.runner.run(bare if bare.future is not None else _past_fill(bare, step.drafts))

    def fill(self, seqs: list[Sequence]) -> None:
        """Each of ``seqs``' drafts (placeholders, their length decided) as the draft
        model's greedy tokens: pass j feeds every sequence whose draft is longer than j
        its token at position ``num_computed + j`` (its last token, then its draft's)."""
        longest = max(len(s.draft) for s in seqs)
        for j in range(longest):
            rows = [s for s in seqs if len(s.draft) > j]
            ids = [s.tokens[-1] if j == 0 else s.draft[j - 1] for s in rows]
            pos = [s.num_computed + j for s in rows]
            step = StepInput(ids, pos, [(s.block_table, p + 1) for s, p in zip(rows, pos, strict=True)],
                             logit_rows=list(range(len(rows))), all_sampled_decodes=True)  # fmt: skip
            out = self.runner.run(step)
            assert out.logits is not None
            for s, tok in zip(rows, sample_greedy(out.logits), strict=True):
                s.draft[j] = tok


def _past_fill(step: StepInput, drafts: list[tuple[int, Sequence, list[int]]]) -> StepInput:
    """``step`` with each check of ``drafts`` (a prompt chunk of a sequence's last token
    and its draft: ``lay_out``) cut to its last row, a decode row; rows stay decodes
    first, then the chunks left, each in its order. ``step`` itself without checks."""
    if not drafts:
        return step
    checks = {id(seq.block_table) for _, seq, _ in drafts}
    n = len(step.decodes)
    ids, pos, decodes = step.ids[:n], step.pos[:n], list(step.decodes)
    rest_ids: list[int] = []
    rest_pos: list[int] = []
    prefills: list[PrefillChunk] = []
    row = n
    for c in step.prefills:
        if id(c.block_table) in checks:
            last = row + c.n - 1
            ids.append(step.ids[last])
            pos.append(step.pos[last])
            decodes.append((list(c.block_table), c.start + c.n))
        else:
            rest_ids += step.ids[row : row + c.n]
            rest_pos += step.pos[row : row + c.n]
            prefills.append(c)
        row += c.n
    return replace(step, ids=ids + rest_ids, pos=pos + rest_pos, decodes=decodes,
                   prefills=prefills, all_sampled_decodes=False)  # fmt: skip
