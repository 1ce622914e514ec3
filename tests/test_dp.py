"""``serve --dp N``: several workers behind one frontend (lifecycle/link/pool.py), each a
real scripted worker process under its own supervisor: both take a share, killing one
mid-load fails only the streams it held while the rest complete and it comes back, and
the router policies send a call where they say."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator

import httpx
import pytest

from .scripted import lifecycle_server


def _dp_server(policy: str, *extra: str) -> Iterator[str]:
    with lifecycle_server("--scripted-worker", "--dp", "2", "--router-policy", policy,
                          "--max-running", "16", "--max-pending", "32", "--restart-backoff",
                          "0.2", *extra) as base:  # fmt: skip
        # /health is 200 once one worker is ready; the router's counts are only even
        # when both take part from the first call (a round-robin turn landing on a worker
        # still starting went to the other, and the picks came out 17 / 15).
        deadline = time.monotonic() + 60
        while not all(s.get("ready") for s in _info(base)["internal_states"]):
            assert time.monotonic() < deadline, _info(base)["internal_states"]
            time.sleep(0.05)
        yield base


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _stream(
    c: httpx.AsyncClient, i: int, n: int, ranks: list[int] | None = None
) -> tuple[str, int]:
    """("done" | "error", tokens seen) for one stream of ``n`` tokens; ``ranks`` gets
    the ``meta_info.dp_rank`` of each of its frames."""
    body = {"input_ids": [100 + i, 200 + i, 300], "stream": True,
            "sampling_params": {"max_new_tokens": n, "ignore_eos": True}}  # fmt: skip
    seen, outcome = 0, "cut"
    async with c.stream("POST", "/generate", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            event = json.loads(line[6:])
            if "error" in event:
                outcome = "error"
            else:
                seen = len(event["output_ids"])
                if ranks is not None:
                    ranks.append(event["meta_info"]["dp_rank"])
                if event["meta_info"]["finish_reason"] is not None:
                    outcome = "done"
    return outcome, seen


def _info(base: str) -> dict:
    return httpx.get(base + "/server_info", timeout=10).json()


@pytest.mark.anyio
async def test_two_workers_share_the_load_and_one_lost_fails_only_its_streams() -> None:
    for base in _dp_server("least_load", "--worker-args", "--step-delay 0.01"):
        ranks: list[list[int]] = [[] for _ in range(64)]
        async with httpx.AsyncClient(base_url=base, timeout=60) as c:
            outcomes = await asyncio.gather(*(_stream(c, i, 64, ranks[i]) for i in range(64)))
        assert all(o == ("done", 64) for o in outcomes), outcomes
        info = _info(base)
        assert len(info["internal_states"]) == 2 and min(info["router"]["picks"]) >= 16
        # meta_info.dp_rank names each stream's worker, the same in every frame
        assert all(len(set(r)) == 1 for r in ranks), ranks
        served = [r[0] for r in ranks]
        assert [served.count(k) for k in (0, 1)] == info["router"]["picks"], served
        assert info["live_requests"] == 0

        # 64 long streams, then kill the worker of one of them mid-load
        victim = info["internal_states"][1]["pid"]
        async with httpx.AsyncClient(base_url=base, timeout=60) as c:
            tasks = [asyncio.create_task(_stream(c, i, 300)) for i in range(64)]
            await asyncio.sleep(1.0)
            os.kill(victim, signal.SIGKILL)
            outcomes = await asyncio.gather(*tasks)
        done = [o for o in outcomes if o == ("done", 300)]
        failed = [o for o in outcomes if o[0] == "error"]
        assert len(done) + len(failed) == 64, outcomes  # every stream ended explicitly
        assert 16 <= len(failed) <= 48 and len(done) >= 16, (len(done), len(failed))
        assert httpx.get(base + "/health").status_code == 200  # the other one serves
        deadline = time.monotonic() + 30
        while True:  # the killed worker comes back
            states = _info(base)["internal_states"]
            if states[1]["restarts"] >= 1 and states[1]["ready"]:
                break
            assert time.monotonic() < deadline, states
            time.sleep(0.1)
        assert states[1]["pid"] != victim
        info = _info(base)
        assert info["live_requests"] == 0
        assert info["failed_requests"].get("worker_lost", 0) == len(failed)


def _generate(base: str, prompt: list[int]) -> None:
    r = httpx.post(base + "/generate", json={"input_ids": prompt,
                   "sampling_params": {"max_new_tokens": 2}}, timeout=30)  # fmt: skip
    assert r.status_code == 200, r.text


def _prefixed(k: int, j: int) -> list[int]:
    """Prompt ``j`` of family ``k``: a 64-token prefix of its own, then a tail."""
    return [1000 + 97 * k + t for t in range(64)] + [5000 + j, 6000 + j]


def test_cache_aware_follows_the_prefix_round_robin_takes_turns() -> None:
    for base in _dp_server("cache_aware"):
        for j in range(8):
            for k in range(4):
                _generate(base, _prefixed(k, j))
        router = _info(base)["router"]
        # each family's first call goes where the least is cached, the 7 others follow it
        assert router["policy"] == "cache_aware" and router["picks"] == [16, 16]
        assert router["affinity_hits"] == 28
    for base in _dp_server("round_robin"):
        for j in range(8):
            for k in range(4):
                _generate(base, _prefixed(k, j))
        router = _info(base)["router"]
        assert router["affinity_hits"] == 0 and abs(router["picks"][0] - router["picks"][1]) <= 1
