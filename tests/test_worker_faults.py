"""Faults against the real worker process, on a tiny GGUF and a tiny KV budget.

Fuzzed frames, malformed fields, dropped connections and SHUTDOWN never take the worker
down or disturb other requests; preemption under a tiny KV budget loses nothing.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Iterator

import cbor2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.tiny_gguf import TinyModel
from tests.worker_client import WorkerClient, spawn_worker
from wire import Fatal, Probe, ProbeReply, Shutdown, Stats, StatsReq, Step
from wire.faults import ENV_VAR, FaultPlan, FaultRule

pytestmark = pytest.mark.timeout(300)

GREEDY = {"temperature": 0, "ignore_eos": True}
KV_TOKENS = 96  # 24 blocks of 4


@pytest.fixture(scope="module")
def sock_path(tiny_gguf: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    path = str(tmp_path_factory.mktemp("wf") / "w.sock")
    proc = spawn_worker(
        path,
        "--model",
        str(tiny_gguf.path),
        "--kv-cache-tokens",
        str(KV_TOKENS),
        "--block-size",
        "4",
        "--step-tokens",
        "32",
        "--max-pending",
        "64",
    )
    try:
        WorkerClient(path, timeout=120).close()
        yield path
        assert proc.poll() is None, "the worker died"
    finally:
        proc.kill()
        proc.wait()


def _assert_sound(c: WorkerClient) -> None:
    load = c.request(StatsReq(1), Stats).load
    assert load["integrity_ok"] and load["kv_blocks_free"] == load["kv_blocks_total"], load


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 250) for _ in range(rng.randrange(8, 30))] for _ in range(n)]


def test_tiny_kv_budget_preempts_and_outputs_match_alone(sock_path: str) -> None:
    c = WorkerClient(sock_path)
    ps = _prompts(8, 1)
    s = {**GREEDY, "max_new_tokens": 40}
    alone = {}
    for i, p in enumerate(ps):
        c.submit(100 + i, p, s)
        alone[i] = c.wait([100 + i])[100 + i].ids
    c.submit_many([(200 + i, p, s, {}) for i, p in enumerate(ps)])
    got = c.wait([200 + i for i in range(8)])
    assert sum(got[200 + i].extras[-1]["num_retractions"] for i in range(8)) > 0
    for i in range(8):
        assert got[200 + i].ids == alone[i] and got[200 + i].finish == ["length", 40]
    _assert_sound(c)
    c.close()


def test_connection_drop_frees_everything_and_the_next_one_is_served(sock_path: str) -> None:
    c = WorkerClient(sock_path)
    c.submit_many(
        [(i, p, {**GREEDY, "max_new_tokens": 50}, {}) for i, p in enumerate(_prompts(5, 2))]
    )
    c.wait([0], until=lambda f: isinstance(f, Step))
    c.close()
    c2 = WorkerClient(sock_path)
    _assert_sound(c2)
    c2.submit(0, [5, 6, 7], {**GREEDY, "max_new_tokens": 2})  # rid 0 is free again
    assert c2.wait([0])[0].finish == ["length", 2]
    c2.close()


def test_probe_is_answered_mid_generation_without_a_slot(sock_path: str) -> None:
    c = WorkerClient(sock_path)
    c.submit_many(
        [(i, p, {**GREEDY, "max_new_tokens": 60}, {}) for i, p in enumerate(_prompts(3, 3))]
    )
    reply = c.request(Probe(42), ProbeReply)
    assert reply.nonce == 42 and reply.load["running"] + reply.load["waiting"] <= 3
    c.wait()
    c.close()


def _one_shot(path: str, data: bytes) -> list:
    """Send raw bytes on a fresh connection, then a probe; return what came back."""
    c = WorkerClient(path)
    c.sock.settimeout(10)
    got: list = []
    try:
        try:
            c.send_raw(data)
            c.send(Probe(9))
        except OSError:
            pass  # the worker may close first; what it sent is still readable
        while (f := c.recv()) is not None:
            got.append(f)
            if isinstance(f, ProbeReply | Fatal):
                break
    except TimeoutError:
        pass
    finally:
        c.close()
    return got


_cbor = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.dictionaries(st.text(max_size=6) | st.integers(), inner, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    kind=st.integers(0, 14),
    rest=st.lists(_cbor, max_size=4),
    raw=st.booleans(),
    junk=st.binary(max_size=40),
)
def test_fuzzed_frames_never_kill_the_worker(
    sock_path: str, kind: int, rest: list, raw: bool, junk: bytes
) -> None:
    if kind == 12 and not rest:
        rest = [0]  # a real SHUTDOWN would (rightly) stop the worker
    payload = junk if raw else cbor2.dumps([kind, *rest])
    _one_shot(sock_path, struct.pack(">I", len(payload)) + payload)
    c = WorkerClient(sock_path)
    assert c.request(Probe(1), ProbeReply).nonce == 1
    c.close()


def test_oversized_and_malformed_frames_get_fatal(sock_path: str) -> None:
    got = _one_shot(sock_path, struct.pack(">I", 2**31))
    assert got and isinstance(got[-1], Fatal)
    got = _one_shot(sock_path, struct.pack(">I", 3) + b"\xff\xff\xff")
    assert got and isinstance(got[-1], Fatal)


def test_malformed_request_does_not_disturb_a_running_one(sock_path: str) -> None:
    c = WorkerClient(sock_path)
    c.submit(1, [5, 6, 7, 8], {**GREEDY, "max_new_tokens": 20})
    c.wait([1], until=lambda f: isinstance(f, Step))
    c.submit_many([(2, [5], {"temperature": -1}, {}), (3, [5], {}, {"logprob_start_len": 9})])
    res = c.wait([1, 2, 3])
    assert res[2].error[0] == "invalid" and res[3].error[0] == "invalid"
    assert res[1].finish == ["length", 20]
    c.close()


def test_shutdown_aborts_everything_and_exits_zero(
    tiny_gguf: TinyModel, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every step after the first takes 50 ms (a ``worker.forward`` delay), so the 200
    tokens would take 10 s: the SHUTDOWN sent after the first step finds the request
    running, and it must end as an abort (before, a fast machine could finish it first
    and the test accepted either end)."""
    path = str(tmp_path / "s.sock")
    slow = FaultRule("worker.forward", "delay", nth=2, times=0, delay=0.05)
    monkeypatch.setenv(ENV_VAR, FaultPlan([slow]).to_json())
    proc = spawn_worker(path, "--model", str(tiny_gguf.path))
    monkeypatch.delenv(ENV_VAR)
    try:
        c = WorkerClient(path, timeout=120)
        try:
            c.submit(1, [5, 6, 7], {**GREEDY, "max_new_tokens": 200})
            c.wait([1], until=lambda f: isinstance(f, Step))
            c.send(Shutdown())
            res = c.wait([1])
            assert res[1].finish[0] == "abort", res[1]
            assert len(res[1].ids) < 200
            assert c.recv() is None
        finally:
            c.close()
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
