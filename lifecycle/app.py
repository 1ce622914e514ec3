"""Wiring: router + HTTP server + supervised worker + frontend, in one task group.

The listener binds early; ``/health`` answers 503 and generation requests get 503 until
the worker said HELLO and one warm-up generation came back (``Supervisor``).
``App.drain`` is the graceful stop (SIGTERM/SIGINT; ``DRAIN`` in ``lifecycle.core.states``).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import anyio
import anyio.abc

from lifecycle.api.auth import DEFAULT_PUBLIC_ROUTES, Auth, AuthConfig
from lifecycle.api.metrics import Metrics
from lifecycle.api.native import NativeAPI, error_response
from lifecycle.api.openai import OpenAIAPI
from lifecycle.api.routes import AppRouter
from lifecycle.api.websocket import WebSocketAPI
from lifecycle.core.frontend import Frontend, FrontendConfig
from lifecycle.core.states import DRAIN
from lifecycle.core.supervisor import Supervisor, SupervisorConfig
from lifecycle.tracing.debug import install_debug
from lifecycle.tracing.tracer import TraceConfig, Tracer, worker_probe
from transport import Handler, Request, Response, Router, Server, ServerConfig

__all__ = ["App", "AppConfig", "serve_app", "worker_args"]

log = logging.getLogger("lifecycle.app")


@dataclass(frozen=True, slots=True)
class AppConfig:
    host: str = "127.0.0.1"
    port: int = 30000
    model: str | None = None  # GGUF path; None: the bundled SmolLM2
    served_model_name: str | None = None
    worker: str | None = None  # address of a worker started elsewhere; None: spawn one
    worker_module: str = "gpu.worker"
    worker_extra_args: tuple[str, ...] = ()
    device: str | None = None
    dtype: str | None = None
    max_pending: int | None = None  # worker credits (rids in flight)
    max_running: int | None = None
    kv_cache_tokens: int | None = None
    max_queued: int = 1024  # admission bound in the frontend
    incremental_streaming_output: bool = False
    send_timeout: float = 30.0
    hung_timeout: float = 60.0
    drain_timeout: float = DRAIN.timeout_s  # SIGTERM: in-flight requests finish until then
    restart_backoff: tuple[float, ...] | None = None  # None: SupervisorConfig's default
    warmup: bool = True
    api_keys: tuple[str, ...] = ()
    admin_api_keys: tuple[str, ...] = ()  # also guard /debug/* (AppRouter treats it as admin)
    public_routes: tuple[str, ...] = DEFAULT_PUBLIC_ROUTES
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    trace: TraceConfig = TraceConfig()  # ring size, --trace-log and its rotation
    debug_routes: bool = True  # /debug, /debug/requests, /debug/feed (docs/tracing.md)
    extra: dict[str, Any] = field(default_factory=dict)


# Never echoed by /server_info: secrets, and what is not a server argument.
_UNSHOWN = frozenset({"extra", "api_keys", "admin_api_keys"})
_CUT_GRACE = 2.0  # seconds of the drain kept for cut requests to send their error


def worker_args(cfg: AppConfig) -> tuple[str, ...]:
    """The ``gpu.worker`` command-line options this configuration implies."""
    args: list[str] = []
    options: list[tuple[str, Any]] = [
        ("--max-pending", cfg.max_pending),
        ("--max-running", cfg.max_running),
    ]
    if cfg.worker_module == "gpu.worker":  # the scripted worker loads no model
        options += [
            ("--model", cfg.model),
            ("--device", cfg.device),
            ("--dtype", cfg.dtype),
            ("--kv-cache-tokens", cfg.kv_cache_tokens),
        ]
    for flag, value in options:
        if value is not None:
            args += [flag, str(value)]
    return (*args, *cfg.worker_extra_args)


@dataclass(slots=True)
class App:
    config: AppConfig
    server: Server
    supervisor: Supervisor
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
        then the listener closes. Returns how many requests were cut."""
        fe, timeout = self.frontend, self.config.drain_timeout
        grace = min(_CUT_GRACE, timeout / 5)  # for the cut requests' owners to answer
        fe.begin_drain()
        self.server.begin_drain()
        log.info("draining: %d live calls, up to %.1fs", len(fe.calls), timeout)
        cut = 0
        if not await fe.calls.wait_drained(timeout - grace):
            cut = fe.calls.cut_all(DRAIN.cut, "the server is shutting down")
            log.warning("drain timeout: %d requests ended with an error", cut)
            await fe.calls.wait_drained(grace / 2)
        await self.server.shutdown(grace / 2)
        return cut


def _load_tokenizer(model: str | None) -> tuple[Any, Any, Any, str]:
    from modelfile.gguf_file import default_model_path
    from modelfile.vocab import load_tokenizer

    path = str(model or default_model_path())
    tokenizer, chat, model_config = load_tokenizer(path)
    return tokenizer, chat, model_config, path


class _Tracing:
    """The app's tracer: debug routes and the transition observer, or nothing at all when
    neither the routes nor a trace log is wanted (the observer slot stays empty)."""

    def __init__(self, cfg: AppConfig) -> None:
        self.cfg = cfg
        self.tracer: Tracer | None = None

    def start(
        self, router: Router, frontend: Frontend, supervisor: Supervisor, tg: anyio.abc.TaskGroup
    ) -> Tracer | None:
        cfg = self.cfg
        if not (cfg.debug_routes or cfg.trace.log_path):
            return None

        def worker() -> str:
            return cfg.worker or f"local pid {getattr(supervisor, 'worker_pid', None)}"

        tracer = Tracer(cfg.trace, registry=frontend.registry, probe=worker_probe(worker))
        # The router (AppRouter) already asks /debug/* for an admin key when keys are set.
        install_debug(router, tracer, enabled=cfg.debug_routes)
        tracer.install()
        tg.start_soon(tracer.run)
        self.tracer = tracer
        return tracer

    def close(self) -> None:
        if self.tracer is not None:
            self.tracer.close()  # logs what is left, then uninstalls the observer


async def serve_app(
    cfg: AppConfig, *, task_status: anyio.abc.TaskStatus[App] = anyio.TASK_STATUS_IGNORED
) -> None:
    """Run everything until cancelled; ``task_status.started(App)`` once listening."""
    tracing = _Tracing(cfg)
    try:
        await _serve_app(cfg, tracing, task_status)
    finally:
        # After every request task ended: those cancelled at shutdown are terminal by now,
        # so their traces reach the log too.
        tracing.close()


async def _serve_app(
    cfg: AppConfig, tracing: _Tracing, task_status: anyio.abc.TaskStatus[App]
) -> None:
    supervisor = _supervisor(cfg)
    handler: list[Handler] = [_starting]  # swapped for the router once the tokenizer is in
    server = Server(lambda request: handler[0](request), _server_config(cfg))
    async with anyio.create_task_group() as tg:
        tg.start_soon(supervisor.run)  # the worker loads its model meanwhile
        try:
            await tg.start(server.serve)  # bind early: /health says 503 until ready
            scheme = "https" if cfg.ssl_certfile else "http"
            log.info("listening on %s://%s:%s", scheme, cfg.host, _port(server))
            tokenizer, chat, model_config, path = await anyio.to_thread.run_sync(
                _load_tokenizer, cfg.model
            )
            frontend = Frontend(
                supervisor,
                tokenizer,
                model_config,
                FrontendConfig(
                    max_queued=cfg.max_queued,
                    incremental_streaming_output=cfg.incremental_streaming_output,
                ),
            )
            router, api, metrics, auth = _routes(cfg, frontend, chat, path)
            tracer = tracing.start(router, frontend, supervisor, tg)
            handler[0] = router
            task_status.started(App(cfg, server, supervisor, frontend, api, metrics, auth, tracer))
            await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True):
                await supervisor.stop()
            tg.cancel_scope.cancel()


def _supervisor(cfg: AppConfig) -> Supervisor:
    sup_config = SupervisorConfig(
        worker=cfg.worker,
        worker_module=cfg.worker_module,
        worker_args=worker_args(cfg),
        hung_timeout=cfg.hung_timeout,
        warmup=cfg.warmup,
        max_queued=cfg.max_queued + 8,  # every admitted request fits, plus the warm-up
    )
    if cfg.restart_backoff:
        sup_config = replace(sup_config, backoff=cfg.restart_backoff)
    return Supervisor(sup_config)


def _server_config(cfg: AppConfig) -> ServerConfig:
    return ServerConfig(
        host=cfg.host,
        port=cfg.port,
        send_timeout=cfg.send_timeout,
        ssl_certfile=cfg.ssl_certfile,
        ssl_keyfile=cfg.ssl_keyfile,
    )


def _routes(
    cfg: AppConfig, frontend: Frontend, chat: Any, path: str
) -> tuple[AppRouter, NativeAPI, Metrics, Auth]:
    """Every API on one router: native, OpenAI, WebSocket, metrics (the debug routes are
    the tracer's)."""
    server_args = {k: v for k, v in asdict(cfg).items() if k not in _UNSHOWN}
    server_args.update(cfg.extra, model_path=path)
    api = NativeAPI(frontend, server_args)
    metrics = Metrics(frontend)
    auth = Auth(AuthConfig(cfg.api_keys, cfg.admin_api_keys, cfg.public_routes))
    router = AppRouter(auth, metrics)
    api.install(router)
    model_id = cfg.served_model_name or frontend.model_config.name
    openai = OpenAIAPI(frontend, chat, model_id=model_id, model_path=path)
    openai.install(router)
    WebSocketAPI(api, openai=openai).install(router)
    metrics.install(router)
    return router, api, metrics, auth


async def _starting(request: Request) -> Response:
    return error_response(503, "not ready (loading the tokenizer)", 5)


def _port(server: Server) -> int:
    bound = server.bound
    return bound[0][1] if isinstance(bound, list) and bound else 0
