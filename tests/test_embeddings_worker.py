"""Embed requests in the real worker process (``gpu.worker`` on a tiny GGUF), over its
socket: prefill only, in the same steps as generation, pooled over chunked prefills, KV
released at once. Every frame is validated against ``specs/wire.cddl``.

The oracle is the model run over the whole prompt at once on the dense cache
(``tests/dense_cache.py``), with the final norm applied: no paging, no chunks, no batch.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from gpu.cache.kv_cache import kv_storage_dtype
from gpu.model.loader import LoadedModel, load_model
from tests.dense_cache import DenseKVCache
from tests.tiny_gguf import TinyModel
from tests.worker_client import Result, WorkerClient, spawn_worker
from wire import Abort, Stats, StatsReq, Step, f32s_to_list
from wire.faults import ENV_VAR, FaultPlan, FaultRule

pytestmark = pytest.mark.timeout(120)

BLOCK = 16
GREEDY = {"temperature": 0, "ignore_eos": True}
NO_TOKENS = {"max_new_tokens": 0}
STEP_DELAY = FaultRule("worker.forward", "delay", times=0, delay=0.01)


@pytest.fixture(scope="module")
def lm(tiny_gguf: TinyModel) -> LoadedModel:
    return load_model(tiny_gguf.path, device="cpu")


@pytest.fixture(scope="module")
def worker(
    tiny_gguf: TinyModel, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerClient]:
    # 16 prompt tokens a step: a long prompt's prefill takes several steps, beside decodes;
    # each step 10 ms longer (a fault-plan delay): an abort can land mid-prefill.
    path = str(tmp_path_factory.mktemp("emb") / "w.sock")
    args = ["--model", str(tiny_gguf.path), "--kv-cache-tokens", "1024", "--threads", "1"]
    os.environ[ENV_VAR] = FaultPlan([STEP_DELAY]).to_json()
    try:
        proc = spawn_worker(path, *args, "--step-tokens", "16", "--mixed-prefill-tokens", "16")
    finally:
        del os.environ[ENV_VAR]
    try:
        client = WorkerClient(path, timeout=60)
        yield client
        client.close()
    finally:
        proc.kill()
        proc.wait()


_rid = iter(range(1, 1 << 30))


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4, 260) for _ in range(n)]


def _embed(pooling: str = "last", normalize: bool = True) -> dict[str, Any]:
    return {"embed": {"pooling": pooling, "normalize": normalize}}


def reference(
    lm: LoadedModel, prompt: list[int], pooling: str, normalize: bool = True
) -> list[float]:
    # K and V rounded as the worker stores them (fp16 for quantized weights on the CPU)
    kv = kv_storage_dtype("auto", lm.device, lm.dtype, lm.model.quantized())
    cache = DenseKVCache(lm.config, 1, len(prompt), kv_dtype=kv)
    with torch.inference_mode():
        pos = cache.positions([0], [len(prompt)])
        cache.prepare([0], [len(prompt)])
        h = lm.model.final_norm(lm.model.trunk(torch.tensor(prompt), pos, cache))
        v = h[-1] if pooling == "last" else h.mean(0)
        if normalize:
            v = v / v.norm()
    return v.tolist()


def _vector(r: Result) -> list[float]:
    """The one terminal entry of an embed request, checked; its vector."""
    assert r.error is None and r.ids == [], r
    assert r.finish == ["embed", 64] and len(r.extras) == 1, r
    return f32s_to_list(r.extras[0]["embedding"])


def _close(a: list[float], b: list[float], tol: float = 1e-5) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b, strict=True)) <= tol


def _idle_sound(c: WorkerClient) -> dict[str, Any]:
    load = c.request(StatsReq(next(_rid)), Stats).load
    assert load["integrity_ok"], load
    assert load["kv_blocks_free"] == load["kv_blocks_total"], load
    assert load["running"] == load["waiting"] == load["rids"] == 0, load
    return load


def test_hello_advertises_the_hidden_size(worker: WorkerClient, lm: LoadedModel) -> None:
    assert worker.hello.model["hidden_size"] == lm.config.hidden == 64


def test_embeds_and_generations_in_the_same_steps_both_come_out_right(
    worker: WorkerClient, lm: LoadedModel
) -> None:
    rng = random.Random(7)
    gens = [_prompt(rng, n) for n in (12, 30, 21)]
    sampling = {**GREEDY, "max_new_tokens": 10}
    alone = []
    for p in gens:
        rid = next(_rid)
        worker.submit(rid, p, sampling)
        alone.append(worker.wait([rid])[rid].ids)
    embeds = [
        (_prompt(rng, 90), "last"),  # six prefill chunks
        (_prompt(rng, 70), "mean"),  # mean over five chunks
        (_prompt(rng, 1), "mean"),
        (_prompt(rng, 40), "last"),
    ]
    base = next(_rid)
    for _ in range(10):
        next(_rid)
    reqs = [(base + i, p, sampling, {}) for i, p in enumerate(gens)]
    reqs += [(base + 3 + i, p, NO_TOKENS, _embed(pool)) for i, (p, pool) in enumerate(embeds)]
    first_frame = len(worker.frames)
    worker.submit_many(reqs)
    got = worker.wait([r for r, *_ in reqs])
    for i, ids in enumerate(alone):
        assert got[base + i].ids == ids and got[base + i].finish == ["length", 10], i
    for i, (p, pool) in enumerate(embeds):
        r = got[base + 3 + i]
        assert _close(_vector(r), reference(lm, p, pool)), (i, pool)
        assert r.extras[0]["prompt_tokens"] == len(p)
    # The long embeds ended in steps that also carried generation tokens: one batch.
    steps = [f for f in worker.frames[first_frame:] if isinstance(f, Step)]
    shared = [
        s
        for s in steps
        if any(e.rid == base + 3 and e.finish for e in s.entries)
        and any(e.rid < base + 3 and e.new_ids for e in s.entries)
    ]
    assert shared, "the embed's last chunk ran alone"
    _idle_sound(worker)


def test_an_embed_frees_its_blocks_when_its_prefill_is_done(worker: WorkerClient) -> None:
    rng = random.Random(3)
    gen, emb = next(_rid), next(_rid)
    g_prompt = _prompt(rng, 10)
    worker.submit_many(
        [
            (gen, g_prompt, {**GREEDY, "max_new_tokens": 60}, {}),
            (emb, _prompt(rng, 100), NO_TOKENS, _embed("mean")),
        ]
    )
    worker.wait([emb])
    assert not worker.results[gen].done, "the generation ended first: nothing shown"
    load = worker.request(StatsReq(next(_rid)), Stats).load
    assert load["running"] == 1 and load["rids"] == 1, load
    held = load["kv_blocks_total"] - load["kv_blocks_free"]
    assert held <= math.ceil((len(g_prompt) + 60) / BLOCK), load  # the generation's only
    worker.wait([gen])
    _idle_sound(worker)


def test_normalize_false_and_prefix_cache(worker: WorkerClient, lm: LoadedModel) -> None:
    rng = random.Random(11)
    p = _prompt(rng, 50)
    out = {}
    for name, opts in [
        ("last", _embed("last")),
        ("last again", _embed("last")),  # its prefix comes from the prefix cache
        ("mean", _embed("mean", False)),
        ("mean again", _embed("mean", False)),  # mean pools every position: no reuse
    ]:
        rid = next(_rid)
        worker.submit(rid, p, NO_TOKENS, opts)
        out[name] = worker.wait([rid])[rid]
    assert out["last"].extras[0]["cached_tokens"] == 0
    assert out["last again"].extras[0]["cached_tokens"] == 49  # all but the pooled last
    assert out["mean again"].extras[0]["cached_tokens"] == 0
    assert _close(_vector(out["last again"]), _vector(out["last"]))
    raw = _vector(out["mean"])
    assert _close(raw, reference(lm, p, "mean", normalize=False))
    assert abs(math.sqrt(sum(v * v for v in raw)) - 1) > 1e-3
    assert _close(_vector(out["mean again"]), raw)
    _idle_sound(worker)


@pytest.mark.parametrize(
    ("prompt_len", "sampling", "options", "code"),
    [
        (5, {"max_new_tokens": 0, "n": 2}, _embed(), "invalid"),
        (5, NO_TOKENS, {**_embed(), "return_logprob": True}, "invalid"),
        (5, NO_TOKENS, {"embed": {"pooling": "max"}}, "invalid"),
        (5, NO_TOKENS, {"embed": "last"}, "invalid"),
        (300, NO_TOKENS, _embed(), "too_long"),  # the tiny model's context is 256
    ],
)
def test_bad_embed_requests_are_refused(
    worker: WorkerClient, prompt_len: int, sampling: dict, options: dict, code: str
) -> None:
    rid = next(_rid)
    next(_rid)  # n=2 takes two rids
    worker.submit(rid, [5] * prompt_len, sampling, options)
    rids = [rid, rid + 1] if sampling.get("n") == 2 else [rid]
    got = worker.wait(rids)
    assert all(r.error is not None and r.error[0] == code for r in got.values()), got
    _idle_sound(worker)


def test_abort_mid_prefill_releases_everything(worker: WorkerClient) -> None:
    rid = next(_rid)
    worker.submit(rid, [7] * 200, NO_TOKENS, _embed("mean"))  # 13 prefill steps, >= 130 ms
    load = worker.request(StatsReq(next(_rid)), Stats).load
    assert load["running"] + load["waiting"] == 1 and not worker.results[rid].done
    worker.send(Abort([rid]))
    r = worker.wait([rid])[rid]
    assert r.finish is not None and r.finish[0] == "abort" and r.ids == [], r
    _idle_sound(worker)
