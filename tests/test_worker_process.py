"""The real worker process over its Unix socket, on the default model."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from tests.worker_client import WorkerClient, spawn_worker
from wire import (
    Abort,
    Audit,
    AuditReply,
    Fatal,
    Flush,
    FlushReply,
    Probe,
    ProbeReply,
    Stats,
    StatsReq,
    Step,
)

pytestmark = [pytest.mark.model, pytest.mark.timeout(600)]

GREEDY = {"temperature": 0, "ignore_eos": True}


def _worker(path: str, *args: str) -> Iterator[WorkerClient]:
    proc = spawn_worker(path, "--kv-memory-mib", "256", *args)
    try:
        client = WorkerClient(path, timeout=300)
        client.sock_path = path  # type: ignore[attr-defined]  # for a second frontend
        yield client
        client.close()
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerClient]:
    """The default worker (quantized weights on the CPU)."""
    yield from _worker(str(tmp_path_factory.mktemp("wk") / "w.sock"))


@pytest.fixture(scope="module")
def fp32_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerClient]:
    """fp32 weights, for tests that compare runs in a batch with runs alone token for
    token on the fp32 path (the quantized default keeps that bit for bit too:
    tests/test_determinism_served.py)."""
    yield from _worker(str(tmp_path_factory.mktemp("wk") / "w.sock"), "--weights", "fp32")


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [1] + [rng.randrange(100, 40000) for _ in range(rng.randrange(4, 40))] for _ in range(n)
    ]


_rid = iter(range(1, 1 << 30))


def _run(c: WorkerClient, prompt: list[int], sampling: dict, options: dict | None = None):
    rid = next(_rid)
    c.submit(rid, prompt, sampling, options)
    return c.wait([rid])[rid]


def _idle_sound(c: WorkerClient) -> dict:
    load = c.request(StatsReq(next(_rid)), Stats).load
    assert load["integrity_ok"], load
    assert load["kv_blocks_free"] == load["kv_blocks_total"], load
    assert load["running"] == load["waiting"] == 0
    return load


def test_hello_describes_model_and_capacity(worker: WorkerClient) -> None:
    h = worker.hello
    assert h.model["vocab_size"] == 49152 and h.model["device"] == "cpu"
    assert h.capacity["block_size"] == 16 and h.capacity["max_pending"] >= 64
    reply = worker.request(Probe(7), ProbeReply)
    assert reply.nonce == 7 and reply.load["kv_blocks_total"] == h.capacity["kv_blocks"]


def test_stats_split_the_rss_into_weights_kv_and_the_rest(worker: WorkerClient) -> None:
    m = worker.request(StatsReq(next(_rid)), Stats).load["memory"]  # checked against the CDDL
    blocks = worker.hello.capacity["kv_blocks"]  # --kv-memory-mib 256 in whole blocks
    # K and V of a token: 46,080 B in fp32, 23,040 in the fp16 the CPU keeps for
    # quantized weights (--kv-cache-dtype auto)
    per_token = 23_040 if worker.hello.capacity["weights"] == "quantized" else 46_080
    assert worker.hello.capacity["kv_dtype"] == ("float16" if per_token == 23_040 else "float32")
    assert m["kv_bytes"] == blocks * 16 * per_token <= 256 * 2**20
    if worker.hello.capacity["weights"] == "quantized":  # the GGUF's blocks: ~96 MiB
        assert 50 * 2**20 < m["weights_bytes"] < 200 * 2**20
    else:  # LIFECYCLE_NATIVE=0: fp32 (540 MB) and oneDNN's packed copy of each matrix
        assert 500 * 2**20 < m["weights_bytes"] < 1200 * 2**20
    assert m["other_bytes"] > 0 and 0 <= m["kv_resident_bytes"] <= m["kv_bytes"]
    assert m["weights_bytes"] + m["kv_resident_bytes"] + m["other_bytes"] == m["rss_bytes"]


def test_concurrent_greedy_equals_alone(fp32_worker: WorkerClient) -> None:
    prompts = _prompts(64)
    sampling = {**GREEDY, "max_new_tokens": 6}
    alone = {i: _run(fp32_worker, prompts[i], sampling).ids for i in range(0, 64, 8)}
    base = next(_rid) + 1000
    for _ in range(1100):
        next(_rid)
    fp32_worker.submit_many([(base + i, p, sampling, {}) for i, p in enumerate(prompts)])
    got = fp32_worker.wait([base + i for i in range(64)])
    for i, ids in alone.items():
        assert got[base + i].ids == ids, f"prompt {i}"
    assert all(r.finish == ["length", 6] and len(r.ids) == 6 for r in got.values())
    _idle_sound(fp32_worker)


def test_frontends_share_the_worker_and_one_leaving_ends_only_its_own(
    worker: WorkerClient,
) -> None:
    """Several frontends at once (``serve --frontends N``): each numbers its own rids
    (both use the same rid here) and gets only its own entries, with the tokens each
    prompt gives alone; one that leaves mid-decode ends only what it held, and one that
    connects later takes its place."""
    path = worker.sock_path  # type: ignore[attr-defined]
    other = WorkerClient(path, timeout=60)
    try:
        assert other.hello.capacity == worker.hello.capacity
        p1, p2 = _prompts(2, 11)
        sampling = {**GREEDY, "max_new_tokens": 8}
        rid = next(_rid)
        worker.submit(rid, p1, sampling)
        other.submit(rid, p2, sampling)
        mine, theirs = worker.wait([rid])[rid], other.wait([rid])[rid]
        assert mine.ids == _run(worker, p1, sampling).ids
        assert theirs.ids == _run(worker, p2, sampling).ids != mine.ids
        long = {**GREEDY, "max_new_tokens": 300}
        rid = next(_rid)
        worker.submit(rid, p1, long)
        other.submit(rid, p2, long)
        other.wait([rid], until=lambda f: isinstance(f, Step) and len(other.results[rid].ids) >= 3)
        other.close()  # its frontend is gone mid-decode: its request ends, freed
        got = worker.wait([rid])[rid]
        assert got.finish == ["length", 300] and len(got.ids) == 300
        _idle_sound(worker)  # every block free: the one that left was aborted
        late = WorkerClient(path, timeout=60)
        rid = next(_rid)
        late.submit(rid, p2, sampling)
        assert late.wait([rid])[rid].ids == theirs.ids
        late.submit(1 << 40, p2, sampling)  # past the rid range: that frontend's error alone
        fatal = late.recv()
        assert isinstance(fatal, Fatal) and "2**40" in fatal.message, fatal
        late.close()
        _idle_sound(worker)
    finally:
        other.close()


def test_abort_queued_mid_prefill_and_mid_decode_frees_everything(worker: WorkerClient) -> None:
    long_prompt = [1] + [500 + i % 7000 for i in range(1500)]  # three prefill chunks
    a, b, c = next(_rid), next(_rid), next(_rid)
    worker.submit_many(
        [
            (a, long_prompt, {**GREEDY, "max_new_tokens": 50}, {}),
            (b, _prompts(1, 5)[0], {**GREEDY, "max_new_tokens": 500}, {}),
        ]
    )
    worker.send(Abort([a]))  # queued or mid-prefill
    worker.wait([a])
    assert worker.results[a].finish[0] == "abort"
    worker.wait([b], until=lambda f: isinstance(f, Step) and len(worker.results[b].ids) >= 3)
    worker.send(Abort([b]))  # mid-decode
    worker.submit(c, long_prompt, {**GREEDY, "max_new_tokens": 3})
    worker.wait([b])
    assert (
        worker.results[b].finish[0] == "abort"
        and worker.results[b].extras[-1]["num_retractions"] == 0
    )
    worker.wait([c], until=lambda f: isinstance(f, Step))
    worker.send(Abort([c, 999_999_999]))  # unknown rids are ignored
    worker.wait([c])
    _idle_sound(worker)


def test_prompt_chunks_send_empty_steps_and_audit_names_what_never_arrived(
    worker: WorkerClient,
) -> None:
    """A step that only prefills sends an empty STEP (the hung-worker watchdog's evidence
    of progress during a long prompt); AUDIT, answered in order with SUBMIT, names the
    rids the worker does not hold (issue 37 items 1 and 10)."""
    worker.request(Flush(next(_rid)), FlushReply)  # no cached prefix: every chunk runs
    a = next(_rid)
    long_prompt = [1] + [900 + i % 5000 for i in range(1500)]  # three prefill chunks
    worker.submit(a, long_prompt, {**GREEDY, "max_new_tokens": 40, "n": 2})
    empty = 0
    while not worker.results[a].ids:
        frame = worker.recv()
        assert frame is not None
        if isinstance(frame, Step) and not frame.entries:
            empty += 1
        worker.apply(frame)
    assert empty == 2  # chunks 1 and 2 of 3 carried no token
    never = next(_rid) + 1000
    reply = worker.request(Audit(next(_rid), [a, a + 1, never]), AuditReply)
    assert reply.missing == [never]  # both samples are still decoding
    worker.wait([a, a + 1])
    reply = worker.request(Audit(next(_rid), [a, a + 1]), AuditReply)
    assert reply.missing == [a, a + 1]  # ended: the worker holds neither
    _idle_sound(worker)


def test_prefix_cache_hit_reports_cached_tokens_and_same_output(worker: WorkerClient) -> None:
    worker.request(Flush(next(_rid)), FlushReply)
    prompt = [1] + [700 + i for i in range(100)]
    first = _run(worker, prompt, {**GREEDY, "max_new_tokens": 8})
    second = _run(worker, prompt, {**GREEDY, "max_new_tokens": 8})
    assert first.extras[0]["cached_tokens"] == 0
    # All but the last of the 101 prompt tokens (6 whole blocks and 4 rows copied out of
    # the 7th); the last is fed again, since its logits give the first output token.
    assert second.extras[0]["cached_tokens"] == 100
    assert second.ids == first.ids
    load = _idle_sound(worker)
    assert load["kv_blocks_cached"] > 0
    worker.request(Flush(next(_rid)), FlushReply)
    assert _idle_sound(worker)["kv_blocks_cached"] == 0


def test_unfittable_request_is_refused_at_once(worker: WorkerClient) -> None:
    r = _run(worker, [1, 2, 3], {"max_new_tokens": 10_000_000})
    assert r.error is not None and r.error[0] == "too_long" and "exceeds" in r.error[1]
    r = _run(worker, [5] * 9000, {"max_new_tokens": 1})
    assert r.error[0] == "too_long"


@pytest.mark.parametrize(
    ("sampling", "options"),
    [
        ({"top_p": -1}, {}),
        ({"temperature": "hot"}, {}),
        ({"top_k": 0}, {}),
        ({"logit_bias": {10**9: 1.0}}, {}),
        ({"stop_token_ids": [-4]}, {}),
        ({"max_new_tokens": 2, "min_new_tokens": 3}, {}),
        ({}, {"token_ids_logprob": b"\x01\x02\x03"}),
        ({}, {"token_ids_logprob": [49152]}),
        ({}, {"top_logprobs_num": -1}),
        ({"n": 0}, {}),
    ],
)
def test_malformed_fields_fail_only_their_request(
    worker: WorkerClient, sampling: dict, options: dict
) -> None:
    good, bad = next(_rid), next(_rid)
    worker.submit_many(
        [
            (good, [1, 2, 3, 4], {**GREEDY, "max_new_tokens": 3}, {}),
            (bad, [1, 2], sampling, options),
        ]
    )
    res = worker.wait([good, bad])
    assert res[bad].error is not None and res[bad].error[0] == "invalid", res[bad]
    assert res[good].finish == ["length", 3]


def test_bad_prompt_ids_are_invalid(worker: WorkerClient) -> None:
    assert _run(worker, [1, 49152], {}).error[0] == "invalid"
    assert _run(worker, [-1], {}).error[0] == "invalid"
    assert _run(worker, [], {}).error[0] == "invalid"


def test_seed_n_and_logprobs_on_the_real_model(fp32_worker: WorkerClient) -> None:
    from wire import f32s_to_list, ids_to_list

    prompt = [1, 504, 3458, 282, 4649, 314]  # a short English prompt
    seeded = {
        "temperature": 0.9,
        "top_p": 0.95,
        "seed": 77,
        "max_new_tokens": 8,
        "ignore_eos": True,
    }
    alone = _run(fp32_worker, prompt, seeded).ids
    greedy = _run(fp32_worker, prompt, {**GREEDY, "max_new_tokens": 8}).ids
    base = next(_rid)
    for _ in range(8):
        next(_rid)
    fp32_worker.submit_many(
        [
            (base, prompt, seeded, {}),
            (base + 1, prompt, {**GREEDY, "max_new_tokens": 8, "n": 2}, {}),
            (base + 3, _prompts(1, 9)[0], {"temperature": 1.0, "max_new_tokens": 5}, {}),
            (
                base + 4,
                prompt,
                {**GREEDY, "max_new_tokens": 4},
                {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2},
            ),
        ]
    )
    got = fp32_worker.wait([base, base + 1, base + 2, base + 3, base + 4])
    assert got[base].ids == alone
    assert got[base + 1].ids == got[base + 2].ids == greedy
    lp = got[base + 4]
    assert lp.ids == greedy[:4]
    first = lp.extras[0]
    assert len(f32s_to_list(first["prompt_logprobs"])) == len(prompt)
    for k, extra in enumerate(lp.extras[: len(lp.ids)]):
        (chosen,) = f32s_to_list(extra["logprobs"])
        assert chosen <= 0 and ids_to_list(extra["top_ids"][0])[0] == lp.ids[k]
    _idle_sound(fp32_worker)
