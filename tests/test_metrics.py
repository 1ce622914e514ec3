"""``GET /metrics``: Prometheus text that ``prometheus_client.parser`` reads, and counters
that move by exactly the right amounts over a scripted sequence of requests (a real server
process driving the scripted worker process)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import anyio
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import connect

from lifecycle.api.metrics import record_timings
from lifecycle.core.fsm import TraceEntry
from lifecycle.core.states import Event, State

from .scripted import lifecycle_server
from .ws_helpers import Collected, echo_body, gen_msg, wait_idle

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with lifecycle_server("--scripted-worker", "--worker-args", "--step-delay 0.01") as base:
        yield base


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


W0 = (("worker", "0"),)  # the one worker's label


def scrape(url: str) -> Samples:
    r = httpx.get(url + "/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out: Samples = {}
    for family in text_string_to_metric_families(r.text):
        assert family.name.startswith("lifecycle_"), family.name
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def delta(a: Samples, b: Samples, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return b.get(key, 0.0) - a.get(key, 0.0)


def test_record_timings_from_a_trace() -> None:
    ms = 1_000_000
    trace = [
        TraceEntry(1 * ms, State.RECEIVED, State.VALIDATED, Event.VALIDATE, None),
        TraceEntry(2 * ms, State.VALIDATED, State.QUEUED, Event.ADMIT, None),
        TraceEntry(5 * ms, State.QUEUED, State.RUNNING, Event.DISPATCH, None),
        TraceEntry(9 * ms, State.RUNNING, State.STREAMING, Event.FIRST_TOKEN, None),
        TraceEntry(30 * ms, State.STREAMING, State.DONE, Event.FINISH, None),
    ]
    t = record_timings(trace, 0)
    assert t == pytest.approx({"e2e": 0.030, "queue": 0.003, "ttft": 0.009, "decode": 0.021})
    assert record_timings(trace[:2], 0) == {"e2e": 0.002}


@pytest.mark.anyio
async def test_counters_move_by_the_right_amounts(url: str) -> None:
    wait_idle(url)
    m0 = scrape(url)
    bodies = [echo_body(i, 5 + i) for i in range(3)]  # 3 prompt tokens each; 5, 6, 7 new
    for body in bodies:
        assert httpx.post(url + "/generate", json=body, timeout=30).status_code == 200
    bad = {"text": "x", "sampling_params": {"top_p": -1}}  # refused before it has a record
    assert httpx.post(url + "/generate", json=bad, timeout=30).status_code == 400
    too_long = {"input_ids": [5] * 9000, "sampling_params": {"max_new_tokens": 4}}
    assert httpx.post(url + "/generate", json=too_long, timeout=30).status_code == 400
    assert httpx.get(url + "/no_such_route", timeout=30).status_code == 404
    assert httpx.get(url + "/v1/stream", timeout=30).status_code == 426  # not an upgrade
    m1 = scrape(url)
    assert delta(m0, m1, "lifecycle_http_requests_total",
                 endpoint="/generate", method="POST", status="200") == 3  # fmt: skip
    assert delta(m0, m1, "lifecycle_http_requests_total",
                 endpoint="/generate", method="POST", status="400") == 2  # fmt: skip
    assert delta(m0, m1, "lifecycle_http_requests_total",
                 endpoint="(unmatched)", method="GET", status="404") == 1  # fmt: skip
    assert delta(m0, m1, "lifecycle_http_requests_total",
                 endpoint="/v1/stream", method="GET", status="426") == 1  # fmt: skip
    assert delta(m0, m1, "lifecycle_requests_total", outcome="done") == 3
    assert delta(m0, m1, "lifecycle_request_errors_total", cause="too_long") == 1
    assert delta(m0, m1, "lifecycle_prompt_tokens_total") == 9
    assert delta(m0, m1, "lifecycle_generation_tokens_total") == 5 + 6 + 7
    for hist in ("time_to_first_token", "e2e_request_latency", "queue_time"):
        assert delta(m0, m1, f"lifecycle_{hist}_seconds_count") >= 3, hist
    assert delta(m0, m1, "lifecycle_time_to_first_token_seconds_count") == 3
    assert delta(m0, m1, "lifecycle_inter_token_latency_seconds_count") == 3
    assert delta(m0, m1, "lifecycle_e2e_request_latency_seconds_count") == 4  # + too long
    assert delta(m0, m1, "lifecycle_time_to_first_token_seconds_sum") > 0

    # An abort (a WebSocket cancel) and a client that goes away mid-stream.
    async with connect(url.replace("http", "ws") + "/v1/stream") as ws:
        await ws.send(gen_msg("a", echo_body(1, 500)))
        await ws.send(gen_msg("b", echo_body(2, 500)))
        got = Collected()
        while len(got.deltas["a"]) < 2 or not got.deltas["b"]:
            got.add(await ws.recv())
        m2 = scrape(url)
        assert m2[("lifecycle_requests_in_state", (("state", "streaming"),))] == 2
        assert m2[("lifecycle_worker_running", W0)] == 2
        assert m2[("lifecycle_worker_kv_blocks_used", W0)] > 0
        await ws.send(json.dumps({"type": "cancel", "id": "a"}))
        while "a" not in got.final:
            got.add(await ws.recv())
    wait_idle(url)
    deadline = time.monotonic() + 5
    while True:
        m3 = scrape(url)
        if delta(m1, m3, "lifecycle_request_errors_total", cause="client_gone") == 1:
            break
        assert time.monotonic() < deadline, "the closed socket's generation was not counted"
        await anyio.sleep(0.05)
    assert delta(m1, m3, "lifecycle_request_errors_total", cause="aborted") == 1
    assert delta(m1, m3, "lifecycle_requests_total", outcome="aborted") == 1
    assert delta(m1, m3, "lifecycle_requests_total", outcome="done") == 0
    assert delta(m1, m3, "lifecycle_http_requests_total",
                 endpoint="/v1/stream", method="GET", status="101") == 1  # fmt: skip
    for state in ("received", "validated", "queued", "running", "streaming"):
        assert m3[("lifecycle_requests_in_state", (("state", state),))] == 0
    assert m3[("lifecycle_worker_kv_blocks_used", W0)] == 0
    assert (
        m3[("lifecycle_worker_kv_blocks_free", W0)]
        == m3[("lifecycle_worker_kv_blocks_capacity", W0)]
    )
    assert m3[("lifecycle_worker_restarts_total", W0)] == 0
    assert m3[("lifecycle_worker_ready", W0)] == 1
    assert m3[("lifecycle_admission_queue_depth", ())] == 0
    assert m3[("lifecycle_tombstones", ())] == 0


def test_worker_restarts_and_worker_lost_are_counted(url: str) -> None:
    import os
    import signal

    m0 = scrape(url)
    pid = httpx.get(url + "/server_info", timeout=10).json()["internal_states"][0]["pid"]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while True:
        m1 = scrape(url)
        if (
            delta(m0, m1, "lifecycle_worker_restarts_total", worker="0") == 1
            and m1[("lifecycle_worker_ready", W0)]
        ):
            break
        assert time.monotonic() < deadline, "the worker did not come back"
        time.sleep(0.1)
    assert httpx.post(url + "/generate", json=echo_body(0, 2), timeout=30).status_code == 200
