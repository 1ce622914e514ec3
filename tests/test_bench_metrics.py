"""The serving load generator's figures: the metric definitions (percentiles, an
inter-token gap shared between the tokens it brought, a run's aggregates) against
hand-computed values, and each API's request body and streamed response, read into one
request's figures (TTFT, inter-token latencies, output length) or its failure."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.apis import RequestSpec, ResponseReader, build_body
from bench.metrics import RequestOutput, compute_metrics, percentile, split_itl

# --- metrics ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([], 50, 0.0),
        ([7.0], 99, 7.0),
        ([1.0, 2.0, 3.0, 4.0], 50, 2.5),
        ([1.0, 2.0, 3.0, 4.0], 99, 3.97),  # rank 2.97: 3 + 0.97 * (4 - 3)
        ([10.0, 0.0, 5.0], 95, 9.5),  # sorted 0 5 10, rank 1.9
        ([3.0, 1.0, 2.0], 0, 1.0),
        ([3.0, 1.0, 2.0], 100, 3.0),
    ],
)
def test_percentile_hand_values(values: list[float], q: float, expected: float) -> None:
    assert percentile(values, q) == pytest.approx(expected)


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50), st.floats(0, 100))
def test_percentile_matches_numpy_linear(values: list[float], q: float) -> None:
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), abs=1e-6)


def test_split_itl_shares_the_gap_equally() -> None:
    assert split_itl(0.3, 3) == pytest.approx([0.1, 0.1, 0.1])
    assert split_itl(0.3, 0) == []


def test_compute_metrics_hand_computed() -> None:
    a = RequestOutput(
        prompt_len=10, success=True, latency=1.0, ttft=0.2, itl=[0.4, 0.4], output_len=3
    )
    b = RequestOutput(
        prompt_len=20, success=True, latency=2.0, ttft=0.5, itl=[0.5, 0.5, 0.5], output_len=4
    )
    c = RequestOutput(prompt_len=99, success=False, latency=0.1, ttft=0.0, output_len=7, error="x")
    m = compute_metrics([a, b, c], duration_s=4.0)
    assert (m.completed, m.failed) == (2, 1)
    assert (m.total_input, m.total_output) == (30, 7)  # the failed request counts nothing
    assert m.request_throughput == pytest.approx(0.5)
    assert m.input_throughput == pytest.approx(7.5)
    assert m.output_throughput == pytest.approx(1.75)
    assert m.total_throughput == pytest.approx(9.25)
    assert m.concurrency == pytest.approx(0.75)  # (1.0 + 2.0) / 4.0
    assert m.ttft_ms.mean == pytest.approx(350.0)
    assert m.ttft_ms.median == pytest.approx(350.0)
    assert m.ttft_ms.p99 == pytest.approx(200 + 0.99 * 300)
    # TPOT: (1.0 - 0.2) / 2 = 0.4 and (2.0 - 0.5) / 3 = 0.5
    assert m.tpot_ms.mean == pytest.approx(450.0)
    assert m.itl_ms.mean == pytest.approx(460.0)  # (0.4*2 + 0.5*3) / 5
    assert m.itl_ms.median == pytest.approx(500.0)
    assert m.itl_ms.max == pytest.approx(500.0)
    assert m.itl_ms.p95 == pytest.approx(500.0)
    assert m.e2e_latency_ms.median == pytest.approx(1500.0)
    assert m.e2e_latency_ms.std == pytest.approx(500.0)
    d = m.to_dict()
    assert d["median_ttft_ms"] == pytest.approx(350.0) and d["p95_itl_ms"] == pytest.approx(500.0)


def test_compute_metrics_all_failed_reads_zero() -> None:
    m = compute_metrics([RequestOutput(prompt_len=5, error="boom")], duration_s=1.0)
    assert (m.completed, m.failed, m.total_output) == (0, 1, 0)
    assert m.ttft_ms.mean == 0.0 and m.itl_ms.max == 0.0


def test_tpot_skips_single_token_outputs() -> None:
    one = RequestOutput(prompt_len=1, success=True, latency=0.5, ttft=0.5, output_len=1)
    assert compute_metrics([one], 1.0).tpot_ms.mean == 0.0


# --- reading responses ----------------------------------------------------------------


def _gen(text: str, tokens: int, finish: object = None) -> str:
    return json.dumps(
        {"text": text, "meta_info": {"completion_tokens": tokens, "finish_reason": finish}}
    )


def test_generate_stream_splits_itl_by_completion_token_deltas() -> None:
    r = ResponseReader(RequestSpec(api="generate"), prompt_len=8, start=10.0)
    r.on_event(_gen("", 0), 10.05)  # no text yet: not the first token
    r.on_event(_gen(" a", 1), 10.1)  # first token: TTFT 0.1
    r.on_event(_gen(" a b c", 3), 10.4)  # 2 new tokens over 0.3 s: 0.15 each
    r.on_event(_gen(" a b c", 3), 10.5)  # no new token: skipped, clock not moved
    r.on_event(_gen(" a b c d", 4, {"type": "length", "length": 4}), 10.6)  # 1 over 0.2 s
    r.on_event("[DONE]", 10.7)
    out = r.finish_stream()
    assert out.success and out.output_len == 4
    assert out.ttft == pytest.approx(0.1)
    assert out.itl == pytest.approx([0.15, 0.15, 0.2])
    assert out.latency == pytest.approx(0.7)
    assert out.generated_text == " a b c d"


def test_openai_stream_counts_text_chunks_and_takes_final_usage() -> None:
    r = ResponseReader(RequestSpec(api="completions"), prompt_len=8, start=0.0)
    for i, t in enumerate((0.2, 0.3, 0.5)):
        r.on_event(json.dumps({"choices": [{"text": f" w{i}"}]}), t)
    r.on_event(json.dumps({"choices": [], "usage": {"completion_tokens": 3}}), 0.55)
    r.on_event("[DONE]", 0.6)
    out = r.finish_stream()
    assert out.success and out.output_len == 3 and out.ttft == pytest.approx(0.2)
    assert out.itl == pytest.approx([0.1, 0.2])
    assert out.generated_text == " w0 w1 w2"


def test_chat_stream_reads_delta_content() -> None:
    r = ResponseReader(RequestSpec(api="chat"), prompt_len=1, start=0.0)
    r.on_event(json.dumps({"choices": [{"delta": {"role": "assistant"}}]}), 0.1)
    r.on_event(json.dumps({"choices": [{"delta": {"content": "hi"}}]}), 0.2)
    r.on_event("[DONE]", 0.3)
    out = r.finish_stream()
    assert out.success and out.output_len == 1 and out.ttft == pytest.approx(0.2)


@pytest.mark.parametrize(
    ("events", "error"),
    [
        ([_gen(" a", 1)], "without [DONE]"),
        (
            [_gen(" a", 1), json.dumps({"error": {"message": "worker lost"}}), "[DONE]"],
            "worker lost",
        ),
        ([_gen(" a", 1, {"type": "abort", "message": "deadline"}), "[DONE]"], "aborted: deadline"),
        (["not json", "[DONE]"], "bad JSON"),
    ],
)
def test_stream_failures_are_failures(events: list[str], error: str) -> None:
    r = ResponseReader(RequestSpec(api="generate"), prompt_len=1, start=0.0)
    for i, e in enumerate(events):
        r.on_event(e, 0.1 * (i + 1))
    out = r.finish_stream()
    assert not out.success and error in out.error


def test_request_bodies() -> None:
    gen = json.loads(build_body(RequestSpec(api="generate"), (5, 6), 16))
    assert gen == {
        "input_ids": [5, 6],
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True},
        "stream": True,
    }
    spec = RequestSpec(
        api="completions", ignore_eos="logit_bias", extra_body={"repeat_penalty": 1.0}
    )
    comp = json.loads(build_body(spec, "hi", 64))
    assert comp["logit_bias"] == {"0": -100, "2": -100, "4": -100} and "ignore_eos" not in comp
    assert comp["max_tokens"] == 64 and comp["repeat_penalty"] == 1.0 and comp["prompt"] == "hi"
    chat = json.loads(build_body(RequestSpec(api="chat", ignore_eos="off", stream=False), "hi", 4))
    assert chat["messages"] == [{"role": "user", "content": "hi"}] and "ignore_eos" not in chat
    with pytest.raises(ValueError):
        build_body(RequestSpec(api="chat"), (1, 2), 4)
