"""Seen and counted (issue 55, point 4): with several models in one server, each
request's trace names its model, ``/debug`` finds every model's requests, ``/metrics``
is one valid exposition with each model's series labelled ``model_name``, and
``/server_info`` and ``/get_load`` list every model's workers. First, the state
machine's observers: each model's frontend feed hears of its own records only."""

from __future__ import annotations

import json
import pathlib
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import pytest
from prometheus_client.parser import text_string_to_metric_families

from lifecycle.core.frontend import Frontend
from lifecycle.core.fsm import RequestRecord, new_request
from lifecycle.core.states import State
from lifecycle.tracing.tracer import TraceConfig, Tracer
from tests.scripted import ROOT, lifecycle_server
from tests.test_fsm import PATH_TO, drive
from tests.tiny_gguf import TinySpec, write_tiny_gguf

VALIDATOR = jsonschema.Draft202012Validator(
    json.loads((ROOT / "specs" / "trace.schema.json").read_text())
)
MODELS = ("alpha", "second")  # the served ids: alpha.gguf's, and beta.gguf named second
_SERVE = ("--device", "cpu", "--max-running", "1", "--kv-cache-tokens", "1024")
_SENT = 2  # finished requests per model
_LIVE = 3  # long requests per model, to be seen live (one runs at a time: --max-running 1)
# The process's own families: no model_name, once.
_PROCESS = ("lifecycle_process_", "lifecycle_unknown_fields", "lifecycle_tracer_",
            "lifecycle_trace_log_")  # fmt: skip


# -- the state machine's observers ------------------------------------------------------------
class _Workers:
    members: list[Any] = []


def _frontend() -> Frontend[Any]:
    return Frontend(_Workers(), None, None)  # type: ignore[arg-type]


def _finish(fe: Frontend[Any], rid: str) -> RequestRecord:
    """One record filed by ``fe``'s registry (as ``Frontend.opened`` does), driven to done."""
    rec = new_request(rid)
    fe.registry.add(rec)
    drive(rec, PATH_TO[State.DONE])
    return rec


def test_each_frontends_tracer_sees_its_own_records_only() -> None:
    """Regression: each frontend's feed took the state machine's one process-wide
    observer slot, so the second model's tracer saw every model's records and the
    first's none. Each feed now hears of the records its registry filed."""
    fes = [_frontend(), _frontend()]
    tracers = [
        Tracer(TraceConfig(), registry=fe.registry, model=m)
        for fe, m in zip(fes, MODELS, strict=True)
    ]
    for fe, tracer in zip(fes, tracers, strict=True):
        fe.events.subscribe(tracer)
    try:
        recs = [
            [_finish(fe, f"{m}-{i}") for i in range(3)] for fe, m in zip(fes, MODELS, strict=True)
        ]
        for tracer, mine, m in zip(tracers, recs, MODELS, strict=True):
            traces = tracer.finished_traces()
            assert sorted(t["id"] for t in traces) == sorted(r.id for r in mine)
            assert {t["model"] for t in traces} == {m}
    finally:
        for fe in fes:
            fe.events.close()
    after = _finish(fes[0], "after-close")  # a closed feed tells nothing more
    assert all(t.ring.get(after.id) is None for t in tracers)


def test_one_tracer_watches_several_models() -> None:
    """The server's one tracer (``Tracer.watch``): one ring for every model, each trace
    and each live entry naming its model, a lookup finding any model's request, the
    counts summed."""
    fes = [_frontend(), _frontend()]
    tracer = Tracer(TraceConfig())
    for fe, m in zip(fes, MODELS, strict=True):
        fe.events.subscribe(tracer.watch(m, fe.registry))
    try:
        done = [_finish(fe, f"done-{m}") for fe, m in zip(fes, MODELS, strict=True)]
        live = []
        for fe, m in zip(fes, MODELS, strict=True):
            rec = new_request(f"live-{m}")
            fe.registry.add(rec)
            drive(rec, PATH_TO[State.QUEUED])
            live.append(rec)
        for rec, m in zip(done + live, MODELS * 2, strict=True):
            trace = tracer.lookup(rec.client_rid or "")
            assert trace is not None and trace["id"] == rec.id and trace["model"] == m
        assert {(e["rid"], e["model"]) for e in tracer.live()} == {
            (f"{state}-{m}", m) for state in ("done", "live") for m in MODELS
        }  # a terminal record stays live until its call closes
        assert tracer.counts()["queued"] == 2 and tracer.counts()["done"] == 2
        for trace in tracer.finished_traces():
            VALIDATOR.validate(trace)
    finally:
        for fe in fes:
            fe.events.close()


# -- a server with two models -------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, pathlib.Path]]:
    """Two tiny models in one server (beta served as ``second``), with a trace log; its
    base URL and the log's path."""
    folder = tmp_path_factory.mktemp("observed")
    a, b = folder / "alpha.gguf", folder / "beta.gguf"
    write_tiny_gguf(a, TinySpec(seed=0))
    write_tiny_gguf(b, TinySpec(seed=1))
    log = folder / "traces.jsonl"
    args = ("--model", str(a), "--model", f"second={b}", "--trace-log", str(log), *_SERVE)
    with lifecycle_server(*args) as base:
        yield base, log


def _generate(base: str, model: str, request_id: str, tokens: int) -> int:
    body = {"model": model, "text": "hello world",
            "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}}  # fmt: skip
    r = httpx.post(f"{base}/generate", json=body, headers={"X-Request-Id": request_id},
                   timeout=60)  # fmt: skip
    return r.status_code


@pytest.fixture(scope="module")
def served(server: tuple[str, pathlib.Path]) -> dict[str, Any]:
    """``_SENT`` short requests per model, then ``_LIVE`` long ones per model at once,
    while ``/debug/requests`` is read until it listed some of each model live: what the
    live lists said, by request id."""
    base, _ = server
    for m in MODELS:
        for i in range(_SENT):
            assert _generate(base, m, f"done-{m}-{i}", 4) == 200
    seen: dict[str, str] = {}
    with ThreadPoolExecutor(2 * _LIVE) as pool:
        running = [
            pool.submit(_generate, base, m, f"live-{m}-{i}", 200)
            for i in range(_LIVE)
            for m in MODELS
        ]
        while not all(f.done() for f in running):
            listed = httpx.get(f"{base}/debug/requests", timeout=10).json()
            seen.update({e["request_id"]: e["model"] for e in listed["requests"]})
            time.sleep(0.01)
        assert [f.result() for f in running] == [200] * len(running)
    return {"live": seen, "counts": httpx.get(f"{base}/debug/requests", timeout=10).json()}


def test_traces_name_their_model(server: tuple[str, pathlib.Path], served: dict[str, Any]) -> None:
    base, log = server
    for m in MODELS:  # each model's requests listed live, each with its model
        live = {rid: model for rid, model in served["live"].items() if rid.startswith("live-")}
        assert any(rid.startswith(f"live-{m}-") for rid in live), served["live"]
        assert all(model == rid.split("-")[1] for rid, model in live.items()), live
    counts = served["counts"]["counts"]
    assert counts["done"] >= len(MODELS) * (_SENT + _LIVE)  # every model's books
    ids = [f"{kind}-{m}-{i}" for m in MODELS for kind, n in (("done", _SENT), ("live", _LIVE))
           for i in range(n)]  # fmt: skip
    for rid in ids:  # found by /debug/requests/{key} whichever model served it
        trace = httpx.get(f"{base}/debug/requests/{rid}", timeout=10).json()
        VALIDATOR.validate(trace)
        assert trace["model"] == rid.split("-")[1] and trace["model_wait_ms"] is None, trace
        assert trace["state"] == "done" and trace["tokens"] == (4 if rid[0] == "d" else 200)
    listed = httpx.get(f"{base}/debug/traces", timeout=10).json()["traces"]
    assert {t["request_id"]: t["model"] for t in listed if t["request_id"] in ids} == {
        rid: rid.split("-")[1] for rid in ids
    }
    deadline = time.monotonic() + 10  # the log is flushed each feed tick
    while True:
        lines = [json.loads(line) for line in log.read_text().splitlines()]
        logged = {t["request_id"]: t["model"] for t in lines if t["request_id"] in ids}
        if len(logged) == len(ids) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert logged == {rid: rid.split("-")[1] for rid in ids}  # one log, every model's
    for trace in lines:
        VALIDATOR.validate(trace)


def test_metrics_are_one_exposition_labelled_by_model(
    server: tuple[str, pathlib.Path], served: dict[str, Any]
) -> None:
    base, _ = server
    text = httpx.get(f"{base}/metrics", timeout=10).text
    types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    helps = [line.split()[2] for line in text.splitlines() if line.startswith("# HELP ")]
    assert len(types) == len(set(types)) and sorted(types) == sorted(helps)  # once each
    samples: dict[tuple[str, str | None], float] = {}
    for family in text_string_to_metric_families(text):  # valid Prometheus text
        process = family.name.startswith(_PROCESS)
        for s in family.samples:
            model = s.labels.get("model_name")
            assert (model is None) if process else (model in MODELS), s
            if family.name == "lifecycle_requests" and s.labels.get("outcome") == "done":
                samples[(s.name, model)] = s.value
            if family.name in ("lifecycle_build_info", "lifecycle_worker_ready"):
                samples[(family.name, model)] = s.value
            if family.name == "lifecycle_build_info":
                assert s.labels["model"] == model  # its own label, kept
    for m in MODELS:
        assert samples[("lifecycle_requests_total", m)] >= _SENT + _LIVE
        assert samples[("lifecycle_build_info", m)] == 1.0
        assert samples[("lifecycle_worker_ready", m)] == 1.0
    rss = [line for line in text.splitlines()
           if line.startswith("lifecycle_process_resident_memory_bytes ")]  # fmt: skip
    assert len(rss) == 1  # the process's series once, not per model


def test_server_info_and_load_list_every_models_workers(
    server: tuple[str, pathlib.Path],
) -> None:
    base, _ = server
    info = httpx.get(f"{base}/server_info", timeout=10).json()
    assert info["served_model_name"] == "alpha" and info["internal_states"]  # the first's
    assert [m["model"] for m in info["models"]] == list(MODELS)
    for entry in info["models"]:
        assert entry["state"] == "loaded" and entry["model_path"].endswith(".gguf")
        assert len(entry["workers"]) == 1 and entry["workers"][0]["status"] == "ready"
    pids = {entry["workers"][0]["pid"] for entry in info["models"]}
    assert len(pids) == 2  # a worker of each
    assert info["models"][0]["workers"][0]["pid"] == info["internal_states"][0]["pid"]
    load = httpx.get(f"{base}/get_load", timeout=10).json()
    assert [(e["model"], e["dp_rank"]) for e in load] == [(m, 0) for m in MODELS]


def test_a_request_that_waited_for_its_model_says_how_long(tmp_path: pathlib.Path) -> None:
    """``--models-max 1``: the second model starts unloaded (``/server_info`` passes its
    supervisor's status through), and a request for it waits, admitted, for its load:
    its trace's ``model_wait_ms``."""
    a, b = tmp_path / "alpha.gguf", tmp_path / "beta.gguf"
    write_tiny_gguf(a, TinySpec(seed=0))
    write_tiny_gguf(b, TinySpec(seed=1))
    args = ("--model", str(a), "--model", f"second={b}", "--models-max", "1", *_SERVE)
    with lifecycle_server(*args) as base:
        info = httpx.get(f"{base}/server_info", timeout=10).json()
        assert [(m["model"], m["state"]) for m in info["models"]] == [
            ("alpha", "loaded"),
            ("second", "unloaded"),
        ]
        assert _generate(base, "alpha", "at-once", 4) == 200
        assert _generate(base, "second", "waited", 4) == 200
        at_once, waited = (
            httpx.get(f"{base}/debug/requests/{rid}", timeout=10).json()
            for rid in ("at-once", "waited")
        )
        for trace in (at_once, waited):
            VALIDATOR.validate(trace)
        assert at_once["model"] == "alpha" and at_once["model_wait_ms"] is None
        assert waited["model"] == "second" and waited["model_wait_ms"] > 0
        assert waited["total_ms"] >= waited["model_wait_ms"]
