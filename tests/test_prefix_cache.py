"""The prefix cache to the token (issue 22): a prefix hit that ends inside a block copies
the matched rows of that block (copy-on-write), so ``cached_tokens`` counts every
reused token, while sharing, reference counts and freeing stay sound and outputs stay
those of a cold run.

The exact figure for a repeated prompt of L tokens is L - 1: the last prompt token is
always fed again, because its logits give the first output token and logits are not
kept (SGLang's radix cache stops its match at the same place, ``input_len - 1``).
"""

from __future__ import annotations

import pytest
import torch

from gpu.model.loader import LoadedModel, load_model
from gpu.runtime.engine import Engine, EngineConfig
from tests.test_worker_engine import GREEDY, dense_greedy, ids_of, prompts, run
from tests.tiny_gguf import TinyModel, TinySpec, write_tiny_gguf
from wire import SubmitEntry, f32s_to_list, ids_to_list, pack_ids


@pytest.fixture(scope="module")
def lm(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """The tiny model with room for a 4,999-token prompt."""
    tiny: TinyModel = write_tiny_gguf(
        tmp_path_factory.mktemp("gguf") / "long.gguf", TinySpec(context_length=6144)
    )
    return load_model(tiny.path, device="cpu")


def _cached(got: dict, rid: int) -> int:
    return got[rid][0].extra["cached_tokens"]


@pytest.mark.parametrize("new_tokens", [1, 20], ids=["head-only", "block-filled"])
def test_a_repeated_100_token_prompt_reuses_99_tokens(lm: LoadedModel, new_tokens: int) -> None:
    """With one output token the last block (rows 96..99) is never full, so only its
    publication at release makes it reusable; with 20 the output fills it and it is a
    registered whole block whose head is copied."""
    engine = Engine(lm, EngineConfig(kv_blocks=64, block_size=16))
    p = prompts(1, lm.config.vocab_size, seed=21, lo=100, hi=101)[0]
    s = {**GREEDY, "max_new_tokens": new_tokens}
    cold = run(engine, [(1, p, s, {})])
    warm = run(engine, [(2, p, s, {})])
    assert _cached(cold, 1) == 0 and _cached(warm, 2) == 99
    assert ids_of(warm[2]) == ids_of(cold[1]) == dense_greedy(lm, p, new_tokens)[0]
    again = run(engine, [(3, p, s, {})])  # the copy left its source intact
    assert _cached(again, 3) == 99 and ids_of(again[3]) == ids_of(cold[1])


def test_a_repeated_4999_token_prompt_reuses_4998_tokens(lm: LoadedModel) -> None:
    engine = Engine(lm, EngineConfig(kv_blocks=330, block_size=16))
    p = prompts(1, lm.config.vocab_size, seed=22, lo=4999, hi=5000)[0]
    s = {**GREEDY, "max_new_tokens": 4}
    cold = run(engine, [(1, p, s, {})])
    warm = run(engine, [(2, p, s, {})])
    assert len(p) == 4999 and _cached(warm, 2) == 4998  # 312 whole blocks + 6 copied rows
    assert ids_of(warm[2]) == ids_of(cold[1])


def test_a_prompt_diverging_mid_block_reuses_the_shared_tokens(lm: LoadedModel) -> None:
    engine = Engine(lm, EngineConfig(kv_blocks=64, block_size=16))
    v = lm.config.vocab_size
    p, tail = prompts(2, v, seed=23, lo=60, hi=61)
    q = p[:37] + tail[:20]
    run(engine, [(1, p, {**GREEDY, "max_new_tokens": 3}, {})])
    got = run(engine, [(2, q, {**GREEDY, "max_new_tokens": 8}, {})])
    shared = next(i for i, (x, y) in enumerate(zip(p, q, strict=False)) if x != y)
    assert _cached(got, 2) == shared >= 37
    assert ids_of(got[2]) == dense_greedy(lm, q, 8)[0]


def test_concurrent_hits_share_whole_blocks_and_own_their_copies(lm: LoadedModel) -> None:
    """Three requests on one cached 40-token prefix: the two whole blocks are shared
    (reference count 3), each copies the head of the third into a block of its own."""
    engine = Engine(lm, EngineConfig(kv_blocks=64, block_size=16))
    v = lm.config.vocab_size
    p = prompts(1, v, seed=24, lo=40, hi=41)[0]
    run(engine, [(1, p, {**GREEDY, "max_new_tokens": 2}, {})])
    tails = prompts(3, v, seed=25, lo=5, hi=6)
    reqs = [(10 + i, p + t, {**GREEDY, "max_new_tokens": 5}, {}) for i, t in enumerate(tails)]
    engine.submit([SubmitEntry(r, pack_ids(q), s, o) for r, q, s, o in reqs])
    first = engine.step()
    assert {e.extra["cached_tokens"] for e in first} == {40}
    tables = [engine.seqs[r].block_table for r, *_ in reqs]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    assert all(engine.blocks.ref[b] == 3 for b in tables[0][:2])
    assert len({t[2] for t in tables}) == 3 and all(engine.blocks.ref[t[2]] == 1 for t in tables)
    assert engine.check() == []
    got = run(engine, [])
    for (r, q, _, _), e in zip(reqs, first, strict=True):
        assert ids_to_list(e.new_ids) + ids_of(got[r]) == dense_greedy(lm, q, 5)[0]


def test_prompt_logprobs_still_compute_their_positions(lm: LoadedModel) -> None:
    """A request asking prompt logprobs from position 30 reuses only the tokens before
    29 (the row scoring token 30 must be computed), to the token."""
    engine = Engine(lm, EngineConfig(kv_blocks=64, block_size=16))
    p = prompts(1, lm.config.vocab_size, seed=26, lo=50, hi=51)[0]
    run(engine, [(1, p, {**GREEDY, "max_new_tokens": 2}, {})])
    opts = {"return_logprob": True, "logprob_start_len": 30}
    got = run(engine, [(2, p, {**GREEDY, "max_new_tokens": 2}, opts)])
    assert _cached(got, 2) == 29
    lp = f32s_to_list(got[2][0].extra["prompt_logprobs"])
    cold = run(Engine(lm, EngineConfig(kv_blocks=64, block_size=16)), [(3, p, {**GREEDY,
               "max_new_tokens": 2}, opts)])  # fmt: skip
    assert lp == pytest.approx(f32s_to_list(cold[3][0].extra["prompt_logprobs"]), abs=1e-5)


def test_cache_under_eviction_pressure_stays_sound(lm: LoadedModel) -> None:
    """Many prompts sharing heads of varied lengths through a small cache: published
    partial blocks are evicted, dropped when a longer one covers them, flushed; every
    run frees everything and matches the oracle."""
    engine = Engine(lm, EngineConfig(kv_blocks=14, block_size=4, step_tokens=16))
    v = lm.config.vocab_size
    base = prompts(1, v, seed=27, lo=30, hi=31)[0]
    for i, extra in enumerate(prompts(12, v, seed=28, lo=1, hi=6)):
        q = base[: 3 + (i * 5) % 25] + extra
        got = run(engine, [(i, q, {**GREEDY, "max_new_tokens": 3}, {})])
        assert ids_of(got[i]) == dense_greedy(lm, q, 3)[0], i
    assert engine.flush()[0] and engine.blocks.num_cached == 0 and engine.check() == []


def test_a_hits_copy_rides_in_its_step_and_is_made_before_the_model_runs(
    lm: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 57, point 3: scheduling a hit that ends inside a block only records its copy
    (the KV is untouched then); the step value carries it (``StepInput.copies``) and the
    runner makes it before the model reads the cache."""
    engine = Engine(lm, EngineConfig(kv_blocks=64, block_size=16))
    p = prompts(1, lm.config.vocab_size, seed=23, lo=40, hi=41)[0]
    s = {**GREEDY, "max_new_tokens": 1}
    cold = run(engine, [(1, p, s, {})])
    seen = []
    real = engine.runner.run

    def spy(step):  # type: ignore[no-untyped-def]
        seen.append((list(step.copies), engine.cache.k.clone()))
        return real(step)

    monkeypatch.setattr(engine.runner, "run", spy)
    warm = run(engine, [(2, p, s, {})])
    assert _cached(warm, 2) == 39 and ids_of(warm[2]) == ids_of(cold[1])
    (src, dst, n), k = seen[0][0][0], seen[0][1]
    assert n == 39 - 32 and [c for c, _ in seen[1:]] == [[]] * (len(seen) - 1)
    rows = slice(src * 16, src * 16 + n), slice(dst * 16, dst * 16 + n)
    assert not torch.equal(k[:, :, rows[0]], k[:, :, rows[1]])  # not yet made
    assert torch.equal(engine.cache.k[:, :, rows[0]], engine.cache.k[:, :, rows[1]])
