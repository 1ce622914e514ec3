"""Run an ``Engine`` to the end of a batch of prompts, as the worker would serve them, for
the tests that compare one engine's tokens with another's (graphs, overlap)."""

from __future__ import annotations

from gpu.runtime.engine import Engine
from wire import SubmitEntry, ids_to_list, pack_ids

__all__ = ["run_to_end"]


def run_to_end(engine: Engine, prompts: list[list[int]], params: list[dict]) -> list[list[int]]:
    """Each prompt's new tokens, in the prompts' order (request ids 1..n), the engine
    stepped until it has no work; asserts that nothing was refused and nothing leaked
    (every check clean, every block free or cached)."""
    errors, done = engine.submit(
        [
            SubmitEntry(i + 1, pack_ids(p), s, {})
            for i, (p, s) in enumerate(zip(prompts, params, strict=True))
        ]
    )
    assert not errors, errors
    out: dict[int, list[int]] = {i + 1: [] for i in range(len(prompts))}
    for e in done:
        out[e.rid] += ids_to_list(e.new_ids)
    while engine.has_work:
        for e in engine.step():
            out[e.rid] += ids_to_list(e.new_ids)
    assert not engine.check()
    assert engine.blocks.num_free == engine.blocks.num_blocks
    return [out[i + 1] for i in range(len(prompts))]
