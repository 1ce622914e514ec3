"""Fault points inside the model worker (``gpu.worker`` on a tiny GGUF): a plan from
``LIFECYCLE_FAULTS`` makes a forward pass raise, return NaN logits, or a sample carry a
malformed logprob field. Each time the failing requests end explicitly, the worker stays
up, the next request is served and its KV books balance."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from gpu.runtime.step_books import NON_FINITE_MESSAGE
from tests.tiny_gguf import TinyModel
from tests.worker_client import WorkerClient, served_worker
from wire import Stats, StatsReq, f32s_to_list
from wire.faults import ENV_VAR, FaultPlan, FaultRule

pytestmark = pytest.mark.timeout(120)

GREEDY = {"temperature": 0, "ignore_eos": True}


@contextmanager
def _worker(
    tiny: TinyModel,
    path: str,
    rules: list[FaultRule],
    monkeypatch: pytest.MonkeyPatch,
    *extra: str,
) -> Iterator[WorkerClient]:
    monkeypatch.setenv(ENV_VAR, FaultPlan(rules).to_json())
    with served_worker(path, "--model", str(tiny.path), "--kv-cache-tokens", "256", *extra) as c:
        monkeypatch.delenv(ENV_VAR)  # the worker has it; nothing started later does
        yield c


def _sound_and_serving(c: WorkerClient, rid: int) -> None:
    c.submit(rid, [5, 6, 7], {**GREEDY, "max_new_tokens": 3})
    assert c.wait([rid])[rid].finish == ["length", 3]
    load = c.request(StatsReq(1), Stats).load
    assert load["integrity_ok"] and load["kv_blocks_free"] == load["kv_blocks_total"], load


def test_forward_raise_fails_the_batch_not_the_worker(
    tiny_gguf: TinyModel,
    tmp_path,
    monkeypatch: pytest.MonkeyPatch,  # noqa: ANN001
) -> None:
    with _worker(
        tiny_gguf,
        str(tmp_path / "w.sock"),
        [FaultRule("worker.forward", "raise", nth=3)],
        monkeypatch,
    ) as c:
        c.submit_many([(i, [10 + i, 11, 12], {**GREEDY, "max_new_tokens": 20}, {}) for i in (1, 2)])
        got = c.wait([1, 2])
        for r in (1, 2):
            assert got[r].error is not None and got[r].error[0] == "internal", got[r]
        _sound_and_serving(c, 9)


@pytest.mark.parametrize(
    ("overlap", "logprobs"), [("off", True), ("on", False)], ids=["synchronous", "overlapped"]
)
def test_nan_logits_end_explicitly(
    overlap: str,
    logprobs: bool,
    tiny_gguf: TinyModel,
    tmp_path,
    monkeypatch: pytest.MonkeyPatch,  # noqa: ANN001
) -> None:
    """Overlapped (a plain row without logprobs flies): the NaN row's token is read a
    step later, and the step after it read a valid id on the device meanwhile."""
    with _worker(
        tiny_gguf,
        str(tmp_path / "w.sock"),
        [FaultRule("worker.forward", "nan", nth=2)],
        monkeypatch,
        "--overlap",
        overlap,
    ) as c:
        c.submit(
            1,
            [20, 21, 22],
            {"temperature": 0.8, "max_new_tokens": 8, "ignore_eos": True},
            {"return_logprob": logprobs},
        )
        r = c.wait([1])[1]
        # The first step's token, then the request fails as ours (500), explicitly: before,
        # an argmax over NaN went on as token 0 with a NaN logprob and a normal finish.
        assert len(r.ids) == 1 and r.finish is None, r
        assert r.error is not None and tuple(r.error[:2]) == ("internal", NON_FINITE_MESSAGE)
        _sound_and_serving(c, 9)


def test_malformed_logprob_field_reaches_the_frontend_not_the_worker(
    tiny_gguf: TinyModel,
    tmp_path,
    monkeypatch: pytest.MonkeyPatch,  # noqa: ANN001
) -> None:
    with _worker(
        tiny_gguf,
        str(tmp_path / "w.sock"),
        [FaultRule("worker.sample", "corrupt", rid=4, nth=2)],
        monkeypatch,
    ) as c:
        c.submit(4, [30, 31], {**GREEDY, "max_new_tokens": 4}, {"return_logprob": True})
        r = c.wait([4])[4]
        assert r.finish == ["length", 4]
        fields = [e.get("logprobs") for e in r.extras if e and "logprobs" in e]
        assert b"\x01\x02\x03" in fields
        with pytest.raises(ValueError):
            f32s_to_list(b"\x01\x02\x03")  # what the frontend refuses (GenerateCall._bad_output)
        assert all(
            math.isfinite(v) for f in fields if f != b"\x01\x02\x03" for v in f32s_to_list(f)
        )
        _sound_and_serving(c, 9)
