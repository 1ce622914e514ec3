"""Wiring: router + HTTP server + supervised worker + frontend, in one task group.

The model file is checked first (``modelfile.check``: a file the worker cannot run is
one ``ModelFileError`` before anything listens or spawns). The listener then binds early; ``/health`` answers 503 and generation requests get 503 until
the worker said HELLO and one warm-up generation came back (``Supervisor``).
``App.drain`` is the graceful stop (SIGTERM/SIGINT; ``DRAIN`` in ``lifecycle.core.states``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc

from lifecycle.api.access_log import AccessLog
from lifecycle.api.anthropic import AnthropicAPI
from lifecycle.api.auth import Auth, AuthConfig
from lifecycle.api.calls import error_response
from lifecycle.api.cors import cors
from lifecycle.api.embeddings import EmbeddingsAPI
from lifecycle.api.metrics import install_metrics
from lifecycle.api.native import NativeAPI
from lifecycle.api.openai import OpenAIAPI
from lifecycle.api.responses import ResponsesAPI
from lifecycle.api.routes import AppRouter
from lifecycle.api.score import ScoreAPI
from lifecycle.api.websocket import WebSocketAPI
from lifecycle.core.frontend import Frontend
from lifecycle.core.states import DRAIN
from lifecycle.extend import Extension, resolve_extension
from lifecycle.link.pool import WorkerPool
from lifecycle.link.supervisor import Supervisor, WorkerRefusedToStart
from lifecycle.runtime import AppConfig, Runtime, model_id, server_args, worker_args
from lifecycle.tracing.debug import install_debug
from lifecycle.tracing.metrics import Metrics
from lifecycle.tracing.replay import replay_in_process
from lifecycle.tracing.shared_metrics import PUBLISH_INTERVAL, SharedMetrics
from lifecycle.tracing.tracer import Tracer
from transport import Handler, Request, Response, Server, ServerConfig

if TYPE_CHECKING:
    from modelfile.check import CheckedModel

__all__ = ["App", "AppConfig", "CannotListen", "serve_app", "worker_args"]

log = logging.getLogger("lifecycle.app")


_STOP_GRACE = 0.5  # second signal: seconds for the cut requests' owners, then the sockets
_CUT_GRACE = 2.0  # seconds of the drain kept for cut requests to send their error


@dataclass(slots=True)
class App:
    config: AppConfig
    server: Server
    supervisor: Supervisor | WorkerPool
    frontend: Frontend
    api: NativeAPI
    metrics: Metrics
    auth: Auth = field(default_factory=Auth)  # every route is already checked by AppRouter
    tracer: Tracer | None = None

    @property
    def port(self) -> int:
        return _port(self.server)

    async def drain(self) -> int:
        """The graceful stop, within ``drain_timeout``: /health and new requests get 503
        at once, in-flight requests run on, those still open near the deadline end with
        an explicit error (an SSE error event then [DONE], a WebSocket error, a 503),
        then the listener closes; one line then says how many finished and how many were
        cut. Returns how many requests were cut."""
        fe, timeout = self.frontend, self.config.drain_timeout
        # Kept for the cut requests' owners to send their error, even at --drain-timeout 0
        grace = max(min(_CUT_GRACE, timeout / 5), _STOP_GRACE)
        start = anyio.current_time()
        fe.begin_drain()
        self.server.begin_drain(retry_after=DRAIN.refused.retry_after)
        live = len(fe.calls)  # none is admitted from here on: each finishes or is cut
        log.info("draining: %d live calls, up to %.1fs", live, timeout)
        cut = 0
        if not await fe.calls.wait_drained(timeout - grace):
            cut = fe.calls.cut_all(DRAIN.cut, "the server is shutting down")
            log.warning("drain timeout: %d requests ended with an error", cut)
            await fe.calls.wait_drained(grace / 2)
        await self.server.shutdown(grace / 2)
        took = anyio.current_time() - start
        log.info("stopped: %d finished, %d cut in %.1fs", max(live - cut, 0), cut, took)
        return cut

    async def stop_now(self) -> int:
        """The second signal: end every live call at once with ``DRAIN.cut``
        (shutting_down, never internal), give their owners a moment to send that error,
        then close the listener. Returns how many requests were cut."""
        calls = self.frontend.calls
        cut = calls.cut_all(DRAIN.cut, "the server is shutting down")
        await calls.wait_drained(_STOP_GRACE)
        await self.server.shutdown(_STOP_GRACE)
        return cut


class CannotListen(OSError):
    """The HTTP listener could not bind (one line for ``lifecycle serve``)."""


async def serve_app(
    cfg: AppConfig,
    *,
    model: CheckedModel | None = None,
    task_status: anyio.abc.TaskStatus[App] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Run everything until cancelled; ``task_status.started(App)`` once listening.
    ``model``: the model file already checked; otherwise it is checked here, before the
    listener binds and the worker starts (``ModelFileError``)."""
    rt = Runtime(cfg, model)
    await rt.check_model()
    handler: list[Handler] = [_starting]  # swapped for the router once the tokenizer is in
    server = Server(lambda request: handler[0](request), _server_config(cfg))
    async with rt.running() as tg:
        # A spawned worker listens once it took its options and its device, before its
        # model loads; one that refuses them ends this here (WorkerRefusedToStart), so
        # the port is never bound. Then bind early: /health says 503 until ready.
        await rt.supervisor.wait_listening()
        try:
            await tg.start(server.serve)
        except OSError as exc:  # the port was taken since serve checked it
            raise CannotListen(
                f"cannot listen on {cfg.host}:{cfg.port}: {exc.strerror or exc}"
            ) from exc
        tg.start_soon(_fail_unless_started, rt.supervisor)
        scheme = "https" if cfg.ssl_certfile else "http"
        log.info("listening on %s://%s:%s", scheme, cfg.host, _port(server))
        frontend = await rt.load(tg)
        assert rt.metrics is not None
        access = _access_log(cfg, frontend)
        try:
            shared = _shared_metrics(cfg)
            router, api, auth = _routes(cfg, frontend, rt.metrics, shared, rt.chat, rt.model_path)
            router.access_log = access
            for spec in cfg.extend:  # checked by serve before it listened
                resolve_extension(spec)(Extension(router, api, frontend, cfg))
            # The router (AppRouter) already asks /debug/* for an admin key when keys are set.
            if rt.tracer is not None:
                served_id = rt.served_model_id()

                async def replay(trace: dict[str, Any]) -> dict[str, Any]:
                    return await replay_in_process(frontend, trace, served_id)

                install_debug(router, rt.tracer, enabled=cfg.debug_routes, replay=replay)
            handler[0] = cors(router, cfg.cors_allow_origins)  # itself without origins
            url = f"{scheme}://{cfg.host}:{_port(server)}"
            tg.start_soon(_announce_ready, url, rt.served_model_id(), rt.supervisor, cfg)
            tg.start_soon(_report_load, frontend)
            if shared is not None:
                tg.start_soon(_publish_metrics, shared, rt.metrics)
            task_status.started(
                App(cfg, server, rt.supervisor, frontend, api, rt.metrics, auth, rt.tracer)
            )
            await anyio.sleep_forever()
        finally:
            if access is not None:
                access.close()


async def _fail_unless_started(sup: Supervisor | WorkerPool) -> None:
    """A worker that gives up before it was ever ready (it refused what it was given
    once it listened, or failed at start-up twice the same way) ends the server with
    that error (``lifecycle serve``: one line, exit 2), not a live process that is never
    ready. Once ready, later failures are restarted as ever."""
    while not sup.ready:
        if all(m.status == "failed" for m in sup.members):
            raise WorkerRefusedToStart(sup.last_error or "the worker did not start")
        await anyio.sleep(0.1)


async def _announce_ready(url: str, model: str, sup: Any, cfg: AppConfig) -> None:
    """One line once the server serves (``/health`` 200): where, what, how much."""
    client = await sup.wait_ready()
    cap, card = client.capacity, client.model
    kv = int(cap.get("kv_blocks", 0)) * int(cap.get("block_size", 0))
    workers = len(sup.members)
    where = f"{url}/debug and {url}/metrics" if cfg.debug_routes else f"{url}/metrics"
    log.info(
        "ready: %s serves %s (context %s tokens, KV cache %d tokens, %s running at most%s); "
        "see %s",
        url, model, card.get("context_length"), kv, cap.get("max_running"),
        f", per worker of {workers}" if workers > 1 else "", where,
    )  # fmt: skip


LOAD_REPORT_S = 10.0  # a throughput line this often while requests are served


async def _report_load(frontend: Frontend) -> None:
    """Every ``LOAD_REPORT_S`` while busy: live requests, those that ended in the window,
    and the output tokens that reached the frontend in it (``Frontend.output_tokens``,
    counted as they arrive: a long generation shows its rate while it runs)."""
    fe = frontend
    done, tokens = fe.registry.finished + sum(fe.registry.failed.values()), fe.output_tokens
    while True:
        await anyio.sleep(LOAD_REPORT_S)
        now_done, now_tokens = (
            fe.registry.finished + sum(fe.registry.failed.values()),
            fe.output_tokens,
        )
        live = len(fe.calls)
        if live or now_done != done:
            log.info(
                "serving: %d live, %d ended in %.0f s (%d with an error so far), "
                "%.1f output tokens/s",
                live, now_done - done, LOAD_REPORT_S, sum(fe.registry.failed.values()),
                (now_tokens - tokens) / LOAD_REPORT_S,
            )  # fmt: skip
        done, tokens = now_done, now_tokens


def _access_log(cfg: AppConfig, frontend: Frontend) -> AccessLog | None:
    if not cfg.access_log:
        return None
    where = "stderr" if cfg.access_log == "-" else cfg.access_log
    log.info("access log (%s) to %s", cfg.access_log_format, where)
    return AccessLog(frontend, cfg.access_log, cfg.access_log_format, cfg.log_requests)


def _server_config(cfg: AppConfig) -> ServerConfig:
    return ServerConfig(
        host=cfg.host,
        port=cfg.port,
        reuse_port=cfg.reuse_port,
        send_timeout=cfg.send_timeout,
        ssl_certfile=cfg.ssl_certfile,
        ssl_keyfile=cfg.ssl_keyfile,
    )


def _routes(
    cfg: AppConfig,
    frontend: Frontend,
    metrics: Metrics,
    shared: SharedMetrics | None,
    chat: Any,
    path: str,
) -> tuple[AppRouter, NativeAPI, Auth]:
    """Every API on one router: native, OpenAI, WebSocket, metrics (the debug routes are
    the tracer's)."""
    api = NativeAPI(frontend, server_args(cfg, path))
    auth = Auth(
        AuthConfig(cfg.api_keys, cfg.admin_api_keys, cfg.public_routes, cfg.open_admin_routes)
    )
    router = AppRouter(auth, metrics, frontend=frontend)
    api.install(router)
    served = model_id(cfg, path)
    strict = cfg.strict_model_name
    openai = OpenAIAPI(
        frontend, chat, model_id=served, model_path=path, strict_model=strict,
        tool_call_parser=cfg.tool_call_parser,
    )  # fmt: skip
    openai.install(router)
    reasoning = openai.reasoning.name if openai.reasoning is not None else None
    api.parsers = (reasoning, openai.tool_format.name or None)
    ResponsesAPI(openai).install(router)
    AnthropicAPI(openai).install(router)
    ScoreAPI(frontend, served).install(router)
    EmbeddingsAPI(
        frontend, model_id=served, model_names=openai.model_names, strict_model=strict
    ).install(router)
    WebSocketAPI(api, openai=openai).install(router)
    install_metrics(router, metrics, shared)
    return router, api, auth


def _shared_metrics(cfg: AppConfig) -> SharedMetrics | None:
    """Under ``serve --frontends N``: where this frontend's metrics meet the others'."""
    if cfg.frontends_dir is None or cfg.frontend_index is None:
        return None
    return SharedMetrics(cfg.frontends_dir, cfg.frontend_index)


async def _publish_metrics(shared: SharedMetrics, metrics: Metrics) -> None:
    """Each second, this frontend's exposition for the others' scrapes (an unasked
    frontend's counters are at most that old in them)."""
    while True:
        shared.publish(metrics.text())
        await anyio.sleep(PUBLISH_INTERVAL)


async def _starting(request: Request) -> Response:
    return error_response(503, "not ready (loading the tokenizer)", 5)


def _port(server: Server) -> int:
    bound = server.bound
    return bound[0][1] if isinstance(bound, list) and bound else 0
