"""Steps with prompt chunks replayed piecewise (``gpu/backends/piecewise.py``): the captured
pieces around an eager attention, checked on the CPU without capture (the
``EagerBackend`` a GPU's ``CudaBackend`` stands in for) against the plain step, token
for token; on a GPU, ``tests/test_graphs.py``'s CUDA test runs them under CUDA graphs.

The engines run in memory (``tests/engine_runs.py``), with a small ``step_tokens`` and
``mixed_prefill_tokens`` so that long prompts are cut into chunks that share steps with
the decodes of the others: prefill-only, mixed and (past the decode graphs' largest
batch) pure-decode steps all go through the pieces, at several padded sizes."""

from __future__ import annotations

import random

import pytest
import torch

from gpu.backends.graphs import EagerBackend
from gpu.backends.piecewise import MixedGraphs, token_sizes
from gpu.cache.kv_cache import PagedKVCache, PrefillChunk
from gpu.model.loader import LoadedModel, load_model
from gpu.runtime.engine import Engine, EngineConfig
from tests.engine_runs import run_to_end
from tests.tiny_gguf import TinyModel

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def lm(tiny_gguf: TinyModel) -> LoadedModel:
    return load_model(tiny_gguf.path, device="cpu")


def _engine(lm: LoadedModel, graphs: str, mixed: str = "auto", step_tokens: int = 64) -> Engine:
    return Engine(lm, EngineConfig(512, 16, 8, 64, step_tokens, 16, decode_graphs=graphs,
                                   mixed_graphs=mixed))  # fmt: skip


def _prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(rng.randrange(3, 120))] for _ in range(n)]


def _run(engine: Engine, prompts: list[list[int]], n: int, sampling: dict | None = None
         ) -> list[list[int]]:  # fmt: skip
    s = {**GREEDY, "max_new_tokens": n, **(sampling or {})}
    return run_to_end(engine, prompts, [s] * len(prompts))


def test_token_sizes_are_powers_of_two_up_to_the_step() -> None:
    assert token_sizes(512) == (16, 32, 64, 128, 256, 512)
    assert token_sizes(100) == (16, 32, 64, 100)
    assert token_sizes(16) == (16,)
    assert token_sizes(5) == (5,)


def test_piecewise_steps_match_the_plain_step(lm: LoadedModel) -> None:
    prompts = _prompts(6, lm.config.vocab_size, seed=3)
    plain = _run(_engine(lm, "off"), prompts, 24)
    engine = _engine(lm, "eager")
    assert engine.runner.mixed is not None and engine.runner.mixed.kind == "eager"
    assert _run(engine, prompts, 24) == plain
    mixed = engine.runner.mixed
    assert mixed.replays > 0
    assert len(mixed.pieces) >= 2  # steps of different sizes padded to different sizes
    assert all(len(p) == lm.config.n_layers + 1 for p in mixed.pieces.values())
    assert (
        engine.runner.graphs is not None and engine.runner.graphs.replays > 0
    )  # decodes stay whole


def test_sampled_steps_and_a_step_over_the_largest_size_match_too(lm: LoadedModel) -> None:
    """Seeded sampling with penalties reads the same logits; a step with more rows than
    the largest size runs eagerly beside the pieces."""
    prompts = _prompts(4, lm.config.vocab_size, seed=4)
    sampling = {"temperature": 0.8, "top_p": 0.9, "seed": 11, "presence_penalty": 0.4}
    plain = _run(_engine(lm, "off"), prompts, 16, sampling)
    engine = _engine(lm, "eager")
    assert engine.runner.mixed is not None
    engine.runner.mixed.sizes = (16,)  # a larger step is over every size
    assert _run(engine, prompts, 16, sampling) == plain
    assert list(engine.runner.mixed.pieces) == [16]


def test_mixed_graphs_off_leaves_those_steps_eager(lm: LoadedModel) -> None:
    engine = _engine(lm, "eager", mixed="off")
    assert engine.runner.mixed is None
    assert _engine(lm, "off").runner.mixed is None  # no decode graphs: no pieces either
    with pytest.raises(ValueError, match="mixed graphs must be one of"):
        _engine(lm, "eager", mixed="sometimes")


def test_padding_rows_reach_neither_the_attention_nor_the_cache(lm: LoadedModel) -> None:
    """Three real rows padded to 16: the cache changes at the three rows' slots only,
    and the trunk's rows equal the plain trunk's."""
    cache = PagedKVCache(lm.config, 8, 16, scratch=True)
    plain_cache = PagedKVCache(lm.config, 8, 16, scratch=True)
    mixed = MixedGraphs(lm.model, cache, None, EagerBackend(), max_tokens=64)
    prompt = [7, 8, 9]
    chunk = PrefillChunk(block_table=[2], start=0, n=3)
    before = cache.k.clone()
    with torch.inference_mode():
        x = mixed.run(prompt, [0, 1, 2], [], [chunk])
        plain_cache.prepare([], [chunk])
        ids = torch.tensor(prompt)
        want = lm.model.trunk(ids, torch.tensor([0, 1, 2]), plain_cache)
    assert x is not None and x.shape == want.shape
    assert torch.equal(x, want)
    changed = (cache.k != before).any(dim=(0, 1, 3)).nonzero().flatten()
    assert changed.tolist() == [2 * 16, 2 * 16 + 1, 2 * 16 + 2]
    assert list(mixed.pieces) == [16]
    with torch.inference_mode():
        assert mixed.run(list(range(65)), list(range(65)), [], []) is None  # over 64 rows
