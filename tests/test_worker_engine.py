"""The engine in memory on a tiny GGUF: paged cache, scheduler, sampling, logprobs.

The oracle for "run alone" is the contiguous ``DenseKVCache`` (``tests/dense_cache.py``),
which shares no code with the paged cache; the first tests check that the two backends
give the same logits and that the offline ``generate`` (the engine) matches it.
"""

from __future__ import annotations

import math
import random
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpu.cache.kv_cache import BlockManager, PagedKVCache, PrefillChunk, PrefixHit
from gpu.model.loader import LoadedModel, load_model
from gpu.runtime.engine import Engine, EngineConfig, ProtocolError
from gpu.worker.generate import greedy_generate
from tests.dense_cache import DenseKVCache
from tests.model_steps import forward
from tests.tiny_gguf import TinyModel
from wire import StepEntry, SubmitEntry, f32s_to_list, ids_to_list, pack_ids

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def lm(tiny_gguf: TinyModel) -> LoadedModel:
    """fp32 weights: the dense oracle below is compared at 1e-4, which the quantized
    kernel's int8 rounding of activations does not keep across batch shapes."""
    return load_model(tiny_gguf.path, device="cpu", weights="fp32")


def dense_greedy(
    lm: LoadedModel, prompt: list[int], n: int
) -> tuple[list[int], list[torch.Tensor]]:
    cache = DenseKVCache(lm.config, 1, len(prompt) + n)
    out: list[int] = []
    rows = []
    ids = prompt
    with torch.inference_mode():
        for _ in range(n):
            pos = cache.positions([0], [len(ids)])
            cache.prepare([0], [len(ids)])
            logits = lm.model(torch.tensor(ids), pos, cache)
            rows.append(logits)
            out.append(int(logits[-1].argmax()))
            ids = [out[-1]]
    return out, rows


def run(
    engine: Engine, reqs: list[tuple[int, list[int], dict, dict]]
) -> dict[int, list[StepEntry]]:
    errors, done = engine.submit([SubmitEntry(r, pack_ids(p), s, o) for r, p, s, o in reqs])
    assert not errors, errors
    got: dict[int, list[StepEntry]] = {}
    for e in done:
        got.setdefault(e.rid, []).append(e)
    for _ in range(10_000):
        if not engine.has_work:
            break
        for e in engine.step():
            got.setdefault(e.rid, []).append(e)
    assert not engine.check(), engine.check()
    assert engine.blocks.num_free == engine.blocks.num_blocks
    return got


def ids_of(entries: list[StepEntry]) -> list[int]:
    assert entries[-1].finish is not None and all(e.finish is None for e in entries[:-1])
    return [t for e in entries for t in ids_to_list(e.new_ids)]


def prompts(n: int, vocab: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


Step = list[tuple[int, list[int]]]  # (sequence, its new tokens) in token order


def _forward_both(
    lm: LoadedModel,
    paged: PagedKVCache,
    dense: DenseKVCache,
    tables: list[list[int]],
    lens: list[int],
    step: Step,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step on each backend: one new token after a cached context is a decode (the
    paged cache takes those first), anything else a prefill chunk."""
    is_decode = [len(t) == 1 and lens[q] > 0 for q, t in step]
    n_dec = sum(is_decode)
    assert all(is_decode[:n_dec]), "decodes come first in a step"
    decodes = [(tables[q], lens[q] + 1) for q, _ in step[:n_dec]]
    chunks = [PrefillChunk(tables[q], lens[q], len(t)) for q, t in step[n_dec:]]
    ids = torch.tensor([i for _, t in step for i in t])
    pos = torch.tensor([p for q, t in step for p in range(lens[q], lens[q] + len(t))])
    assert torch.equal(dense.positions([q for q, _ in step], [len(t) for _, t in step]), pos)
    paged.prepare(decodes, chunks)
    dense.prepare([q for q, _ in step], [len(t) for _, t in step])
    for q, t in step:
        lens[q] += len(t)
    with torch.inference_mode():
        return forward(lm.model, paged, ids, pos), lm.model(ids, pos, dense)


@pytest.mark.parametrize("native", [False, None], ids=["torch-decode", "native-decode"])
def test_dense_oracle_and_paged_cache_give_the_same_logits(
    lm: LoadedModel, native: bool | None
) -> None:
    """Fresh prefills, a chunk after a cached prefix, a prefill sharing a step with a
    decode, then batched decodes whose contexts cross block edges, on block tables out
    of order: every row's logits agree between the two backends."""
    paged = PagedKVCache(lm.config, 15, 4, native=native)
    dense = DenseKVCache(lm.config, 3, 20)
    tables = [[5, 1, 9, 2, 7], [0, 3, 11, 4, 6], [8, 10, 12, 13, 14]]  # 20 positions each
    a, b, c = prompts(3, lm.config.vocab_size, seed=11, lo=5, hi=11)
    lens = [0, 0, 0]
    steps: list[Step] = [
        [(0, a), (1, b[:3])],
        [(0, [42]), (1, b[3:]), (2, c)],
        *([(0, [7 + k]), (1, [9]), (2, [200 - k])] for k in range(4)),
    ]
    for i, step in enumerate(steps):
        got, want = _forward_both(lm, paged, dense, tables, lens, step)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=f"step {i}")
    assert lens == [dense.length(q) for q in range(3)] == [len(a) + 5, len(b) + 4, len(c) + 4]


def test_offline_generate_runs_the_engine_and_matches_the_oracle(lm: LoadedModel) -> None:
    eog = lm.tokenizer.eog_ids
    for p in prompts(4, lm.config.vocab_size, seed=12):
        want = dense_greedy(lm, p, 10)[0]
        cut = next((i for i, t in enumerate(want) if t in eog), len(want))
        assert greedy_generate(lm, p, 10) == want[:cut]


def test_block_manager_prefix_sharing_lru_and_integrity() -> None:
    bm = BlockManager(4, 2)
    a = bm.allocate(2)
    h0 = bm.register(a[0], None, [1, 2])
    bm.register(a[1], h0, [3, 4])
    hit = bm.match_prefix([1, 2, 3, 4, 5], 4)
    blocks = hit.blocks
    assert blocks == a and bm.ref[a[0]] == 2 and len(hit.hashes) == 2 and hit.partial is None
    miss = bm.match_prefix([1, 9, 3, 4], 4)  # chained: a different first block misses
    assert miss.blocks == [] and miss.partial == a[0] and miss.partial_len == 1  # but [1] is
    bm.release([a[0]])
    assert bm.check([a, blocks]) == []
    bm.release(blocks)
    bm.release(a)
    assert bm.num_cached == 2 and bm.num_free == 4 and bm.check([]) == []
    fresh = bm.allocate(3)  # two free, then the LRU cached block is evicted
    assert a[0] in fresh and a[1] not in fresh
    assert bm.match_prefix([1, 2, 3, 4], 4) == PrefixHit([], [])
    assert "refcount" in " ".join(bm.check([]))
    with pytest.raises(ValueError):
        bm.release([a[1], a[1]])


@pytest.mark.parametrize(("step_tokens", "block_size"), [(512, 16), (7, 4)])
def test_batch_equals_alone_across_chunks_and_blocks(
    lm: LoadedModel, step_tokens: int, block_size: int
) -> None:
    engine = Engine(lm, EngineConfig(kv_blocks=400, block_size=block_size, step_tokens=step_tokens))
    ps = prompts(12, lm.config.vocab_size)
    got = run(engine, [(i, p, {**GREEDY, "max_new_tokens": 8}, {}) for i, p in enumerate(ps)])
    for i, p in enumerate(ps):
        assert ids_of(got[i]) == dense_greedy(lm, p, 8)[0], i
        assert got[i][0].extra["prompt_tokens"] == len(p) and got[i][-1].finish == ["length", 8]


def test_tiny_kv_budget_preempts_and_every_request_completes(lm: LoadedModel) -> None:
    engine = Engine(lm, EngineConfig(kv_blocks=24, block_size=4, step_tokens=64))
    ps = prompts(10, lm.config.vocab_size, seed=3, lo=10, hi=30)
    got = run(engine, [(i, p, {**GREEDY, "max_new_tokens": 40}, {}) for i, p in enumerate(ps)])
    retractions = [got[i][-1].extra["num_retractions"] for i in range(10)]
    assert sum(retractions) > 0
    for i, p in enumerate(ps):
        assert ids_of(got[i]) == dense_greedy(lm, p, 40)[0], i


def test_unfittable_refused_and_duplicate_rid_is_a_protocol_error(lm: LoadedModel) -> None:
    engine = Engine(lm, EngineConfig(kv_blocks=8, block_size=4))
    errors, _ = engine.submit([SubmitEntry(1, pack_ids([5] * 20), {"max_new_tokens": 13}, {})])
    assert errors and errors[0][1] == "too_long" and "32 tokens" in errors[0][2]
    assert engine.submit([SubmitEntry(2, pack_ids([5] * 20), {"max_new_tokens": 12}, {})]) == (
        [],
        [],
    )
    with pytest.raises(ProtocolError):
        engine.submit([SubmitEntry(2, pack_ids([5]), {}, {})])


def test_abort_waiting_and_running_frees_blocks_at_once(lm: LoadedModel) -> None:
    engine = Engine(lm, EngineConfig(kv_blocks=64, block_size=4, max_running=1))
    engine.submit(
        [
            SubmitEntry(r, pack_ids([5 + r] * 9), {**GREEDY, "max_new_tokens": 30}, {})
            for r in (1, 2)
        ]
    )
    engine.step()
    assert len(engine.scheduler.running) == 1 and len(engine.scheduler.waiting) == 1
    out = engine.abort([2, 1, 77])
    assert [(e.rid, e.finish[0]) for e in out] == [(2, "abort"), (1, "abort")]
    assert engine.blocks.num_free == 64 and not engine.check() and not engine.has_work


def test_n_forks_share_the_prompt_blocks(lm: LoadedModel) -> None:
    engine = Engine(lm, EngineConfig(kv_blocks=64, block_size=4))
    p = prompts(1, lm.config.vocab_size, seed=9, lo=10, hi=11)[0]
    engine.submit([SubmitEntry(10, pack_ids(p), {**GREEDY, "max_new_tokens": 5, "n": 3}, {})])
    first = engine.step()
    assert sorted(e.rid for e in first) == [10, 11, 12]
    full = engine.scheduler.running[0].block_table[: len(p) // 4]
    assert all(engine.blocks.ref[b] == 3 for b in full)
    got = run(engine, [])
    want = dense_greedy(lm, p, 5)[0]
    for rid in (10, 11, 12):
        assert (
            ids_to_list(next(e for e in first if e.rid == rid).new_ids) + ids_of(got[rid]) == want
        )


def test_seeded_sampling_is_independent_of_the_batch(lm: LoadedModel) -> None:
    s = {
        "temperature": 1.0,
        "top_p": 0.9,
        "top_k": 50,
        "seed": 1234,
        "max_new_tokens": 12,
        "ignore_eos": True,
    }
    p = prompts(1, lm.config.vocab_size, seed=4)[0]
    alone = ids_of(run(Engine(lm, EngineConfig(kv_blocks=200, block_size=4)), [(1, p, s, {})])[1])
    others = [
        (10 + i, q, {"temperature": 0.7, "max_new_tokens": 9}, {})
        for i, q in enumerate(prompts(6, 200))
    ]
    mixed = run(Engine(lm, EngineConfig(kv_blocks=200, block_size=4)), [*others, (1, p, s, {})])
    assert ids_of(mixed[1]) == alone
    other = run(
        Engine(lm, EngineConfig(kv_blocks=200, block_size=4)), [(1, p, {**s, "seed": 99}, {})]
    )
    assert ids_of(other[1]) != alone


def test_stop_token_ids_stop_strings_and_bias(lm: LoadedModel) -> None:
    p = prompts(1, lm.config.vocab_size, seed=5)[0]
    want = dense_greedy(lm, p, 10)[0]
    engine = Engine(lm, EngineConfig(kv_blocks=200, block_size=4))
    stop_id = want[3]
    cut = want.index(stop_id) + 1
    got = run(engine, [(1, p, {**GREEDY, "max_new_tokens": 10, "stop_token_ids": [stop_id]}, {})])
    assert ids_of(got[1]) == want[:cut] and got[1][-1].finish == ["stop", stop_id]
    # Letters only (a large bias on every letter token), so the text is plain ASCII and
    # a stop string can straddle a token boundary.
    bias = {lm.tokenizer.token_to_id(ch): 100.0 for ch in "abcdefghijklmnopqrstuvwxyz"}
    s = {**GREEDY, "max_new_tokens": 10, "logit_bias": bias}
    letters = ids_of(run(engine, [(4, p, s, {})])[4])
    text, head = lm.tokenizer.decode(letters), len(lm.tokenizer.decode(letters[:3]))
    stop = text[head - 1 : head + 2]  # last char of token 3, then the next two
    assert len(stop) == 3 and stop.isalpha() and stop not in text[: head - 1]
    got = run(engine, [(2, p, {**s, "stop": [stop]}, {})])
    ids = ids_of(got[2])
    assert got[2][-1].finish == ["stop", stop] and ids == letters[: len(ids)]
    assert stop in lm.tokenizer.decode(ids) and stop not in lm.tokenizer.decode(ids[:-1])
    forced = 7
    got = run(engine, [(3, p, {**GREEDY, "max_new_tokens": 3, "logit_bias": {forced: 1e4}}, {})])
    assert ids_of(got[3]) == [forced] * 3


def test_stop_regex_ends_on_the_first_match_in_the_tail(lm: LoadedModel) -> None:
    """The worker searches each step's last 32 output tokens; the oracle does the same
    in Python on the uncut output. The ids include the token completing the match; the
    finish carries the matched text and the index of the pattern that matched (the second
    of two here). An invalid pattern is REQ-ERROR invalid."""
    p = prompts(1, lm.config.vocab_size, seed=5)[0]
    engine = Engine(lm, EngineConfig(kv_blocks=200, block_size=4))
    bias = {lm.tokenizer.token_to_id(ch): 100.0 for ch in "abcdefghijklmnopqrstuvwxyz"}
    s = {**GREEDY, "max_new_tokens": 40, "logit_bias": bias}
    letters = ids_of(run(engine, [(1, p, s, {})])[1])
    text = lm.tokenizer.decode(letters)
    pattern = f"{text[5]}[a-z]{text[7]}"  # a match straddling tokens, maybe an earlier one
    k, m = next(
        (k, m)
        for k in range(1, len(letters) + 1)
        if (m := re.search(pattern, lm.tokenizer.decode(letters[:k][-32:]))) is not None
    )
    got = run(engine, [(2, p, {**s, "stop_regex": [r"\d{3}", pattern]}, {})])[2]
    assert ids_of(got) == letters[:k] and got[-1].finish == ["stop", m.group(0), 1]
    errors, _ = engine.submit([SubmitEntry(3, pack_ids(p), {"stop_regex": ["(x"]}, {})])
    assert errors[0][:2] == (3, "invalid") and "not a valid regular expression" in errors[0][2]


def test_logprobs_match_the_dense_oracle(lm: LoadedModel) -> None:
    p = prompts(1, lm.config.vocab_size, seed=6, lo=20, hi=21)[0]
    want, rows = dense_greedy(lm, p, 4)
    engine = Engine(lm, EngineConfig(kv_blocks=200, block_size=4, step_tokens=8))
    opts = {
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 3,
        "token_ids_logprob": [5, 6],
    }
    got = run(engine, [(1, p, {**GREEDY, "max_new_tokens": 4}, opts)])[1]
    assert ids_of(got) == want
    prompt_lp = torch.log_softmax(rows[0], dim=-1)
    first = got[0].extra
    plp = f32s_to_list(first["prompt_logprobs"])
    assert len(plp) == len(p) and math.isnan(plp[0])
    expect = [float(prompt_lp[j - 1, p[j]]) for j in range(1, len(p))]
    assert plp[1:] == pytest.approx(expect, abs=1e-4)
    assert len(first["prompt_top_ids"]) == len(p) and len(first["prompt_ids_logprobs"]) == len(p)
    for k, e in enumerate(got):
        lp = torch.log_softmax(rows[k][-1], dim=-1)
        assert f32s_to_list(e.extra["logprobs"])[0] == pytest.approx(float(lp[want[k]]), abs=1e-4)
        assert ids_to_list(e.extra["top_ids"][0])[0] == want[k]
        assert f32s_to_list(e.extra["ids_logprobs"][0]) == pytest.approx(
            [float(lp[5]), float(lp[6])], abs=1e-4
        )


def test_max_new_tokens_0_runs_the_prefill_for_prompt_logprobs(lm: LoadedModel) -> None:
    """SGLang's way to score text: no output token, the prompt's logprobs (first entry
    NaN, i.e. null), finish length 0, blocks freed; n > 1 gives every rid the same. Without
    prompt logprobs nothing runs at all."""
    p = prompts(1, lm.config.vocab_size, seed=8, lo=20, hi=21)[0]
    _, rows = dense_greedy(lm, p, 1)
    engine = Engine(lm, EngineConfig(kv_blocks=64, block_size=4, step_tokens=8))
    opts = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
            "token_ids_logprob": [5]}  # fmt: skip
    got = run(engine, [(1, p, {"max_new_tokens": 0, "n": 2}, opts)])
    want = torch.log_softmax(rows[0], dim=-1)
    for rid in (1, 2):
        (e,) = got[rid]
        assert e.new_ids == b"" and e.finish == ["length", 0] and e.extra["prompt_tokens"] == 20
        plp = f32s_to_list(e.extra["prompt_logprobs"])
        assert math.isnan(plp[0])
        assert plp[1:] == pytest.approx([float(want[j - 1, p[j]]) for j in range(1, 20)], abs=1e-4)
        assert len(e.extra["prompt_top_ids"]) == len(e.extra["prompt_ids_logprobs"]) == 20
    one = run(engine, [(3, p[:1], {"max_new_tokens": 0}, opts)])[3][0]
    assert one.finish == ["length", 0] and len(f32s_to_list(one.extra["prompt_logprobs"])) == 1
    _, done = engine.submit([SubmitEntry(4, pack_ids(p), {"max_new_tokens": 0}, {})])
    assert [(e.rid, e.finish) for e in done] == [(4, ["length", 0])] and not engine.has_work


def test_prefix_cache_hit_gives_identical_output(lm: LoadedModel) -> None:
    engine = Engine(lm, EngineConfig(kv_blocks=200, block_size=4))
    p = prompts(1, lm.config.vocab_size, seed=7, lo=30, hi=31)[0]
    a = run(engine, [(1, p, {**GREEDY, "max_new_tokens": 6}, {})])[1]
    b = run(engine, [(2, p + [9, 9], {**GREEDY, "max_new_tokens": 6}, {})])[2]
    # Every prompt token the two share (7 whole blocks, then rows copied out of the 8th,
    # which the first request's output filled): 30, more if its output began with 9s.
    done = p + ids_of(a)[:-1]  # the last sampled token was never fed
    pairs = zip([*done, -1], p + [9, 9, -2], strict=False)
    reused = next(i for i, (x, y) in enumerate(pairs) if x != y)
    assert a[0].extra["cached_tokens"] == 0 and b[0].extra["cached_tokens"] == reused
    assert ids_of(b) == dense_greedy(lm, p + [9, 9], 6)[0]


def test_hidden_states_per_new_token(lm: LoadedModel) -> None:
    engine = Engine(lm, EngineConfig(kv_blocks=64, block_size=4))
    got = run(
        engine, [(1, [5, 6, 7], {**GREEDY, "max_new_tokens": 3}, {"return_hidden_states": True})]
    )[1]
    assert len(got) == 3
    for e in got:
        (h,) = e.extra["hidden_states"]
        assert len(f32s_to_list(h)) == lm.config.hidden


def test_abort_of_one_fork_leaves_its_siblings(lm: LoadedModel) -> None:
    engine = Engine(lm, EngineConfig(kv_blocks=64, block_size=4))
    s = {"temperature": 1.0, "seed": 5, "max_new_tokens": 6, "ignore_eos": True, "n": 3}
    engine.submit([SubmitEntry(20, pack_ids([5, 6, 7, 8, 9]), s, {})])
    out = engine.abort([21])  # before the fork: the reserved rid ends at once
    assert [(e.rid, e.finish[0]) for e in out] == [(21, "abort")]
    got = run(engine, [])
    assert sorted(got) == [20, 22]
    assert all(len(ids_of(v)) == 6 for v in got.values())
    assert ids_of(got[20]) != ids_of(got[22])  # seeds seed and seed + 2


@pytest.mark.parametrize("overlap", ["off", "on"])  # on: tests/test_overlap.py
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("submit"), st.integers(1, 30), st.integers(1, 12), st.integers(1, 3)),
            st.tuples(st.just("abort"), st.integers(0, 20)),
            st.tuples(st.just("step"), st.integers(1, 4)),
        ),
        max_size=30,
    )
)
def test_any_interleaving_terminates_every_rid_once_and_leaks_nothing(
    lm: LoadedModel, overlap: str, ops: list
) -> None:
    engine = Engine(lm, EngineConfig(kv_blocks=12, block_size=4, step_tokens=16, max_running=4,
                                     overlap=overlap))  # fmt: skip
    terminal: dict[int, int] = {}
    submitted: list[int] = []
    rid = 0

    def seen(entries: list[StepEntry]) -> None:
        for e in entries:
            assert e.rid in submitted and terminal.get(e.rid, 0) == 0, e
            if e.finish is not None:
                terminal[e.rid] = 1

    for op in ops:
        if op[0] == "submit":
            _, plen, new, n = op
            s = {"temperature": 0.8, "seed": rid, "max_new_tokens": new, "n": n, "ignore_eos": True}
            errors, done = engine.submit([SubmitEntry(rid, pack_ids([5 + rid % 50] * plen), s, {})])
            submitted.extend(range(rid, rid + n))
            assert sorted(r for r, _, _ in errors) == (
                [] if not errors else list(range(rid, rid + n))
            )
            for r, code, _ in errors:
                assert code == "too_long" and terminal.get(r, 0) == 0
                terminal[r] = 1
            seen(done)
            rid += n
        elif op[0] == "abort" and submitted:
            seen(engine.abort([submitted[op[1] % len(submitted)]]))
        else:
            for _ in range(op[1]):
                seen(engine.step())
        assert engine.check() == []
    while engine.has_work:
        seen(engine.step())
    assert sorted(terminal) == submitted
    assert engine.blocks.num_free == engine.blocks.num_blocks and engine.check() == []


def test_abort_mid_prefill_frees_its_blocks(lm: LoadedModel) -> None:
    engine = Engine(lm, EngineConfig(kv_blocks=64, block_size=4, step_tokens=8))
    engine.submit(
        [SubmitEntry(1, pack_ids(list(range(5, 45))), {**GREEDY, "max_new_tokens": 4}, {})]
    )
    assert engine.step() == []  # first chunk of five
    seq = engine.seqs[1]
    assert 0 < seq.num_computed < seq.prompt_len and engine.blocks.num_free < 64
    (entry,) = engine.abort([1])
    assert (
        entry.finish == ["abort", "aborted by the frontend"] and entry.extra["prompt_tokens"] == 40
    )
    assert engine.blocks.num_free == 64 and engine.check() == [] and not engine.has_work


def test_prompt_chunks_shrink_while_others_decode(lm: LoadedModel) -> None:
    """A long prompt arriving while a request decodes is fed in chunks of at most
    ``mixed_prefill_tokens`` (the decoding request's gap stays short); alone it gets the
    whole step budget. Outputs are the same either way."""
    cfg = EngineConfig(kv_blocks=400, block_size=4, step_tokens=64, mixed_prefill_tokens=8)
    v = lm.config.vocab_size
    short, long_ = prompts(1, v, seed=5, lo=5, hi=6)[0], prompts(1, v, seed=6, lo=40, hi=41)[0]
    sampling = {**GREEDY, "max_new_tokens": 12}

    alone = Engine(lm, cfg)
    batches: list[list[tuple[int, int]]] = []
    schedule = alone.scheduler.schedule

    def recording() -> list:
        batch = schedule()
        batches.append([(seq.rid, n) for seq, n in batch])
        return batch

    alone.scheduler.schedule = recording  # type: ignore[method-assign]
    want = ids_of(run(alone, [(2, long_, sampling, {})])[2])
    assert batches[0] == [(2, 40)]  # nothing decoding: one 40-token chunk

    mixed = Engine(lm, cfg)
    batches.clear()
    schedule = mixed.scheduler.schedule
    mixed.scheduler.schedule = recording  # type: ignore[method-assign]
    mixed.submit([SubmitEntry(1, pack_ids(short), {**GREEDY, "max_new_tokens": 30}, {})])
    mixed.step()  # request 1 prefilled and decoding from here on
    got = run(mixed, [(2, long_, sampling, {})])
    chunks = [n for batch in batches for rid, n in batch if rid == 2 and n > 1]
    assert chunks == [8, 8, 8, 8, 8], batches[:8]
    assert all((1, 1) in batch for batch in batches[1:6])  # request 1 decoded every step
    assert ids_of(got[2]) == want
