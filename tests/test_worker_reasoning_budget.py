"""The thinking budget in the model's worker (``gpu.worker`` on a tiny GGUF, greedy): a
budget of k forces the given end ids right after k output tokens (counted from the
output's start, or from the start ids when the model writes them), then the sample goes
on as the model's greedy choice; the end written by the model ends the budget; forks
(n > 1) each keep their own; requests without a budget, alone or in a batch beside one,
are unchanged. Synchronous and overlapped steps alike (a row whose next token is forced
does not fly: the next step would read the sampled one on the device)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.tiny_gguf import TinyModel
from tests.worker_client import Result, WorkerClient, served_worker
from wire import ReasoningBudget, ids_to_list

pytestmark = pytest.mark.timeout(180)

GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 12}
PROMPT = [20, 21, 22]


@pytest.fixture(params=["off", "on"], ids=["synchronous", "overlapped"])
def client(
    request: pytest.FixtureRequest,
    tiny_gguf: TinyModel,
    tmp_path,  # noqa: ANN001
) -> Iterator[WorkerClient]:
    args = ("--model", str(tiny_gguf.path), "--kv-cache-tokens", "512", "--overlap", request.param)
    with served_worker(str(tmp_path / "w.sock"), *args) as c:
        yield c


def _run(c: WorkerClient, rid: int, budget: ReasoningBudget | None, **opts: Any) -> Result:
    options = dict(opts)
    if budget is not None:
        options["reasoning_budget"] = budget.to_wire()
    c.submit(rid, PROMPT, GREEDY, options)
    r = c.wait([rid])[rid]
    assert r.finish == ["length", 12], r
    return r


def _top1(r: Result) -> list[int]:
    return [ids_to_list(t)[0] for e in r.extras for t in e.get("top_ids", [])]


def _unused(base: list[int], n: int) -> list[int]:
    """``n`` ids the greedy output never writes (the end ids: never closed by the model)."""
    return [t for t in range(30, 300) if t not in base][:n]


def test_the_end_is_forced_after_k_tokens_then_greedy_goes_on(client: WorkerClient) -> None:
    base = _run(client, 1, None).ids
    end, other = _unused(base, 2)
    k, force = 3, (other, end)
    budget = ReasoningBudget(k, (end,), force)
    out = _run(client, 2, budget).ids
    assert out[:k] == base[:k] and tuple(out[k : k + 2]) == force, (base, out)
    scored = _run(client, 3, budget, return_logprob=True, top_logprobs_num=1)
    assert scored.ids == out  # the same tokens when the row cannot fly
    top = _top1(scored)
    assert [t for i, t in enumerate(out) if i not in (k, k + 1)] == [
        t for i, t in enumerate(top) if i not in (k, k + 1)
    ]  # every other token is the model's greedy choice after the forced ones
    assert _run(client, 4, None).ids == base  # nothing of it stays with the worker


def test_the_start_ids_open_the_count_and_the_models_end_closes_it(client: WorkerClient) -> None:
    base = _run(client, 1, None).ids
    end, other = _unused(base, 2)
    opened = base.index(base[1]) + 1  # the count starts after the start's first match
    out = _run(client, 2, ReasoningBudget(2, (end,), (other, end), start=(base[1],))).ids
    assert out[: opened + 2] == base[: opened + 2]
    assert out[opened + 2 : opened + 4] == [other, end], (base, out)
    # the model writes the end within the budget: nothing is forced
    assert _run(client, 3, ReasoningBudget(5, (base[2],), (other, end))).ids == base
    never = _run(client, 4, ReasoningBudget(0, (end,), (other,), start=(end,))).ids
    assert never == base  # the start never written: nothing counted


def test_a_batch_keeps_each_requests_own_tokens(client: WorkerClient) -> None:
    base = _run(client, 1, None).ids
    end, other = _unused(base, 2)
    budget = ReasoningBudget(0, (end,), (other, end)).to_wire()
    client.submit_many([
        (10, PROMPT, GREEDY, {}),
        (11, PROMPT, {**GREEDY, "n": 2}, {"reasoning_budget": budget}),
        (13, PROMPT, GREEDY, {}),
    ])  # fmt: skip
    got = client.wait([10, 11, 12, 13])
    assert got[10].ids == got[13].ids == base
    for rid in (11, 12):  # each fork forces its own end, first
        assert got[rid].ids[:2] == [other, end], got[rid]
    assert got[11].ids == got[12].ids
