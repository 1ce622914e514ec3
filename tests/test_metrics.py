"""``GET /metrics``: Prometheus text that ``prometheus_client.parser`` reads, and counters
that move by exactly the right amounts over a scripted sequence of requests (a real server
process driving the scripted worker process); the worker's step, memory, KV and
retraction series from a real server on the real model with a KV cache small enough
that its requests must preempt each other."""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import anyio
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import connect

import lifecycle
from lifecycle.core.fsm import TraceEntry
from lifecycle.core.states import Event, State
from lifecycle.tracing.metrics import record_timings

from .native_mode import cpu_default_weights
from .scripted import lifecycle_server
from .ws_helpers import Collected, echo_body, gen_msg, wait_idle

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with lifecycle_server("--scripted-worker", "--worker-args", "--step-delay 0.01") as base:
        yield base


@pytest.fixture(scope="module")
def model_url() -> Iterator[str]:
    """The real model (its quantized default) with a KV cache of 64 tokens (4 blocks of
    16) and 4 sequences at most: four requests of 8 + 12 tokens (2 blocks each at the
    end) cannot all hold their blocks, so the worker preempts (retracts) some."""
    with lifecycle_server("--device", "cpu", "--kv-cache-tokens", "64",
                          "--max-running", "4") as base:  # fmt: skip
        yield base


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


W0 = (("worker", "0"),)  # the one worker's label


# The process's own families: no model_name (once, however many models).
PROCESS_FAMILIES = ("lifecycle_process_", "lifecycle_unknown_fields", "lifecycle_tracer_",
                    "lifecycle_trace_log_")  # fmt: skip


def scrape(url: str) -> Samples:
    """The samples by name and labels, less ``model_name``: every model series has it,
    one value (the one model's id), and the process's own have none."""
    r = httpx.get(url + "/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out: Samples = {}
    models: set[str] = set()
    for family in text_string_to_metric_families(r.text):
        assert family.name.startswith("lifecycle_"), family.name
        for s in family.samples:
            labels = dict(s.labels)
            model = labels.pop("model_name", None)
            assert (model is None) == family.name.startswith(PROCESS_FAMILIES), s
            models.update([model] if model is not None else [])
            out[(s.name, tuple(sorted(labels.items())))] = s.value
    assert len(models) == 1, models
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
    assert t == pytest.approx(
        {"e2e": 0.030, "queue": 0.003, "ttft": 0.009, "decode": 0.021, "prefill": 0.004}
    )
    assert record_timings(trace[:2], 0) == {"e2e": 0.002}


@pytest.mark.anyio
async def test_counters_move_by_the_right_amounts(url: str) -> None:
    wait_idle(url)
    m0 = scrape(url)
    bodies = [echo_body(i, 5 + i) for i in range(3)]  # 3 prompt tokens each; 5, 6, 7 new
    for body in bodies:
        assert httpx.post(url + "/generate", json=body, timeout=30).status_code == 200
    bad = {"text": "x", "sampling_params": {"top_p": -1}}  # refused: a record that ends invalid
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
    assert delta(m0, m1, "lifecycle_finish_reasons_total", reason="too_long") == 1
    assert delta(m0, m1, "lifecycle_finish_reasons_total", reason="length") == 3
    assert delta(m0, m1, "lifecycle_prompt_tokens_total") == 9
    assert delta(m0, m1, "lifecycle_generation_tokens_total") == 5 + 6 + 7
    for hist in ("time_to_first_token", "e2e_request_latency", "queue_time"):
        assert delta(m0, m1, f"lifecycle_{hist}_seconds_count") >= 3, hist
    assert delta(m0, m1, "lifecycle_time_to_first_token_seconds_count") == 3
    assert delta(m0, m1, "lifecycle_inter_token_latency_seconds_count") == 3
    assert delta(m0, m1, "lifecycle_requests_total", outcome="invalid") == 1
    assert delta(m0, m1, "lifecycle_e2e_request_latency_seconds_count") == 5  # + too long, invalid
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
    # The cancelled sample's finish reason is abort (what its reply says); the one whose
    # client left counts its cause.
    assert delta(m1, m3, "lifecycle_finish_reasons_total", reason="abort") == 1
    assert delta(m1, m3, "lifecycle_finish_reasons_total", reason="client_gone") == 1
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


def test_wire_histograms_read_as_prometheus_buckets() -> None:
    from wire import StepStats, read_histogram

    st = StepStats()
    for seconds, seqs in ((0.004, 1), (0.012, 3), (0.012, 3), (20.0, 600)):
        st.record(seconds, seqs, seqs * 2)
    w = st.to_wire()
    read = read_histogram(w["step_batch"])
    assert read is not None
    buckets, total = read
    assert dict(buckets)[1.0] == 1 and dict(buckets)[4.0] == 3 and buckets[-1] == (float("inf"), 4)
    assert total == 607
    read = read_histogram(w["step_seconds"])
    assert read is not None
    buckets, total = read
    assert dict(buckets)[0.005] == 1 and dict(buckets)[0.015] == 3 and dict(buckets)[10.0] == 3
    assert total == pytest.approx(20.028)
    for bad in (None, {"le": [1, 2], "counts": [1, 2], "sum": 0},  # one count short
                {"le": [2, 1], "counts": [0, 0, 0], "sum": 0},  # not ascending
                {"le": [1], "counts": [-1, 0], "sum": 0}, {"le": [1], "counts": [0, 0]}):  # fmt: skip
        assert read_histogram(bad) is None, bad


def test_finish_reasons_lengths_phases_and_build_info(url: str) -> None:
    """A max_tokens cut counts reason length, a stop token reason stop; each prompt and
    output length lands in its bucket; prefill and decode time are observed per request;
    every worker step is in the step histograms; no `_created` series."""
    wait_idle(url)
    m0 = scrape(url)
    cut = {"input_ids": [101, 102, 103, 104, 105], "sampling_params": {"max_new_tokens": 3}}
    stop = {"input_ids": [201, 202, 203], "sampling_params": {"max_new_tokens": 50,
            "stop_token_ids": [203]}}  # fmt: skip
    got = [httpx.post(url + "/generate", json=b, timeout=30).json() for b in (cut, stop)]
    assert [g["meta_info"]["finish_reason"]["type"] for g in got] == ["length", "stop"]
    r = httpx.get(url + "/metrics", timeout=10)
    assert "_created" not in r.text  # prometheus_client's created series are switched off
    m1 = scrape(url)
    assert delta(m0, m1, "lifecycle_finish_reasons_total", reason="length") == 1
    assert delta(m0, m1, "lifecycle_finish_reasons_total", reason="stop") == 1
    # Prompts of 5 and 3 tokens; outputs of 3 and 3 (the stop token is the third).
    for le, want in (("2.0", 0), ("4.0", 1), ("8.0", 2), ("+Inf", 2)):
        assert delta(m0, m1, "lifecycle_request_prompt_tokens_bucket", le=le) == want, le
    assert delta(m0, m1, "lifecycle_request_prompt_tokens_sum") == 8
    for le, want in (("2.0", 0), ("4.0", 2), ("+Inf", 2)):
        assert delta(m0, m1, "lifecycle_request_generation_tokens_bucket", le=le) == want, le
    assert delta(m0, m1, "lifecycle_request_generation_tokens_sum") == 6
    # --step-delay 0.01: two more steps after the first token, each at least 10 ms in the
    # worker. The frontend times decode from when it reads the first token to when it reads
    # the last, so a first frame read late shortens it by that delay (0.038 s against the
    # 0.04 s of the steps on a busy 2-core CI run): the bound is the steps' time less up to
    # 10 ms of such delay per request, half of it; a decode not timed at all gives 0.
    assert delta(m0, m1, "lifecycle_request_decode_time_seconds_count") == 2
    assert delta(m0, m1, "lifecycle_request_decode_time_seconds_sum") >= 2 * (2 * 0.01 - 0.01)
    assert delta(m0, m1, "lifecycle_request_prefill_time_seconds_count") == 2
    assert delta(m0, m1, "lifecycle_request_prefill_time_seconds_sum") > 0
    # One sequence a step, three steps a request: the worker's STATS, since its start.
    assert delta(m0, m1, "lifecycle_worker_batch_size_count", worker="0") == 6
    assert delta(m0, m1, "lifecycle_worker_batch_size_bucket", worker="0", le="1.0") == 6
    assert delta(m0, m1, "lifecycle_worker_step_seconds_count", worker="0") == 6
    assert delta(m0, m1, "lifecycle_worker_step_tokens_sum", worker="0") == 6
    assert m1[("lifecycle_worker_kv_usage_ratio", W0)] == 0  # idle again
    assert delta(m0, m1, "lifecycle_retractions_total") == 0  # the scripted worker never preempts
    info = [k for k in m1 if k[0] == "lifecycle_build_info"]
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    assert len(info) == 1 and m1[info[0]] == 1
    assert dict(info[0][1]) == {"version": lifecycle.__version__, "model": model,
                                "python": platform.python_version()}  # fmt: skip
    (worker,) = [dict(k[1]) for k in m1 if k[0] == "lifecycle_worker_info"]
    assert worker["worker"] == "0" and worker["name"] == "scripted" and worker["device"] == "cpu"
    assert m1[("lifecycle_process_resident_memory_bytes", ())] > 10 * 2**20  # the frontend


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


def test_model_worker_steps_memory_kv_and_retractions(model_url: str) -> None:
    """Four prompts that outgrow the KV cache together: the retractions counted equal
    those the replies report, KV usage was high while they ran and is 0 after, every step
    is in the step histograms with its time, sequences and tokens, and the worker's RSS
    is reported (no GPU gauges on the CPU)."""
    wait_idle(model_url)
    m0 = scrape(model_url)
    new = 12
    # One batch: its four prompts reach the worker in one SUBMIT, so they run together.
    batch = {"input_ids": [[1000 + 10 * i + k for k in range(8)] for i in range(4)],
             "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}}  # fmt: skip
    peak = 0.0
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(httpx.post, model_url + "/generate", json=batch, timeout=60)
        while not future.done():
            peak = max(peak, scrape(model_url).get(("lifecycle_worker_kv_usage_ratio", W0), 0))
            time.sleep(0.02)
        replies = [r["meta_info"] for r in future.result().json()]
    assert [(r["finish_reason"]["type"], r["completion_tokens"]) for r in replies] == [
        ("length", new)
    ] * 4
    wait_idle(model_url)
    m1 = scrape(model_url)
    retracted = sum(r["num_retractions"] for r in replies)
    assert retracted > 0, "the KV cache was meant to be too small for the four together"
    assert delta(m0, m1, "lifecycle_retractions_total") == retracted
    assert delta(m0, m1, "lifecycle_finish_reasons_total", reason="length") == 4
    assert peak >= 0.5, peak  # preemption happens only when every block is taken
    assert m1[("lifecycle_worker_kv_usage_ratio", W0)] == 0
    steps = delta(m0, m1, "lifecycle_worker_step_seconds_count", worker="0")
    assert steps >= new  # at least one step per token of each request
    assert delta(m0, m1, "lifecycle_worker_batch_size_count", worker="0") == steps
    assert delta(m0, m1, "lifecycle_worker_step_seconds_sum", worker="0") > 0
    # Some steps ran several sequences together.
    assert delta(m0, m1, "lifecycle_worker_batch_size_bucket", worker="0", le="1.0") < steps
    assert delta(m0, m1, "lifecycle_worker_batch_size_sum", worker="0") >= 4 * new
    # Every prompt token and every fed-back output token is a row at least once
    # (recomputed ones after a retraction again).
    assert delta(m0, m1, "lifecycle_worker_step_tokens_sum", worker="0") >= 4 * (8 + new - 1)
    assert m1[("lifecycle_worker_memory_rss_bytes", W0)] > 50 * 2**20
    assert ("lifecycle_worker_gpu_memory_reserved_bytes", W0) not in m1  # CUDA only
    (worker,) = [dict(k[1]) for k in m1 if k[0] == "lifecycle_worker_info"]
    assert worker["device"] == "cpu" and worker["weights"] == cpu_default_weights()
