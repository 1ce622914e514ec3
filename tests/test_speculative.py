"""Speculative decoding (``--speculative ngram``, gpu/runtime/speculation.py): the same
tokens as without it, bit for bit, for greedy and seeded requests, alone, batched,
cached and chunked; logprobs, stop strings, n > 1 and aborts; the proposer's rules; and
its record in meta_info, /metrics and /server_info of a real server. A draft model:
test_speculative_draft.py.

The engines run the bundled model on its quantized weights and the native kernels,
where a row's logits are one function of its prefix (docs/determinism.md): a checked
draft row is the decode row it stands for, so equality is asserted, not a tolerance.
Each comparison also asserts that drafts were accepted, so it compares something."""

from __future__ import annotations

import random
from typing import Any

import httpx
import pytest

from gpu.model.loader import LoadedModel
from gpu.runtime.engine import Engine, EngineConfig
from gpu.runtime.speculation import Drafts, Speculation, verify
from tests.engine_runs import run_to_end
from wire import SubmitEntry, ids_to_list, pack_ids

NGRAM = Speculation("ngram", tokens=6, ngram_min=2, ngram_max=4)

PASSAGE = (
    "The river rises in the hills above the town, runs under the old stone bridge, "
    "turns the mill wheel by the church and reaches the sea at the harbour, where the "
    "fishing boats wait for the evening tide."
)
TEXTS = [
    f"Copy this sentence exactly.\n{PASSAGE}\nCopy:\n{PASSAGE[:40]}",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3,",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return",
    f"{PASSAGE} {PASSAGE}",
    "The capital of France is",
    "Once upon a time",
]


@pytest.fixture(scope="module")
def lm(cpu_model: LoadedModel) -> LoadedModel:
    assert cpu_model.model.quantized(), "the bit-exact promise is the native path's"
    return cpu_model


def _engine(lm: LoadedModel, spec: Speculation = NGRAM, **kw: Any) -> Engine:
    return Engine(lm, EngineConfig(kv_blocks=kw.pop("kv_blocks", 400), speculation=spec, **kw))


def _prompts(lm: LoadedModel) -> list[list[int]]:
    return [lm.tokenizer.encode(t) for t in TEXTS]


def _greedy(n: int = 48) -> dict[str, Any]:
    return {"max_new_tokens": n, "temperature": 0}


def _accepted(engine: Engine) -> int:
    return engine.spec_totals.accepted_tokens


# -- the proposer and the check -----------------------------------------------------------
def test_drafts_follow_the_latest_longest_match() -> None:
    d = Drafts(Speculation("ngram", tokens=3, ngram_min=1, ngram_max=3))
    #         0  1  2  3  4  5  6  7  8
    tokens = [5, 6, 7, 8, 9, 6, 7, 1, 2, 6, 7]
    # [6, 7] ends at 3 and at 7; the latest wins: what followed it there
    assert d.propose(tokens, 10) == [1, 2, 6]
    assert d.propose([*tokens, 1], 10) == [2, 6, 7]  # [7, 1] and [6, 7, 1] match now
    assert d.propose([4, 4, 3], 10) == []  # nothing ends in ...3 earlier
    # a match one period back is a loop: the draft goes on around it
    assert Drafts(NGRAM).propose([9, 1, 2, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]
    assert Drafts(NGRAM).propose([0, 0, 0], 6) == [0, 0, 0, 0, 0, 0]
    assert d.propose([*tokens, 1], 1) == [2]  # capped by what the request may still take
    assert Drafts(NGRAM).propose([1, 2, 3, 1], 10) == []  # one token is below ngram_min 2


def test_drafts_adapt_their_length_and_back_off() -> None:
    d = Drafts(Speculation("ngram", tokens=6))
    d.checked(6, 2)
    assert d.k == 3  # one more than the accepted
    d.checked(3, 3)
    assert d.k == 6  # all taken: doubles up to the bound
    d.checked(6, 0)
    d.checked(1, 0)  # two misses in a row: pause one step, then two, ...
    assert d.pause == 1
    assert d.propose([1, 2, 1, 2], 6) == []
    assert d.propose([1, 2, 1, 2], 6) == [1]  # k is 1 after a miss
    d.checked(2, 0)
    d.checked(1, 0)
    assert d.pause == 2
    assert d.extra() == {"spec_num_proposed_drafts": 19, "spec_num_correct_drafts": 5,
                         "spec_verify_ct": 6}  # fmt: skip


def test_verify_keeps_rows_up_to_the_first_mismatch() -> None:
    a, b = object(), object()
    # rows: 0 plain; 1..3 a's (draft [4, 5]); 4 plain; 5..8 b's (draft [7, 8, 9])
    sampled = [1, 4, 5, 6, 2, 7, 0, 8, 9]
    keep, accepted = verify(sampled, [(1, a, [4, 5]), (5, b, [7, 8, 9])])
    assert accepted == [2, 1]
    assert keep == [0, 1, 2, 3, 4, 5, 6]


def test_options_refuse_what_cannot_run() -> None:
    with pytest.raises(ValueError, match="one of off, ngram, draft"):
        Speculation("eagle")
    with pytest.raises(ValueError, match="min <= max"):
        Speculation("ngram", ngram_min=4, ngram_max=2)


# -- the same tokens ---------------------------------------------------------------------
def test_greedy_tokens_equal_alone_and_batched(lm: LoadedModel) -> None:
    prompts = _prompts(lm)
    params = [_greedy() for _ in prompts]
    plain = [
        run_to_end(_engine(lm, Speculation()), [p], [s])[0]
        for p, s in zip(prompts, params, strict=True)
    ]
    spec = _engine(lm)
    alone = [run_to_end(spec, [p], [s])[0] for p, s in zip(prompts, params, strict=True)]
    assert alone == plain
    assert _accepted(spec) > 20, "the prompts were chosen to be copied"
    batched = _engine(lm)
    assert run_to_end(batched, prompts, params) == plain
    assert _accepted(batched) > 20


def test_greedy_equal_cached_and_chunked(lm: LoadedModel) -> None:
    prompts = _prompts(lm)[:3]
    params = [_greedy(40) for _ in prompts]
    plain = run_to_end(_engine(lm, Speculation()), prompts, params)
    # small steps: prompts in chunks of 16, drafts sharing steps with prompt chunks
    spec = _engine(lm, step_tokens=16, mixed_prefill_tokens=8)
    assert run_to_end(spec, prompts, params) == plain
    assert run_to_end(spec, prompts, params) == plain  # again, from the prefix cache
    assert spec.blocks.num_cached > 0 and _accepted(spec) > 0


def test_seeded_sampling_equal(lm: LoadedModel) -> None:
    prompts = _prompts(lm)[:4]
    params = [{"max_new_tokens": 40, "temperature": 0.7, "top_p": 0.95, "top_k": 40,
               "seed": 11 + i} for i in range(len(prompts))]  # fmt: skip
    plain = [
        run_to_end(_engine(lm, Speculation()), [p], [s])[0]
        for p, s in zip(prompts, params, strict=True)
    ]
    spec = _engine(lm)
    assert run_to_end(spec, prompts, params) == plain
    assert _accepted(spec) > 0 and spec.spec_totals.accepted_tokens < spec.spec_totals.draft_tokens


def test_n_greater_than_one_equal(lm: LoadedModel) -> None:
    prompt = _prompts(lm)[1]
    params = {"max_new_tokens": 24, "temperature": 0.8, "seed": 5, "n": 3}

    def run(engine: Engine) -> dict[int, list[int]]:
        errors, _ = engine.submit([SubmitEntry(1, pack_ids(prompt), params, {})])
        assert not errors
        out: dict[int, list[int]] = {1: [], 2: [], 3: []}
        while engine.has_work:
            for e in engine.step():
                out[e.rid] += ids_to_list(e.new_ids)
        assert not engine.check()
        return out

    spec = _engine(lm)
    assert run(spec) == run(_engine(lm, Speculation()))
    assert spec.spec_totals.verify_steps > 0


def _entries(engine: Engine, prompt: list[int], sampling: dict[str, Any],
             options: dict[str, Any]) -> tuple[list[int], list[Any]]:  # fmt: skip
    """One request's ids and its entries' extras and finish, in order."""
    errors, _ = engine.submit([SubmitEntry(1, pack_ids(prompt), sampling, options)])
    assert not errors
    ids: list[int] = []
    extras: list[Any] = []
    while engine.has_work:
        for e in engine.step():
            ids += ids_to_list(e.new_ids)
            extra = dict(e.extra or {})
            for k in ("spec_verify_ct", "spec_num_proposed_drafts", "spec_num_correct_drafts",
                      "grammar_compile_ms", "grammar_cached"):  # fmt: skip
                extra.pop(k, None)
            extras.append((extra, e.finish))
    return ids, extras


def test_logprobs_equal(lm: LoadedModel) -> None:
    prompt = _prompts(lm)[0]
    options = {"return_logprob": True, "top_logprobs_num": 3, "logprob_start_len": 0}
    spec = _engine(lm)
    got = _entries(spec, prompt, _greedy(32), options)
    assert got == _entries(_engine(lm, Speculation()), prompt, _greedy(32), options)
    assert _accepted(spec) > 0


def test_stop_strings_and_lengths(lm: LoadedModel) -> None:
    prompt = _prompts(lm)[1]  # counts on: "4, 5, 6, ..."
    for sampling in ({"max_new_tokens": 9, "temperature": 0, "stop": ["7,"]},
                     {"max_new_tokens": 5, "temperature": 0},
                     {"max_new_tokens": 30, "temperature": 0, "stop_token_ids": [28]}):  # fmt: skip
        spec = _engine(lm)
        got = _entries(spec, prompt, sampling, {})
        assert got == _entries(_engine(lm, Speculation()), prompt, sampling, {})
        assert len(got[0]) <= sampling["max_new_tokens"]
        assert not spec.check() and spec.blocks.num_free == spec.blocks.num_blocks


def test_grammar_constrained_equal(lm: LoadedModel) -> None:
    """A constrained request speculates too: no draft token its grammar refuses is
    proposed, each checked row is masked by the grammar after the draft before it, and
    the tokens are those without speculation (greedy and seeded)."""
    prompt = _prompts(lm)[1]  # counts on: "4, 5, 6, ..."
    grammar = ["regex", r"( [0-9]{1,2},){1,8}"]
    for extra in ({"temperature": 0}, {"temperature": 0.9, "seed": 4}):
        sampling = {"max_new_tokens": 40, "grammar": grammar, **extra}
        spec = _engine(lm)
        got = _entries(spec, prompt, sampling, {})
        assert got == _entries(_engine(lm, Speculation()), prompt, sampling, {})
        assert _accepted(spec) > 5 and got[1][-1][1][0] == "stop"  # the grammar ended it


def test_penalties_and_min_tokens_equal(lm: LoadedModel) -> None:
    """Penalties and the end-of-generation mask read the output: each checked row reads
    the output with the draft before it, as its decode row would."""
    prompts = _prompts(lm)[:4]
    params = [
        {"max_new_tokens": 32, "temperature": 0, "frequency_penalty": 0.3},
        {"max_new_tokens": 32, "temperature": 0, "repetition_penalty": 1.1},
        {"max_new_tokens": 32, "temperature": 0.7, "seed": 2, "presence_penalty": 0.5},
        {"max_new_tokens": 32, "temperature": 0, "min_new_tokens": 20},
    ]
    plain = [run_to_end(_engine(lm, Speculation()), [p], [s])[0]
             for p, s in zip(prompts, params, strict=True)]  # fmt: skip
    spec = _engine(lm)
    assert run_to_end(spec, prompts, params) == plain
    assert _accepted(spec) > 5


def test_no_draft_while_a_prompt_is_prefilled(lm: LoadedModel) -> None:
    """A step with prompt work (a request waiting, a running prompt's chunk) proposes no
    draft: its rows are the chunk's, and a check beside it would slow the new request's
    first token. Once the new prompt is in, both speculate again; the tokens are those
    of the engine without speculation."""
    engine = _engine(lm, mixed_prefill_tokens=8)
    first, second = _prompts(lm)[0], _prompts(lm)[3]
    errors, _ = engine.submit([SubmitEntry(1, pack_ids(first), _greedy(96), {})])
    assert not errors
    out: dict[int, list[int]] = {1: [], 2: []}

    def step() -> None:
        for e in engine.step():
            out[e.rid] += ids_to_list(e.new_ids)

    while engine.spec_totals.verify_steps == 0:
        step()
    assert engine.submit([SubmitEntry(2, pack_ids(second), _greedy(48), {})]) == ([], [])
    s, prompt_steps = engine.scheduler, 0
    while s.waiting or any(len(q.tokens) - q.num_computed > 1 for q in s.running):
        checks = engine.spec_totals.verify_steps
        step()
        prompt_steps += 1
        assert engine.spec_totals.verify_steps == checks, prompt_steps
    assert prompt_steps >= len(second) // 8  # the second prompt took that many chunks
    checks = engine.spec_totals.verify_steps
    while engine.has_work:
        step()
    assert engine.spec_totals.verify_steps > checks and not engine.check()
    plain = run_to_end(_engine(lm, Speculation()), [first, second], [_greedy(96), _greedy(48)])
    assert [out[1], out[2]] == plain


def test_a_request_held_by_max_running_does_not_stop_drafts(lm: LoadedModel) -> None:
    """With --max-running 1 the second request waits for the first to end, whatever a
    step holds: the first speculates meanwhile (its end comes sooner)."""
    engine = _engine(lm, max_running=1)
    first, second = _prompts(lm)[0], _prompts(lm)[3]
    entries = [SubmitEntry(1, pack_ids(first), _greedy(64), {}),
               SubmitEntry(2, pack_ids(second), _greedy(16), {})]  # fmt: skip
    assert engine.submit(entries) == ([], [])
    out: dict[int, list[int]] = {1: [], 2: []}
    while not out[2]:
        for e in engine.step():
            out[e.rid] += ids_to_list(e.new_ids)
    assert len(out[1]) == 64 and engine.spec_totals.accepted_tokens > 5
    while engine.has_work:
        for e in engine.step():
            out[e.rid] += ids_to_list(e.new_ids)
    plain = run_to_end(_engine(lm, Speculation()), [first, second], [_greedy(64), _greedy(16)])
    assert [out[1], out[2]] == plain


def test_random_prompts_back_off(lm: LoadedModel) -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(100, 40000) for _ in range(64)] for _ in range(3)]
    params = [_greedy(64) for _ in prompts]
    spec = _engine(lm)
    assert run_to_end(spec, prompts, params) == run_to_end(_engine(lm, Speculation()), prompts,
                                                           params)  # fmt: skip
    t = spec.spec_totals
    # whatever it proposed, a run of misses pauses it: fewer checks than decode steps
    assert t.verify_steps < 3 * 63


def test_abort_mid_speculation_leaks_nothing(lm: LoadedModel) -> None:
    engine = _engine(lm)
    prompts = _prompts(lm)
    errors, _ = engine.submit(
        [SubmitEntry(i + 1, pack_ids(p), _greedy(200), {}) for i, p in enumerate(prompts)]
    )
    assert not errors
    while engine.spec_totals.verify_steps < 4:
        engine.step()
    drafting = [s.rid for s in engine.scheduler.running if s.drafts is not None]
    assert drafting
    ended = engine.abort(drafting[:2])
    assert [e.finish[0] for e in ended] == ["abort", "abort"][: len(ended)]
    for _ in range(3):
        engine.step()
    engine.abort_all("stop")
    assert not engine.check()
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_frames_are_the_specs(lm: LoadedModel) -> None:
    """The HELLO, the STEP entries (several for a rid in one step, the record in the
    terminal one) and STATS of a speculating engine validate against specs/wire.cddl."""
    import wire
    from gpu.worker.info import hello, stats
    from tests.wire_schema import validate_frame

    engine = _engine(lm)
    validate_frame(wire.encode_frame(hello(engine)))
    errors, _ = engine.submit([SubmitEntry(1, pack_ids(_prompts(lm)[1]), _greedy(40), {})])
    assert not errors
    several = terminal = False
    while engine.has_work:
        entries = engine.step()
        validate_frame(wire.encode_frame(wire.Step(engine.step_no, entries)))
        several = several or len(entries) > 1
        terminal = terminal or any(e.finish is not None and "spec_verify_ct" in (e.extra or {})
                                   for e in entries)  # fmt: skip
    assert several and terminal
    load = stats(engine)
    assert load["spec_num_correct_drafts"] == engine.spec_totals.accepted_tokens > 0
    validate_frame(wire.encode_frame(wire.Stats(1, load)))


@pytest.mark.parametrize("action", ["raise", "nan"])
def test_a_fault_in_a_speculative_step(
    lm: LoadedModel, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, action: str
) -> None:
    """The worker process, its forward failing (or its logits NaN) in a step that checks
    drafts: the request ends explicitly with what it had, the worker stays up, its books
    balance, and the next request gets its tokens."""
    from tests.worker_client import served_worker
    from wire import Stats, StatsReq
    from wire.faults import ENV_VAR, FaultPlan, FaultRule

    prompt = _prompts(lm)[1]
    plain = run_to_end(_engine(lm, Speculation()), [prompt], [_greedy(40)])[0]
    monkeypatch.setenv(ENV_VAR, FaultPlan([FaultRule("worker.forward", action, nth=6)]).to_json())
    with served_worker(str(tmp_path / "w.sock"), "--model", str(lm.path), "--speculative",
                       "ngram", "--kv-cache-tokens", "4096") as c:  # fmt: skip
        monkeypatch.delenv(ENV_VAR)
        c.submit(1, prompt, _greedy(200))
        r = c.wait([1])[1]
        assert r.error is not None and r.error[0] == "internal" and r.finish is None, r
        n = min(len(r.ids), len(plain))
        assert 5 < len(r.ids) < 200 and r.ids[:n] == plain[:n]  # drafts were checked
        load = c.request(StatsReq(1), Stats).load
        assert load["integrity_ok"] and load["kv_blocks_free"] == load["kv_blocks_total"], load
        assert load["spec_verify_ct"] >= 4
        c.submit(2, prompt, _greedy(40))
        assert c.wait([2])[2].ids == plain


# -- served ---------------------------------------------------------------------------------
def test_served_record_and_the_same_tokens(lm: LoadedModel) -> None:
    from tests.scripted import lifecycle_server

    prompt = _prompts(lm)[0]
    plain = run_to_end(_engine(lm, Speculation()), [prompt], [_greedy(40)])[0]
    with lifecycle_server("--device", "cpu", "--speculative", "ngram",
                          "--speculative-tokens", "5") as base:  # fmt: skip
        r = httpx.post(base + "/generate", timeout=120,
                       json={"input_ids": prompt, "sampling_params": _greedy(40),
                             "rid": "spec-1"})  # fmt: skip
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["output_ids"] == plain
        meta = body["meta_info"]
        assert meta["spec_verify_ct"] > 0
        assert 0 < meta["spec_num_correct_drafts"] <= meta["spec_num_proposed_drafts"]
        assert meta["spec_accept_rate"] == pytest.approx(
            meta["spec_num_correct_drafts"] / meta["spec_num_proposed_drafts"]
        )
        assert meta["spec_accept_length"] > 1
        trace = httpx.get(base + "/debug/requests/spec-1", timeout=30).json()
        assert trace["speculative"] == {k: meta[k] for k in trace["speculative"]}
        assert trace["speculative"]["spec_verify_ct"] == meta["spec_verify_ct"]
        info = httpx.get(base + "/server_info", timeout=30).json()
        text = repr(info)
        assert "'speculative': {'mode': 'ngram', 'tokens': 5, 'ngram': [2, 4]}" in text
        metrics = httpx.get(base + "/metrics", timeout=30).text
        accepted = [line for line in metrics.splitlines()
                    if line.startswith("lifecycle_spec_accepted_tokens_total")]  # fmt: skip
        assert accepted and float(accepted[0].rsplit(" ", 1)[1]) >= meta["spec_num_correct_drafts"]
