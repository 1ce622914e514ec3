"""``lifecycle.Engine``: the runtime in-process (docs/engine.md).

The real-model test runs the Engine in a fresh interpreter (tests/engine_child.py) and
holds its answers against the HTTP server's on the same model; the rest drive one Engine
on the scripted worker (a real worker process speaking the real wire, no model) from
this process: options, batches, streams, cancellation, errors, traces and metrics.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from lifecycle import Engine, EngineError

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = json.loads((ROOT / "tests" / "fixtures" / "model_reference.json").read_text())
GREEDY_16 = {"temperature": 0, "max_new_tokens": 16}
TEXT = "The capital of France is"


# -- the real model, in a fresh process, against the HTTP server ----------------------------
def test_engine_answers_as_the_http_server_does(model_server: str) -> None:
    ids = [p["ids"] for p in REFERENCE["prompts"]]
    spec = {
        "options": {"device": "cpu", "max_running": 8, "kv_cache_tokens": 8192, "weights": "fp32"},
        "max_new_tokens": 16,
        "ids": ids,
        "text": TEXT,
    }
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "engine_child.py"), json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd="/",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["torch_after_import"] is False and got["torch_after_start"] is False

    http = httpx.post(
        model_server + "/generate",
        json={"input_ids": ids, "sampling_params": GREEDY_16},
        timeout=300,
    ).json()
    assert got["batch_ids"] == [r["output_ids"] for r in http]  # token for token
    # and both are the transformers reference's greedy continuation where it is recorded
    assert got["batch_ids"][0] == REFERENCE["prompts"][0]["greedy"][:16]

    last = None
    with httpx.stream(
        "POST",
        model_server + "/generate",
        json={"text": TEXT, "sampling_params": GREEDY_16, "stream": True},
        timeout=120,
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                last = json.loads(line[6:])
    assert last is not None and got["async_stream_text"] == last["text"]

    emb = httpx.post(model_server + "/v1/embeddings", json={"input": TEXT}, timeout=60).json()
    vec = emb["data"][0]["embedding"]
    assert len(vec) == len(got["embedding"]) == 576
    assert max(abs(a - b) for a, b in zip(vec, got["embedding"], strict=True)) < 1e-5

    assert got["chunks_before_break"] == 3
    after = got["after_break"]
    assert after["live_requests"] == 0
    assert after["kv_blocks_free"] == after["kv_blocks_total"]
    assert after["failed_requests"] == {"client_gone": 1}
    assert got["broken_off_trace"] == "client_gone"


def test_import_lifecycle_loads_no_torch() -> None:
    code = (
        "import sys, lifecycle; from lifecycle import Engine, EngineError; "
        "import lifecycle.engine; print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip() == "False", done.stderr


# -- one Engine on the scripted worker --------------------------------------------------------
@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with Engine(scripted_worker=True, worker_args="--step-delay 0.005", max_queued=64) as e:
        yield e


def _idle(engine: Engine, timeout: float = 5.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        info = engine.server_info()
        w = info["internal_states"][0]
        if info["live_requests"] == 0 and w["kv_blocks_free"] == w["kv_blocks_total"]:
            return info
        assert time.monotonic() < deadline, info
        time.sleep(0.02)


def test_one_prompt_is_a_dict_a_batch_a_list_in_input_order(engine: Engine) -> None:
    one = engine.generate("hello", {"max_new_tokens": 4})
    assert one["meta_info"]["completion_tokens"] == 4 and one["text"]
    prompts = [f"prompt {i}" for i in range(40)]
    lengths = [{"max_new_tokens": 1 + i % 7} for i in range(40)]
    many = engine.generate(prompts, lengths, progress=False)
    assert [r["meta_info"]["completion_tokens"] for r in many] == [1 + i % 7 for i in range(40)]
    tok = engine.frontend.tokenizer
    assert [r["meta_info"]["prompt_tokens"] for r in many] == [len(tok.encode(p)) for p in prompts]
    ids = engine.generate(input_ids=[[5, 6, 7], [8, 9]], sampling_params={"max_new_tokens": 2})
    assert [r["meta_info"]["prompt_tokens"] for r in ids] == [3, 2]


def test_n_copies_come_in_sglangs_order(engine: Engine) -> None:
    out = engine.generate(["a", "b"], {"max_new_tokens": 2, "n": 2}, rid=["ra", "rb"])
    assert [r["meta_info"]["id"] for r in out] == ["ra_0", "rb_0", "ra_1", "rb_1"]


def test_a_batch_is_fed_at_the_workers_pace(engine: Engine) -> None:
    """More prompts than admission holds (max_queued 64): none is refused, each once."""
    out = engine.generate(["x"] * 300, {"max_new_tokens": 3}, progress=False)
    assert len(out) == 300 and len({r["meta_info"]["id"] for r in out}) == 300
    info = _idle(engine)
    assert info["admission"]["depth"] == 0


def test_streams_give_the_http_chunks_and_break_aborts(engine: Engine) -> None:
    chunks = list(engine.generate("hi", {"max_new_tokens": 6}, stream=True))
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert [c["meta_info"]["completion_tokens"] for c in chunks] == sorted(
        c["meta_info"]["completion_tokens"] for c in chunks
    )
    before = engine.server_info()["failed_requests"].get("client_gone", 0)
    for i, _chunk in enumerate(
        engine.generate("hi", {"max_new_tokens": 500, "ignore_eos": True}, stream=True)
    ):
        if i == 2:
            break
    info = _idle(engine)
    assert info["failed_requests"]["client_gone"] == before + 1
    batch = list(engine.generate(["p", "q"], {"max_new_tokens": 3}, stream=True))
    assert {c["index"] for c in batch} == {0, 1}


def test_abandoned_stream_with_a_reference_kept_ends_stalled() -> None:
    """Issue 37 item 2: a stream the caller left after one chunk, keeping the iterator,
    stayed live in ``streaming`` (its rid refused as a duplicate) until the iterator was
    garbage-collected. Protection: the producer in the Engine's loop gives up on a
    caller that takes no chunk for ``send_timeout`` (``EngineLoop._produce``) and closes
    the stream there; the request ends ``client_stalled``, its rid is free, and the kept
    iterator yields what was handed and then raises that error. Sync and async."""
    long = {"max_new_tokens": 5000, "ignore_eos": True}
    with Engine(scripted_worker=True, worker_args="--step-delay 0.005", send_timeout=1) as e:
        kept = e.generate("hi", long, stream=True, rid="kept")
        next(kept)  # then the caller goes elsewhere, keeping ``kept``
        t0 = time.monotonic()
        info = _idle(e, timeout=10)
        assert time.monotonic() - t0 < 5
        assert info["failed_requests"].get("client_stalled") == 1
        assert e.generate("hi", {"max_new_tokens": 2}, rid="kept")["meta_info"]["id"] == "kept"
        with pytest.raises(EngineError) as err:
            list(kept)
        assert err.value.cause == "client_stalled"

        async def main() -> str:
            ait = await e.async_generate("hi", long, stream=True, rid="kept-async")
            await ait.__anext__()
            t0 = time.monotonic()
            while e.server_info()["live_requests"]:  # noqa: ASYNC110 - another loop's state
                assert time.monotonic() - t0 < 5
                await asyncio.sleep(0.05)
            with pytest.raises(EngineError) as err:
                async for _ in ait:
                    pass
            return str(err.value.cause)

        assert asyncio.run(main()) == "client_stalled"
        info = _idle(e)
        assert info["failed_requests"].get("client_stalled") == 2


def test_async_generate_stream_and_cancel(engine: Engine) -> None:
    async def main() -> tuple[dict, list[dict], int]:
        one = await engine.async_generate("hi", {"max_new_tokens": 3})
        got = [
            c async for c in await engine.async_generate("hi", {"max_new_tokens": 4}, stream=True)
        ]
        before = engine.server_info()["failed_requests"].get("client_gone", 0)
        task = asyncio.create_task(
            engine.async_generate("hi", {"max_new_tokens": 5000, "ignore_eos": True})
        )
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return one, got, before

    one, got, before = asyncio.run(main())
    assert one["meta_info"]["completion_tokens"] == 3
    assert got[-1]["meta_info"]["completion_tokens"] == 4
    info = _idle(engine)
    assert info["failed_requests"]["client_gone"] == before + 1


def test_chat_renders_the_template(engine: Engine) -> None:
    out = engine.chat([{"role": "user", "content": "hi"}], {"max_new_tokens": 2})
    rendered = engine.runtime.chat.render([{"role": "user", "content": "hi"}])
    ids = engine.frontend.tokenizer.encode(rendered, add_special_tokens=False)
    assert out["meta_info"]["prompt_tokens"] == len(ids)
    two = engine.chat([[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]])
    assert len(two) == 2


def test_errors_carry_the_servers_cause_and_message(engine: Engine) -> None:
    with pytest.raises(EngineError) as bad:
        engine.generate("hi", {"temperature": -1})
    assert bad.value.cause == "invalid" and bad.value.status == 400
    assert "temperature" in bad.value.message
    ctx = engine.frontend.model_config.context_length
    with pytest.raises(EngineError) as long:
        engine.generate(input_ids=[1] * ctx, sampling_params={"max_new_tokens": 8})
    assert long.value.cause == "too_long"
    with pytest.raises(EngineError):  # one bad body: nothing of the batch runs
        engine.generate(["ok", "ok"], [{"max_new_tokens": 2}, {"top_p": 7}])
    with pytest.raises(TypeError):
        engine.generate("a", input_ids=[1])
    _idle(engine)


def test_traces_and_metrics_see_engine_requests(engine: Engine) -> None:
    out = engine.generate("hi", {"max_new_tokens": 2}, rid="traced-1")
    assert out["meta_info"]["id"] == "traced-1"
    trace = engine.trace("traced-1")
    assert trace is not None and trace["state"] == "done" and trace["tokens"] == 2
    path = [t["dst"] for t in trace["transitions"]]
    assert path[:3] == ["validated", "queued", "running"] and path[-1] == "done"
    anon = engine.generate("hi", {"max_new_tokens": 2})
    assert engine.trace(anon["meta_info"]["id"]) is not None  # found by meta_info.id
    text = engine.metrics()
    assert 'lifecycle_requests_total{model_name="' in text and ',outcome="done"} ' in text


def test_options_are_the_servers(engine: Engine) -> None:
    with pytest.raises(TypeError, match="max_runing.*max_running"):
        Engine(scripted_worker=True, max_runing=3)
    with pytest.raises(TypeError, match="HTTP server"):
        Engine(scripted_worker=True, port=1234)


def test_a_model_or_worker_that_cannot_start_fails_the_engine_fast(tmp_path: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(EngineError, match="did not load: .*missing.gguf: file not found"):
        Engine(model=str(tmp_path / "missing.gguf"))
    with pytest.raises(EngineError, match="the worker did not start") as err:
        Engine(scripted_worker=True, worker_args="--no-such-flag", restart_backoff="0.1")
    assert err.value.cause == "not_ready"
    assert time.monotonic() - t0 < 30


def test_shutdown_twice_and_no_requests_after() -> None:
    e = Engine(scripted_worker=True)
    pid = e.server_info()["internal_states"][0]["pid"]
    kept = e.generate("hi", {"max_new_tokens": 5000, "ignore_eos": True}, stream=True)
    next(kept)
    e.shutdown()
    e.shutdown()
    # Issue 37 item 11: an Engine error after shutdown, never the portal's RuntimeError.
    with pytest.raises(EngineError, match="shut down") as err:
        e.generate("hi")
    assert err.value.cause == "shutting_down"
    with pytest.raises(EngineError) as err:
        list(kept)  # a stream taken before the shutdown: its error, or the Engine's
    assert err.value.cause == "shutting_down"
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


def test_encode_gives_encode_items_in_input_order(engine: Engine) -> None:
    one = engine.encode("hello")
    assert len(one["embedding"]) == 576 and one["meta_info"]["prompt_tokens"] > 0
    assert abs(sum(x * x for x in one["embedding"]) - 1.0) < 1e-5  # L2-normalised
    texts = [f"text number {i}" for i in range(40)]  # more than one embedding call
    many = engine.encode(texts, progress=False)
    assert len(many) == 40
    assert many[7]["embedding"] == engine.encode(texts[7])["embedding"]
    raw = engine.encode(input_ids=[5, 6, 7], normalize=False, pooling="mean")
    assert abs(sum(x * x for x in raw["embedding"]) - 1.0) > 1e-3
    with pytest.raises(EngineError) as err:
        engine.encode(input_ids=[1] * engine.frontend.model_config.context_length)
    assert err.value.cause == "too_long"
    _idle(engine)
