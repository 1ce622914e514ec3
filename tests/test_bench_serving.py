"""The serving load generator: metric definitions against hand-computed values, the HTTP
and SSE parsers, and end-to-end runs against the FastAPI baseline app in a subprocess."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.apis import RequestSpec, ResponseReader, build_body
from bench.client import Target
from bench.http1 import (
    BodyChunk,
    IncompleteResponse,
    ResponseEnd,
    ResponseHead,
    ResponseParser,
    SSEDecoder,
)
from bench.metrics import RequestOutput, compute_metrics, percentile, split_itl
from bench.procs import ServerProcess
from bench.serving import LoadConfig, run_load_sync
from bench.workload import (
    GROUNDED_TASKS,
    WORDS,
    Prompt,
    WorkloadConfig,
    chat_wrapped,
    grounded_prompts,
    load_jsonl,
    make_workload,
)

ROOT = Path(__file__).resolve().parent.parent

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


# --- HTTP/1.1 and SSE parsing -----------------------------------------------------------

CHUNKED = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    b"7\r\ndata: a\r\n2\r\n\n\n\r\n0\r\n\r\n"
)


def _parse_in_pieces(raw: bytes, cuts: list[int]) -> list[object]:
    p = ResponseParser()
    events: list[object] = []
    prev = 0
    for cut in sorted(set(cuts)) + [len(raw)]:
        events += p.feed(raw[prev:cut])
        prev = cut
    return events


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, len(CHUNKED)), max_size=12))
def test_chunked_body_survives_any_split(cuts: list[int]) -> None:
    events = _parse_in_pieces(CHUNKED, cuts)
    assert isinstance(events[0], ResponseHead) and events[0].status == 200
    assert isinstance(events[-1], ResponseEnd)
    body = b"".join(e.data for e in events if isinstance(e, BodyChunk))
    assert body == b"data: a\n\n"


def test_content_length_and_keep_alive() -> None:
    p = ResponseParser()
    ev = p.feed(b"HTTP/1.1 500 Internal\r\nContent-Length: 2\r\n\r\nok")
    assert [type(e) for e in ev] == [ResponseHead, BodyChunk, ResponseEnd]
    assert p.head is not None and p.head.keep_alive and p.head.status == 500
    p = ResponseParser()
    p.feed(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
    assert p.done and p.head is not None and not p.head.keep_alive


def test_close_delimited_body_ends_at_eof() -> None:
    p = ResponseParser()
    p.feed(b"HTTP/1.0 200 OK\r\n\r\nabc")
    assert p.eof() == [ResponseEnd()]


@pytest.mark.parametrize(
    "raw",
    [
        CHUNKED[:-5],  # cut before the last chunk
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc",
        b"HTTP/1.1 200 OK\r\n",
        b"",
    ],
)
def test_truncated_response_raises(raw: bytes) -> None:
    p = ResponseParser()
    p.feed(raw)
    with pytest.raises(IncompleteResponse):
        p.eof()


def test_interim_response_is_skipped() -> None:
    ev = ResponseParser().feed(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n")
    assert isinstance(ev[0], ResponseHead) and ev[0].status == 204 and ev[-1] == ResponseEnd()


def test_sse_decoder_lf_crlf_multiline_and_comments() -> None:
    d = SSEDecoder()
    assert d.feed(b'data: {"a"') == []
    assert d.feed(b": 1}\n\n: ping\r\n\r\nevent: x\r\ndata: one\r\ndata:two\r\n\r\ndata: [DO") == [
        '{"a": 1}',
        "one\ntwo",
    ]
    assert d.pending
    assert d.feed(b"NE]\n\n") == ["[DONE]"] and not d.pending


# --- workload -------------------------------------------------------------------------


def test_workload_lengths_and_determinism(tmp_path: Path) -> None:
    cfg = WorkloadConfig(kind="text", num_requests=5, input_len=12, output_len=7)
    rows = make_workload(cfg)
    assert rows == make_workload(cfg)
    assert all(p.prompt_len == 12 and p.output_len == 7 for p in rows)
    assert all(
        len(str(p.prompt).split()) == 12 and set(str(p.prompt).split()) <= set(WORDS) for p in rows
    )
    assert len({p.prompt for p in rows}) == 5
    ranged = make_workload(
        WorkloadConfig(kind="ids", num_requests=50, input_len=20, range_ratio=0.5)
    )
    assert all(10 <= p.prompt_len <= 20 for p in ranged)
    assert all(len(p.prompt) == p.prompt_len and min(p.prompt) >= 17 for p in ranged)
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a b c"}\n\n{"prompt": [1, 2], "output_len": 3, "prompt_len": 9}\n')
    assert load_jsonl(f, 5) == [Prompt("a b c", 3, 5), Prompt((1, 2), 9, 3)]
    assert len(make_workload(WorkloadConfig(kind="jsonl", path=str(f), num_requests=5))) == 5


def test_grounded_prompts_quote_the_tree_by_seed() -> None:
    """Every task in turn, the same prompts for the same seed, other ones for another, and
    each passage quoted whole within the output length's budget."""
    cfg = WorkloadConfig(kind="grounded", num_requests=8, output_len=128, seed=3)
    rows = make_workload(cfg)
    assert rows == grounded_prompts(8, 128, 3)
    assert rows != grounded_prompts(8, 128, 4)
    assert len({p.prompt for p in rows}) == 8 and all(p.output_len == 128 for p in rows)
    openings = (
        "Rename the",
        "The paragraph",
        "Repeat the following Python",
        "Repeat the following text",
    )
    for i, p in enumerate(rows):
        text = str(p.prompt)
        assert text.startswith(openings[i % len(GROUNDED_TASKS)]), text[:60]
        passage = text.split("\n\n", 1)[1].removeprefix("```python\n").removesuffix("\n```")
        assert 0.35 * 128 * 3.0 <= len(passage) <= 0.85 * 128 * 3.0
        if text.startswith("Rename"):  # the name to change is in the function, twice or more
            old = text.split("`")[1]
            assert passage.count(old) >= 2 and "def " in passage
        if text.startswith("The paragraph"):  # the misspelling is in it, the word is not
            typo, word = text.split('"')[1], text.split('"')[3]
            assert sorted(typo) == sorted(word) and typo in passage


def test_grounded_prompts_refuse_an_output_too_short_for_any_passage() -> None:
    with pytest.raises(ValueError, match="use >= 64"):
        grounded_prompts(4, 2, 1)


def test_chat_wrapped_renders_the_models_template_and_counts_its_tokens() -> None:
    from modelfile.vocab import load_tokenizer

    rows = chat_wrapped(grounded_prompts(2, 64, 1))
    tokenizer, _, _ = load_tokenizer()
    for row, raw in zip(rows, grounded_prompts(2, 64, 1), strict=True):
        text = str(row.prompt)
        assert f"<|im_start|>user\n{raw.prompt}<|im_end|>" in text
        assert text.endswith("<|im_start|>assistant\n")
        assert row.prompt_len == len(tokenizer.encode(text, add_special_tokens=False))
    with pytest.raises(ValueError, match="text prompts"):
        chat_wrapped([Prompt((1, 2), 2, 4)])


def test_chat_wrapped_gives_chatml_to_a_model_without_a_template(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import modelfile.vocab

    tokenizer, _, config = modelfile.vocab.load_tokenizer()
    monkeypatch.setattr(modelfile.vocab, "load_tokenizer", lambda _: (tokenizer, None, config))
    [row] = chat_wrapped([Prompt("Repeat: a b", 3, 8)], "shaped.gguf")
    assert row.prompt == "<|im_start|>user\nRepeat: a b<|im_end|>\n<|im_start|>assistant\n"
    assert row.prompt_len == len(tokenizer.encode(str(row.prompt), add_special_tokens=False))


# --- end to end against the FastAPI baseline --------------------------------------------


@pytest.fixture(scope="module")
def baseline() -> Iterator[Target]:
    proc = ServerProcess.start_baseline(sys.executable, cwd=ROOT)
    try:
        yield Target("127.0.0.1", proc.port)
    finally:
        proc.stop()


def _run(target: Target, spec: RequestSpec, n: int = 6, conc: int = 3, out_len: int = 5):
    prompts = make_workload(WorkloadConfig(num_requests=n, input_len=8, output_len=out_len))
    cfg = LoadConfig(max_concurrency=conc, progress=False, request_timeout_s=20)
    return run_load_sync(target, spec, prompts, cfg)


@pytest.mark.parametrize("api", ["generate", "completions", "chat"])
@pytest.mark.parametrize("stream", [True, False])
def test_load_against_baseline(baseline: Target, api: str, stream: bool) -> None:
    res = _run(baseline, RequestSpec(api=api, stream=stream))
    m = res.metrics
    assert (m.completed, m.failed, res.not_started) == (6, 0, 0)
    assert (m.total_input, m.total_output) == (48, 30)
    assert res.connections_opened <= 4  # keep-alive: one per concurrent slot (+ warm-up)
    for o in res.outputs:
        assert o.ttft > 0 and o.latency >= o.ttft
        assert len(o.itl) == (4 if stream else 0)
    assert res.outputs[0].generated_text.startswith(" the of")


@pytest.mark.parametrize(
    ("fault", "api", "stream", "error"),
    [
        ("http_500", "generate", True, "HTTP 500"),
        ("http_500", "completions", False, "HTTP 500"),
        ("truncate", "generate", True, "without [DONE]"),
        ("truncate", "completions", True, "without [DONE]"),
        ("drop", "generate", True, "truncated response"),
    ],
)
def test_scripted_failures_are_counted(
    baseline: Target, fault: str, api: str, stream: bool, error: str
) -> None:
    spec = RequestSpec(api=api, stream=stream, extra_body={"scripted_fault": fault})
    prompts = make_workload(WorkloadConfig(num_requests=4, input_len=4, output_len=8))
    cfg = LoadConfig(max_concurrency=2, progress=False, warmup_requests=0, request_timeout_s=20)
    res = run_load_sync(baseline, spec, prompts, cfg)
    assert (res.metrics.completed, res.metrics.failed) == (0, 4)
    assert res.metrics.total_output == 0 and res.metrics.output_throughput == 0
    assert all(error in o.error for o in res.outputs), [o.error for o in res.outputs]


def test_refused_connection_is_a_failure() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again before use: nothing listens there
    cfg = LoadConfig(max_concurrency=2, progress=False, warmup_requests=0)
    prompts = make_workload(WorkloadConfig(num_requests=3, input_len=4, output_len=2))
    res = run_load_sync(Target("127.0.0.1", port), RequestSpec(), prompts, cfg)
    assert res.metrics.failed == 3 and "connection error" in res.outputs[0].error


def test_open_loop_with_time_cap_stops_issuing(baseline: Target) -> None:
    prompts = make_workload(WorkloadConfig(num_requests=200, input_len=4, output_len=2))
    cfg = LoadConfig(request_rate=40.0, time_cap_s=0.5, progress=False)
    res = run_load_sync(baseline, RequestSpec(), prompts, cfg)
    m = res.metrics
    assert m.failed == 0 and 3 <= m.completed <= 60, m.completed
    assert m.completed + res.not_started == 200
    assert m.duration_s < 3.0 and not math.isnan(m.request_throughput)


def test_cli_writes_json(baseline: Target, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    cmd = [
        sys.executable,
        "-m",
        "bench.serving",
        "--base-url",
        f"http://127.0.0.1:{baseline.port}",
        "--api",
        "completions",
        "--num-requests",
        "4",
        "--max-concurrency",
        "2",
        "--output-len",
        "3",
        "--input-len",
        "4",
        "--output-file",
        str(out),
        "--quiet",
    ]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "Serving Benchmark Result" in run.stdout and "P95 ITL (ms)" in run.stdout
    d = json.loads(out.read_text())
    assert d["completed"] == 4 and d["total_output"] == 12 and "p99_itl_ms" in d
    assert d["client_cpu_s"] >= 0


# --- the comparison harness ------------------------------------------------------------


def test_compare_alternates_and_pools_reps(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from bench.compare import compare, print_table
    from bench.contenders import Contender

    procs = [ServerProcess.start_baseline(sys.executable, cwd=ROOT) for _ in range(2)]
    try:
        contenders = [Contender(lb, p, RequestSpec()) for lb, p in zip("AB", procs, strict=True)]
        args = argparse.Namespace(
            levels=[1, 3],
            num_requests=4,
            reps=2,
            mode="frontend",
            time_cap=30.0,
            quiet=True,
            input_len=4,
            output_len=6,
            long_output_len=12,
        )
        summary = compare(contenders, args)
    finally:
        for p in procs:
            p.stop()
    order = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("==")]
    assert [ln.rsplit(" ", 1)[1] for ln in order] == list("ABAB" * 2)
    for conc in (1, 3):
        for lb in "AB":
            row = summary[conc][lb]
            assert (row["completed"], row["failed"]) == (8, 0)  # 4 requests x 2 reps, pooled
            assert len(row["rep_output_tok_s"]) == 2 and row["output_tok_s"] > 0
            assert row["server_cpu_us_per_request"] > 0
            # the second output length ran: a slope and an intercept exist (their values
            # are noise at 6 vs 12 tokens)
            assert math.isfinite(row["marginal_cpu_us_per_token"])
            assert math.isfinite(row["fixed_cpu_us_per_request"])
    print_table(summary, ["A", "B"], frontend=True)
    table = capsys.readouterr().out
    assert "A/B" in table and "CPU us/tok" in table and "c=3: A 8/0, B 8/0" in table
    assert "per streamed token (marginal)" in table


def test_stale_keep_alive_connection_is_retried_once() -> None:
    """Regression: a server may close an idle keep-alive connection between two requests
    (its idle timeout). The next request on that pooled connection sees EOF before any
    byte and must be resent on a fresh connection, not counted as failed."""
    import socket
    import threading

    body = b'{"text": " a", "meta_info": {"completion_tokens": 1}}'
    reply = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
        len(body),
        body,
    )
    listener = socket.create_server(("127.0.0.1", 0))
    served: list[int] = []

    def scripted_peer() -> None:  # answers one request per connection, then hangs up
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data or not data.endswith(b"}"):
                    data += conn.recv(65536)
                conn.sendall(reply)
                served.append(1)

    thread = threading.Thread(target=scripted_peer, daemon=True)
    thread.start()
    try:
        target = Target("127.0.0.1", listener.getsockname()[1])
        prompts = make_workload(WorkloadConfig(num_requests=3, input_len=2, output_len=1))
        cfg = LoadConfig(max_concurrency=1, progress=False, warmup_requests=0, request_timeout_s=10)
        res = run_load_sync(target, RequestSpec(stream=False), prompts, cfg)
    finally:
        listener.close()
    assert (res.metrics.completed, res.metrics.failed) == (3, 0), [o.error for o in res.outputs]
    assert len(served) == 3 and res.connections_opened == 3
