"""Overlapped steps (``EngineConfig.overlap``): the engine launches step N+1 before it
reads step N's tokens, whose rows take those tokens on the device (gpu/runtime/engine.py,
``Engine.step``). On the CPU nothing runs ahead, but every host path is the GPU's: the
placeholders, the rows filled from the previous step's tokens, the requests that end a
step late, the steps that must sample at once.

The promise is exact: the same tokens and the same ends as without overlap. The tiny
model's quantized weights run the native kernels, whose row results do not depend on the
batch (docs/determinism.md), so an overlapped schedule (one more row for a request that
ended a step ago) cannot move a token."""

from __future__ import annotations

import random

import httpx
import pytest

from gpu.model.loader import LoadedModel, load_model
from gpu.runtime.engine import Engine, EngineConfig
from tests.engine_runs import run_to_end
from tests.native_mode import needs_native
from tests.scripted import lifecycle_server
from tests.tiny_gguf import TinyModel
from wire import StepEntry, SubmitEntry, ids_to_list, pack_ids

pytestmark = needs_native("the exact promise rests on the quantized kernels' batch invariance")


@pytest.fixture(scope="module")
def qlm(tiny_gguf: TinyModel) -> LoadedModel:
    lm = load_model(tiny_gguf.path, device="cpu", weights="quantized")
    assert lm.model.quantized()
    return lm


def _workload(vocab: int) -> list[tuple[int, list[int], dict, dict]]:
    """Plain greedy and seeded rows (they fly), and rows that sample at once: penalties,
    min_new_tokens, logprobs, n > 1, a prompt scored with max_new_tokens 0, an embedding;
    stop ids, stop strings and length ends; prompts that share prefixes (cache hits)."""
    rng = random.Random(7)
    base = [rng.randrange(5, vocab) for _ in range(30)]
    reqs: list[tuple[int, list[int], dict, dict]] = []
    rid = 0
    for i in range(24):
        prompt = (base[: 8 + i] if i % 3 == 0 else []) + [
            rng.randrange(5, vocab) for _ in range(rng.randrange(3, 40))
        ]
        s: dict = {"max_new_tokens": rng.randrange(1, 30), "ignore_eos": i % 4 != 0}
        o: dict = {}
        kind = i % 8
        if kind in (0, 1):
            s["temperature"] = 0
        elif kind == 2:
            s.update(temperature=0.9, top_p=0.9, top_k=40, seed=100 + i)
        elif kind == 3:
            s.update(temperature=0, frequency_penalty=0.5, min_new_tokens=2)
        elif kind == 4:
            s.update(temperature=0, stop=["a", "e"], stop_token_ids=[rng.randrange(5, vocab)])
        elif kind == 5:
            s.update(temperature=0.7, seed=i, n=2)
        elif kind == 6:
            s["temperature"] = 0
            o = {"return_logprob": True, "top_logprobs_num": 2}
        else:
            s.update(temperature=0.8, seed=i)
        reqs.append((rid, prompt, s, o))
        rid += s.get("n", 1)
    reqs.append((rid, base[:20], {"max_new_tokens": 0}, {"return_logprob": True,
                                                        "logprob_start_len": 0}))  # fmt: skip
    reqs.append((rid + 1, base[:12], {"max_new_tokens": 0}, {"embed": {"pooling": "mean"}}))
    return reqs


def _serve(lm: LoadedModel, overlap: str, reqs: list, kv_blocks: int,
           graphs: str = "off") -> dict[int, list]:  # fmt: skip
    """Every request submitted in two waves (the second while the first decodes), run to
    the end; each rid's entries. Nothing may leak or end twice."""
    engine = Engine(lm, EngineConfig(kv_blocks=kv_blocks, block_size=4, step_tokens=48,
                                     max_running=8, mixed_prefill_tokens=16,
                                     decode_graphs=graphs, overlap=overlap))  # fmt: skip
    assert engine.overlap == (overlap == "on")
    got: dict[int, list[StepEntry]] = {}
    half = len(reqs) // 2
    waves = [reqs[:half], reqs[half:]]
    steps = flew = 0
    while waves or engine.has_work:
        if waves and (steps % 6 == 0):
            errors, done = engine.submit(
                [SubmitEntry(r, pack_ids(p), s, o) for r, p, s, o in waves.pop(0)]
            )
            assert not errors, errors
            for e in done:
                got.setdefault(e.rid, []).append(e)
        for e in engine.step():
            assert not got.get(e.rid) or got[e.rid][-1].finish is None, e  # one end
            got.setdefault(e.rid, []).append(e)
        flew += engine._in_flight is not None
        steps += 1
        assert steps < 5_000
    assert (flew > 0) == (overlap == "on")
    assert not engine.check() and engine.blocks.num_free == engine.blocks.num_blocks
    assert not engine.seqs and not engine.reserved
    return got


def _summary(entries: list[StepEntry]) -> tuple:
    """What a client gets: the tokens, the end, and the per-token and prompt extras."""
    assert entries[-1].finish is not None and all(e.finish is None for e in entries[:-1])
    tokens = [t for e in entries for t in ids_to_list(e.new_ids)]
    keep = ("logprobs", "top_ids", "top_logprobs", "prompt_tokens", "embedding",
            "prompt_logprobs")  # fmt: skip
    extras = [{k: v for k, v in (e.extra or {}).items() if k in keep} for e in entries]
    return tokens, entries[-1].finish, extras


@pytest.mark.parametrize(
    ("kv_blocks", "graphs"),
    [(400, "off"), (40, "off"), (400, "eager")],
    ids=["roomy", "preempting", "decode-graphs"],
)
def test_overlapped_steps_give_the_same_tokens_and_ends(
    qlm: LoadedModel, kv_blocks: int, graphs: str
) -> None:
    """Against the same engine without overlap. ``decode-graphs``: pure decode steps
    replay the captured step's buffers (``decode_graphs="eager"``, the CUDA graph path
    without capture), whose input rows the previous step's tokens fill in place."""
    reqs = _workload(qlm.config.vocab_size)
    plain = _serve(qlm, "off", reqs, kv_blocks, graphs)
    ahead = _serve(qlm, "on", reqs, kv_blocks, graphs)
    assert sorted(plain) == sorted(ahead)
    assert len(plain) == sum(s.get("n", 1) for _, _, s, _ in reqs)
    for rid in plain:
        assert _summary(ahead[rid]) == _summary(plain[rid]), rid
    if kv_blocks == 40:  # the small cache did preempt: recomputed rows read the real tokens
        assert any(e[-1].extra.get("num_retractions") for e in ahead.values())


def test_a_request_aborted_while_its_token_is_in_flight_ends_once(qlm: LoadedModel) -> None:
    engine = Engine(lm := qlm, EngineConfig(kv_blocks=100, block_size=4, overlap="on"))
    greedy = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 20}
    engine.submit([SubmitEntry(r, pack_ids([5 + r] * 9), greedy, {}) for r in (1, 2)])
    seen: dict[int, list[StepEntry]] = {1: [], 2: []}
    while engine._in_flight is None:
        for e in engine.step():
            seen[e.rid].append(e)
    out = engine.abort([1])
    assert [(e.rid, e.finish[0]) for e in out] == [(1, "abort")]
    while engine.has_work:
        for e in engine.step():
            seen[e.rid].append(e)
    assert all(e.rid != 1 for e in seen[2])
    assert not any(e.finish for e in seen[1])  # its in-flight token was dropped, not sent
    alone = Engine(lm, EngineConfig(kv_blocks=100, block_size=4, overlap="off"))
    alone.submit([SubmitEntry(2, pack_ids([7] * 9), greedy, {})])
    want: list[int] = []
    while alone.has_work:
        want += [t for e in alone.step() for t in ids_to_list(e.new_ids)]
    assert [t for e in seen[2] for t in ids_to_list(e.new_ids)] == want
    assert seen[2][-1].finish == ["length", 20]
    assert not engine.check() and engine.blocks.num_free == engine.blocks.num_blocks


def test_the_served_worker_overlaps_on_request_and_answers_the_same(
    qlm: LoadedModel, tiny_gguf: TinyModel
) -> None:
    """``lifecycle serve --overlap on`` reaches the worker (HELLO says so) and a batch of
    greedy and seeded prompts over HTTP answers what the engine answers without overlap."""
    rng = random.Random(3)
    ps = [[rng.randrange(5, qlm.config.vocab_size) for _ in range(rng.randrange(3, 30))]
          for _ in range(6)]  # fmt: skip
    params = [{"temperature": 0, "max_new_tokens": 12, "ignore_eos": True} if i % 2 else
              {"temperature": 0.8, "seed": i, "max_new_tokens": 12, "ignore_eos": True}
              for i in range(6)]  # fmt: skip
    engine = Engine(qlm, EngineConfig(kv_blocks=256, block_size=16, overlap="off"))
    want = run_to_end(engine, ps, params)
    with lifecycle_server("--model", str(tiny_gguf.path), "--device", "cpu", "--weights",
                          "quantized", "--kv-cache-tokens", "4096", "--overlap", "on") as url:  # fmt: skip
        info = httpx.get(url + "/server_info", timeout=30).json()
        assert info["internal_states"][0]["capacity"]["overlap"] is True
        got = httpx.post(url + "/generate", json={"input_ids": ps, "sampling_params": params},
                         timeout=120).json()  # fmt: skip
    assert [r["output_ids"] for r in got] == want
