"""n > 1 in the engine: the prompt is prefilled once, then each sibling sample forks
from it at its first sampled token (``Engine._finish_step``), sharing the parent's full
KV blocks (reference counted) and copying its partial last block.

A sibling's rid is the parent's plus k; it was reserved at SUBMIT (``Engine.reserved``)
and is gone from there if the client aborted it before the fork. A sibling with no slot
or no block for its partial last block waits and recomputes (the shared prefix is then
a prefix-cache hit). Seeds are the parent's plus k, grammars a copy of its matcher.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from gpu.cache.kv_cache import BlockManager
from gpu.runtime.scheduler import Scheduler, Sequence


class Engine(Protocol):
    """What the fork reads and changes of ``gpu.runtime.engine.Engine``."""

    reserved: dict[int, Sequence]
    seqs: dict[int, Sequence]
    config: Any  # EngineConfig: block_size
    scheduler: Scheduler
    blocks: BlockManager

    def generator(self, seed: int | None) -> torch.Generator | None: ...


__all__ = ["fork_samplers"]


def fork_samplers(
    engine: Engine, samplers: list[Sequence], logits: torch.Tensor, hidden: torch.Tensor | None
) -> tuple[list[Sequence], torch.Tensor, torch.Tensor | None]:
    """n > 1: the prefill is done once; each sibling shares its full blocks.

    A sibling that finds no slot or no block for its partial last block waits and
    recomputes (the shared prefix is then a prefix-cache hit).
    """
    order: list[int] = []
    out: list[Sequence] = []
    for i, seq in enumerate(samplers):
        order.append(i)
        out.append(seq)
        for k in range(1, seq.forks + 1):
            child = _make_child(engine, seq, k)
            if child is not None:
                order.append(i)
                out.append(child)
        seq.forks = 0
    idx = torch.tensor(order, device=logits.device)
    return (
        out,
        logits.index_select(0, idx),
        None if hidden is None else hidden.index_select(0, idx),
    )


def _make_child(engine: Engine, parent: Sequence, k: int) -> Sequence | None:
    rid = parent.rid + k
    if engine.reserved.pop(rid, None) is None:
        return None  # aborted before the fork
    seed = None if parent.params.seed is None else parent.params.seed + k
    child = Sequence(
        rid,
        list(parent.tokens),
        parent.prompt_len,
        parent.params,
        parent.options,
        engine.generator(seed),
        cached_tokens=parent.cached_tokens,
        stop_window=parent.stop_window,
        stop_patterns=parent.stop_patterns,
        prefix_limit=parent.prefix_limit,
        matcher=None if parent.matcher is None else parent.matcher.deep_copy(),
        grammar_info=parent.grammar_info,
        eog_ids=parent.eog_ids,
        budget=None if parent.budget is None else parent.budget.copy(),
    )
    engine.seqs[rid] = child
    sched, bs = engine.scheduler, engine.config.block_size
    full = parent.num_computed // bs
    partial = len(parent.block_table) > full
    if len(sched.running) >= sched.config.max_running or (partial and engine.blocks.num_free < 1):
        sched.waiting.appendleft(child)
        return None
    engine.blocks.incref(parent.block_table[:full])
    child.block_table = parent.block_table[:full]
    if partial:
        (b,) = engine.blocks.allocate(1)
        sched.copy_rows(parent.block_table[full], b, bs)  # made before the next step
        child.block_table.append(b)
    child.block_hashes = list(parent.block_hashes)
    child.prompt_logprobs = list(parent.prompt_logprobs)
    child.num_computed = parent.num_computed
    sched.running.append(child)
    return child
