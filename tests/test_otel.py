"""OpenTelemetry export (``--otlp-traces-endpoint``): a real server (the app in this
process, the scripted worker as a process) exports one span per request to a real
OTLP/HTTP receiver on 127.0.0.1, which decodes ``ExportTraceServiceRequest`` with the
official ``opentelemetry-proto`` package. Then: an unreachable collector costs clients
nothing and logs one warning; a missing extra or a bad URL stops start-up clearly."""

from __future__ import annotations

import logging
import secrets
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import anyio
import httpx
import pytest

pytest.importorskip("opentelemetry.sdk.trace")
pytest.importorskip("opentelemetry.exporter.otlp.proto.http.trace_exporter")

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status  # noqa: E402

from lifecycle.app import App  # noqa: E402
from lifecycle.cli import main as cli_main  # noqa: E402
from lifecycle.tracing.otel import OtlpExporter, OtlpUnavailable, check_endpoint  # noqa: E402

from .app_helpers import running_app  # noqa: E402
from .scripted import free_port  # noqa: E402
from .ws_helpers import echo_body, echo_ids  # noqa: E402

pytestmark = pytest.mark.timeout(60)

STATES = ["validated", "queued", "running", "streaming", "done"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Receiver:
    """An OTLP/HTTP trace receiver: POST /v1/traces, protobuf in, spans kept."""

    def __init__(self) -> None:
        self.spans: list[tuple[dict[str, Any], Span]] = []  # (resource attributes, span)
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["content-length"]))
                ok = self.path == "/v1/traces" and (
                    self.headers["content-type"] == "application/x-protobuf"
                )
                if ok:
                    request = ExportTraceServiceRequest.FromString(body)
                    with receiver.lock:
                        for rs in request.resource_spans:
                            resource = attributes(rs.resource.attributes)
                            for ss in rs.scope_spans:
                                receiver.spans += [(resource, s) for s in ss.spans]
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if ok else 404)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"

    def by_rid(self) -> dict[str, Span]:
        with self.lock:
            return {attributes(s.attributes)["lifecycle.rid"]: s for _, s in self.spans}


@contextmanager
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    thread = threading.Thread(target=r.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield r
    finally:
        r.server.shutdown()
        r.server.server_close()


def attributes(kvs: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in kvs:
        v = kv.value
        kind = v.WhichOneof("value")
        if kind == "array_value":
            out[kv.key] = [getattr(x, x.WhichOneof("value")) for x in v.array_value.values]
        else:
            out[kv.key] = getattr(v, kind)
    return out


def exporter_of(app: App) -> OtlpExporter:
    owners = [getattr(o, "__self__", None) for o in app.frontend.events._hooks["closed"]]
    return next(o for o in owners if isinstance(o, OtlpExporter))


async def wait_for(cond: Any, timeout: float = 10.0) -> None:
    with anyio.fail_after(timeout):
        while not cond():
            await anyio.sleep(0.05)


@pytest.mark.anyio
async def test_one_span_per_request_in_the_callers_trace() -> None:
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    header = {"traceparent": f"00-{trace_id}-{parent}-01"}
    with receiver() as rx:
        async with running_app(otlp_traces_endpoint=rx.url) as app:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.port}") as c:
                bodies = [{**echo_body(i, 2 + i), "rid": f"otel-{i}"} for i in range(10)]
                replies = await _all(c, "/generate", bodies, header)
                assert [r.status_code for r in replies] == [200] * 10
                assert [r.json()["output_ids"] for r in replies] == [echo_ids(b) for b in bodies]
                bad = {"input_ids": [5] * 9000, "rid": "otel-bad"}  # longer than the context
                r = await c.post("/generate", json=bad, headers=header)
                assert r.status_code == 400
                chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                        "rid": "otel-chat", "temperature": 0.5, "top_p": 0.9}  # fmt: skip
                state = {**header, "tracestate": "vendor=abc"}  # passed on (W3C 3.3)
                r = await c.post("/v1/chat/completions", json=chat, headers=state)
                assert r.status_code == 200, r.text
                r = await c.post("/generate", json={**echo_body(1, 2), "rid": "otel-root"})
                assert r.status_code == 200
                off = {"traceparent": f"00-{trace_id}-{parent}-00"}  # the caller: not sampled
                r = await c.post("/generate", json={**echo_body(2, 2), "rid": "otel-off"}, headers=off)  # fmt: skip
                assert r.status_code == 200
                debug = (await c.get("/debug/requests/otel-3")).json()
            exporter = exporter_of(app)
            # Exported while the server runs (one batch per interval), not only at close.
            await wait_for(lambda: len(rx.by_rid()) >= 13 and exporter.unsampled == 1)
        spans = rx.by_rid()
    assert "otel-off" not in spans and len(spans) == 13 and exporter.exported == 13
    model = app.api.server_args["served_model_name"]  # the id in effect (the file's name)
    resource = rx.spans[0][0]
    assert resource["service.name"] == "lifecycle"
    for i in range(10):
        s = spans[f"otel-{i}"]
        assert s.trace_id.hex() == trace_id and s.parent_span_id.hex() == parent
        assert s.kind == Span.SPAN_KIND_SERVER and s.name == f"text_completion {model}"
        assert s.status.code == Status.STATUS_CODE_UNSET
        a = attributes(s.attributes)
        assert a["gen_ai.operation.name"] == "text_completion"
        assert a["gen_ai.request.model"] == model
        assert a["gen_ai.usage.input_tokens"] == 3 and a["gen_ai.usage.output_tokens"] == 2 + i
        assert a["gen_ai.request.max_tokens"] == 2 + i
        assert a["gen_ai.request.temperature"] == 1.0 and a["gen_ai.request.top_p"] == 1.0
        assert a["gen_ai.response.finish_reasons"] == ["length"]
        assert a["lifecycle.worker"].startswith("local pid ")
        assert a["lifecycle.cached_tokens"] == 0 and a["lifecycle.state"] == "done"
        assert "lifecycle.cause" not in a and a["url.path"] == "/generate"
        assert [e.name for e in s.events] == STATES
        admit = {"lifecycle.event": "admit", "lifecycle.detail": "AdmissionQueue"}
        assert attributes(s.events[1].attributes) == admit
    assert len({s.span_id for s in spans.values()}) == 13  # one span each
    # The span's times are the trace's own: the same gaps, to the nanosecond.
    s = spans["otel-3"]
    for event, edge in zip(s.events, debug["transitions"], strict=True):
        assert event.name == edge["dst"]
        assert event.time_unix_nano - s.start_time_unix_nano == edge["t_ns"] - debug["created_ns"]
    assert s.end_time_unix_nano == s.events[-1].time_unix_nano
    assert abs(s.start_time_unix_nano / 1e9 - debug["created"]) < 0.05
    failed = spans["otel-bad"]
    assert failed.status.code == Status.STATUS_CODE_ERROR
    assert failed.status.message.startswith("too_long: The input (9000 tokens) is longer")
    a = attributes(failed.attributes)
    assert a["lifecycle.cause"] == "too_long" and a["error.type"] == "too_long"
    assert a["lifecycle.state"] == "error" and "lifecycle.worker" not in a  # never dispatched
    assert failed.events[-1].name == "error"
    fail = attributes(failed.events[-1].attributes)
    assert fail["lifecycle.event"] == "fail" and fail["lifecycle.detail"] == "too_long"
    assert fail["lifecycle.message"].startswith("The input (9000 tokens)")
    chat_span = spans["otel-chat"]
    a = attributes(chat_span.attributes)
    assert chat_span.name == f"chat {model}" and a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.temperature"] == 0.5 and a["gen_ai.request.top_p"] == 0.9
    assert chat_span.trace_id.hex() == trace_id and chat_span.trace_state == "vendor=abc"
    root = spans["otel-root"]  # no traceparent: a trace of its own
    assert root.trace_id.hex() != trace_id and root.parent_span_id == b""


async def _all(c: httpx.AsyncClient, path: str, bodies: list[dict[str, Any]], headers: dict[str, str]) -> list[httpx.Response]:  # fmt: skip
    replies: list[httpx.Response | None] = [None] * len(bodies)

    async def one(i: int) -> None:
        replies[i] = await c.post(path, json=bodies[i], headers=headers)

    async with anyio.create_task_group() as tg:
        for i in range(len(bodies)):
            tg.start_soon(one, i)
    return [r for r in replies if r is not None]


@pytest.mark.anyio
async def test_unreachable_collector_costs_clients_nothing_and_warns_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    url = f"http://127.0.0.1:{free_port()}/v1/traces"  # nothing listens there
    header = {"traceparent": f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"}
    async with running_app(otlp_traces_endpoint=url) as app:
        exporter = exporter_of(app)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.port}") as c:
            bodies = [echo_body(i, 3) for i in range(20)]
            replies = await _all(c, "/generate", bodies, header)
            assert [r.json()["output_ids"] for r in replies] == [echo_ids(b) for b in bodies]
            await wait_for(lambda: exporter.failing, timeout=5)
            replies = await _all(c, "/generate", bodies[:10], header)
            assert [r.status_code for r in replies] == [200] * 10
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 4.5  # close waits neither close_timeout (5 s) nor retries
    assert exporter.exported == 0 and exporter.dropped == 30
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert warnings[0].name == "lifecycle.tracing.otel" and url in warnings[0].getMessage()
    assert not [r for r in caplog.records if r.name.startswith("opentelemetry")]


def test_start_up_refuses_a_bad_url_or_a_missing_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert check_endpoint("http://collector:4318") == "http://collector:4318/v1/traces"
    assert check_endpoint("https://c/otlp/v1/traces") == "https://c/otlp/v1/traces"
    serve = ["serve", "--scripted-worker", "--port", "0", "--otlp-traces-endpoint"]
    assert cli_main([*serve, "collector:4318"]) == 2  # no scheme: refused before serving
    assert "expected an OTLP/HTTP URL" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # the extra is absent
    with pytest.raises(OtlpUnavailable, match=r"pip install 'lifecycle\[otel\]'"):
        check_endpoint("http://127.0.0.1:4318/v1/traces")
    assert cli_main([*serve, "http://127.0.0.1:4318/v1/traces"]) == 2
    err = capsys.readouterr().err
    assert "--otlp-traces-endpoint needs" in err and "lifecycle[otel]" in err


def test_the_engine_exports_too() -> None:
    from lifecycle.engine import Engine

    with receiver() as rx:
        with Engine(scripted_worker=True, otlp_traces_endpoint=rx.url.removesuffix("/v1/traces")) as e:  # fmt: skip
            out = e.generate(input_ids=[[5, 6, 7], [8, 9]], sampling_params={"max_new_tokens": 2},
                             rid=["engine-0", "engine-1"], progress=False)  # fmt: skip
            assert [o["output_ids"] for o in out] == [[5, 6], [8, 9]]
        spans = rx.by_rid()  # shutdown flushed the queue
    assert set(spans) == {"engine-0", "engine-1"}
    for rid, n_prompt in (("engine-0", 3), ("engine-1", 2)):
        s = spans[rid]
        a = attributes(s.attributes)
        assert a["gen_ai.usage.input_tokens"] == n_prompt and a["gen_ai.usage.output_tokens"] == 2
        assert "url.path" not in a and s.parent_span_id == b""  # no HTTP request: a new trace
        assert [e.name for e in s.events] == STATES
