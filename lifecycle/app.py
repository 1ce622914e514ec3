"""Wiring: router + HTTP server + supervised worker + frontend, in one task group.

The model file is checked first (``modelfile.check``: a file the worker cannot run is
one ``ModelFileError`` before anything listens or spawns). The listener then binds early; ``/health`` answers 503 and generation requests get 503 until
the worker said HELLO and one warm-up generation came back (``Supervisor``).
``App.drain`` is the graceful stop (SIGTERM/SIGINT; ``DRAIN`` in ``lifecycle.core.states``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc

from lifecycle.api.access_log import AccessLog
from lifecycle.api.anthropic import AnthropicAPI
from lifecycle.api.auth import Auth, AuthConfig
from lifecycle.api.calls import error_response
from lifecycle.api.cors import cors
from lifecycle.api.debug import install_debug
from lifecycle.api.embeddings import EmbeddingsAPI
from lifecycle.api.metrics import install_metrics
from lifecycle.api.model_admin import install_model_admin
from lifecycle.api.model_routes import ModelRouter, Slot
from lifecycle.api.native import NativeAPI
from lifecycle.api.openai import OpenAIAPI
from lifecycle.api.replica_admin import install_replica_admin
from lifecycle.api.responses import ResponsesAPI
from lifecycle.api.routes import AppRouter
from lifecycle.api.score import ScoreAPI
from lifecycle.api.websocket import WebSocketAPI
from lifecycle.core.frontend import Frontend
from lifecycle.core.states import DRAIN
from lifecycle.extend import Extension, resolve_extension
from lifecycle.link.model_set import ModelSet, ModelSlot
from lifecycle.link.pool import WorkerPool
from lifecycle.link.supervisor import Supervisor, WorkerRefusedToStart
from lifecycle.runtime import (
    AppConfig,
    Runtime,
    model_id,
    server_args,
    worker_addresses,
    worker_args,
)
from lifecycle.tracing.metrics import Metrics
from lifecycle.tracing.replay import replay_in_process
from lifecycle.tracing.shared_metrics import PUBLISH_INTERVAL, SharedMetrics
from lifecycle.tracing.tracer import Tracer
from transport import Handler, Request, Response, Server, ServerConfig

if TYPE_CHECKING:
    from modelfile.check import CheckedModel

__all__ = ["App", "AppConfig", "CannotListen", "serve_app", "slot_configs", "worker_args"]

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
    others: tuple[Frontend, ...] = ()  # the further models' (--model repeated)

    @property
    def port(self) -> int:
        return _port(self.server)

    async def drain(self) -> int:
        """The graceful stop, within ``drain_timeout``: /health and new requests get 503
        at once, in-flight requests run on, those still open near the deadline end with
        an explicit error (an SSE error event then [DONE], a WebSocket error, a 503),
        then the listener closes; one line then says how many finished and how many were
        cut. Returns how many requests were cut."""
        fes, timeout = (self.frontend, *self.others), self.config.drain_timeout
        # Kept for the cut requests' owners to send their error, even at --drain-timeout 0
        grace = max(min(_CUT_GRACE, timeout / 5), _STOP_GRACE)
        start = anyio.current_time()
        for fe in fes:
            fe.begin_drain()
        self.server.begin_drain(retry_after=DRAIN.refused.retry_after)
        live = sum(len(fe.calls) for fe in fes)  # none is admitted from here on
        log.info("draining: %d live calls, up to %.1fs", live, timeout)
        cut = 0
        if not await _drained(fes, timeout - grace):
            cut = sum(fe.calls.cut_all(DRAIN.cut, "the server is shutting down") for fe in fes)
            log.warning("drain timeout: %d requests ended with an error", cut)
            await _drained(fes, grace / 2)
        await self.server.shutdown(grace / 2)
        took = anyio.current_time() - start
        log.info("stopped: %d finished, %d cut in %.1fs", max(live - cut, 0), cut, took)
        return cut

    async def stop_now(self) -> int:
        """The second signal: end every live call at once with ``DRAIN.cut``
        (shutting_down, never internal), give their owners a moment to send that error,
        then close the listener. Returns how many requests were cut."""
        fes = (self.frontend, *self.others)
        cut = sum(fe.calls.cut_all(DRAIN.cut, "the server is shutting down") for fe in fes)
        await _drained(fes, _STOP_GRACE)
        await self.server.shutdown(_STOP_GRACE)
        return cut


async def _drained(frontends: tuple[Frontend, ...], timeout: float) -> bool:
    """Whether every model's calls ended within ``timeout`` seconds, all told."""
    end, done = anyio.current_time() + timeout, True
    for fe in frontends:
        done = await fe.calls.wait_drained(max(end - anyio.current_time(), 0.0)) and done
    return done


class CannotListen(OSError):
    """The HTTP listener could not bind (one line for ``lifecycle serve``)."""


async def serve_app(
    cfg: AppConfig,
    *,
    models: Sequence[CheckedModel] = (),
    task_status: anyio.abc.TaskStatus[App] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Run everything until cancelled; ``task_status.started(App)`` once listening.
    ``models``: the model files already checked, one per model (``slot_configs``);
    those not given are checked here, before the listener binds and the workers start
    (``ModelFileError``). Each model runs its own ``Runtime``; the first model's owns
    the listener and the extensions; one tracer watches every model (its ring, trace
    log and debug routes)."""
    checked, configs = list(models), slot_configs(cfg)
    at_start = [
        ModelSet.loads_at_start(i, cfg.models_max, bool(worker_addresses(c)))
        for i, c in enumerate(configs)
    ]
    # One tracer for every model: one ring, one trace log (one writer per file), one
    # debug feed; each model's runtime joins it, and it closes after them all.
    tracer = Tracer(cfg.trace) if cfg.debug_routes or cfg.trace.log_path else None
    rts = [
        Runtime(c, checked.pop(0) if checked else None, loaded=start, tracer=tracer)
        for c, start in zip(configs, at_start, strict=True)
    ]
    for one in rts:
        await one.check_model()
    model_set = _model_set(cfg, rts, at_start)
    rt = rts[0]  # the first model's: the listener, metrics, traces, extensions
    handler: list[Handler] = [_starting]  # swapped for the router once the tokenizer is in
    server = Server(lambda request: handler[0](request), _server_config(cfg))
    async with AsyncExitStack() as stack:
        if tracer is not None:  # after every runtime closed: requests cut at shutdown logged
            stack.callback(tracer.close)
        groups = [await stack.enter_async_context(one.running()) for one in rts]
        tg = groups[0]
        # A spawned worker listens once it took its options and its device, before its
        # model loads; one that refuses them ends this here (WorkerRefusedToStart), so
        # the port is never bound. Then bind early: /health says 503 until ready.
        for one in rts:
            await one.supervisor.wait_listening()
        try:
            await tg.start(server.serve)
        except OSError as exc:  # the port was taken since serve checked it
            raise CannotListen(
                f"cannot listen on {cfg.host}:{cfg.port}: {exc.strerror or exc}"
            ) from exc
        for one, start in zip(rts, at_start, strict=True):
            if start:  # one loaded on demand that fails ends its requests, not the server
                tg.start_soon(_fail_unless_started, one.supervisor)
        scheme = "https" if cfg.ssl_certfile else "http"
        log.info("listening on %s://%s:%s", scheme, cfg.host, _port(server))
        frontends = [
            await _load(one, g, model_set, i)
            for i, (one, g) in enumerate(zip(rts, groups, strict=True))
        ]
        if model_set is not None:
            tg.start_soon(model_set.run)
        if tracer is not None:
            tg.start_soon(tracer.run)
        frontend = frontends[0]
        assert rt.metrics is not None
        access = _access_log(cfg, frontend)
        try:
            shared = _shared_metrics(cfg)
            routes = [_routes(one, shared) for one in rts]
            router, api, auth, _ = routes[0]
            router.access_log = access
            # behind the admin key, as /flush_cache
            ids = {one.served_model_id(): fe for one, fe in zip(rts, frontends, strict=True)}
            install_model_admin(router, model_set, ids)
            install_replica_admin(router, ids)
            for spec in cfg.extend:  # checked by serve before it listened
                resolve_extension(spec)(Extension(router, api, frontend, cfg))
            # The router (AppRouter) already asks /debug/* for an admin key when keys are set.
            if tracer is not None:  # every model's requests (Tracer.watch)
                by_model = {one.served_model_id(): one for one in rts}

                async def replay(trace: dict[str, Any]) -> dict[str, Any]:
                    one = by_model.get(trace.get("model") or "", rt)  # the model that served it
                    assert one.frontend is not None
                    return await replay_in_process(one.frontend, trace, one.served_model_id())

                install_debug(router, tracer, enabled=cfg.debug_routes, replay=replay)
            handler[0] = cors(
                _model_router([r[3] for r in routes], router, auth), cfg.cors_allow_origins
            )
            url = f"{scheme}://{cfg.host}:{_port(server)}"
            tg.start_soon(_announce_ready, url, rts, at_start, cfg)
            tg.start_soon(_report_load, frontend)
            if shared is not None:
                tg.start_soon(_publish_metrics, shared, rt.metrics)
            task_status.started(
                App(cfg, server, rt.supervisor, frontend, api, rt.metrics, auth, rt.tracer,
                    others=tuple(frontends[1:]))
            )  # fmt: skip
            await anyio.sleep_forever()
        finally:
            if access is not None:
                access.close()


def _model_set(cfg: AppConfig, rts: list[Runtime], at_start: list[bool]) -> ModelSet | None:
    """The models' states when they load on demand (``--models-max``,
    ``--sleep-idle-seconds``); None when every model loads at start and stays."""
    if cfg.models_max is None and cfg.sleep_idle_seconds is None:
        return None
    slots = [
        ModelSlot(
            one.served_model_id(), one.supervisor, remote=bool(worker_addresses(one.config)),
            state="loading" if start else "unloaded",
        )
        for one, start in zip(rts, at_start, strict=True)
    ]  # fmt: skip
    return ModelSet(slots, cfg.models_max, cfg.sleep_idle_seconds)


async def _load(
    rt: Runtime, tg: anyio.abc.TaskGroup, models: ModelSet | None, index: int
) -> Frontend:
    """``rt`` loaded (its tokenizer, frontend, tracer, metrics); with a ``ModelSet``,
    its frontend's calls wait for the model to load through it."""
    if models is None:
        return await rt.load(tg)
    slot = models.slots[index]
    loader = models.loader(slot)
    fe = await rt.load(tg, loader)
    models.attach(slot, fe, loader)
    return fe


def _model_router(slots: list[Slot], first: AppRouter, auth: Auth) -> Handler:
    """The first model's router, or with several models the router that picks one by
    the request's model (``lifecycle.api.model_routes``)."""
    return first if len(slots) == 1 else ModelRouter(slots, auth)


def slot_configs(cfg: AppConfig) -> list[AppConfig]:
    """One configuration per model: ``cfg`` itself when it serves one; otherwise the
    first model's, then each further one's (its file and name; ``--worker`` addresses
    serve the first model, so the others spawn theirs here). With several, a name no
    model has is a 404 (``strict_model_name``). Two models with one name: ValueError."""
    if cfg.frontends > 1 and (cfg.models_max is not None or cfg.sleep_idle_seconds is not None):
        raise ValueError(
            "--frontends N keeps its model loaded: no --models-max or --sleep-idle-seconds"
        )
    if not cfg.more_models:
        return [cfg]
    if cfg.frontends > 1:  # its launcher spawns the workers of one model
        raise ValueError("--frontends N serves one model: give --model once, or --frontends 1")
    first = replace(cfg, more_models=(), strict_model_name=True)
    dp = cfg.dp if cfg.worker is None else None
    out = [first]
    for m in cfg.more_models:
        out.append(
            replace(
                first, model=m.path, model_repo=m.repo, served_model_name=m.name,
                worker=None, dp=dp,
                # what --revision ... --tool-call-parser say is of the first model's file
                revision=None, hf_file=None, context_length=None, chat_template=None,
                reasoning_parser=None, tool_call_parser=None,
            )
        )  # fmt: skip
    ids = [model_id(c, c.model or "") for c in out]
    if len(set(ids)) < len(ids):
        twice = sorted({i for i in ids if ids.count(i) > 1})
        raise ValueError(f"two models named {', '.join(twice)}: name one with --model NAME=SPEC")
    return out


async def _fail_unless_started(sup: Supervisor | WorkerPool) -> None:
    """A worker that gives up before it was ever ready (it refused what it was given
    once it listened, or failed at start-up twice the same way) ends the server with
    that error (``lifecycle serve``: one line, exit 2), not a live process that is never
    ready. Once ready, later failures are restarted as ever."""
    while not sup.ready:
        if all(m.status == "failed" for m in sup.members):
            raise WorkerRefusedToStart(sup.last_error or "the worker did not start")
        await anyio.sleep(0.1)


async def _announce_ready(
    url: str, rts: Sequence[Runtime], at_start: Sequence[bool], cfg: AppConfig
) -> None:
    """One line once the server serves (``/health`` 200): where, each model (a model
    loaded at start: its context, KV cache and batch; one loaded on demand: that)."""
    parts = []
    for rt, start in zip(rts, at_start, strict=True):
        if not start:
            parts.append(f"{rt.served_model_id()} (unloaded: loads when a request names it)")
            continue
        sup = rt.supervisor
        client = await sup.wait_ready()
        cap, card = client.capacity, client.model
        kv = int(cap.get("kv_blocks", 0)) * int(cap.get("block_size", 0))
        workers = len(sup.members)
        parts.append(
            f"{rt.served_model_id()} (context {card.get('context_length')} tokens, KV cache "
            f"{kv} tokens, {cap.get('max_running')} running at most"
            f"{f', per worker of {workers}' if workers > 1 else ''})"
        )
    where = f"{url}/debug and {url}/metrics" if cfg.debug_routes else f"{url}/metrics"
    log.info("ready: %s serves %s; see %s", url, ", ".join(parts), where)


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


def _routes(rt: Runtime, shared: SharedMetrics | None) -> tuple[AppRouter, NativeAPI, Auth, Slot]:
    """Every API of a loaded runtime's model on one router: native, OpenAI, WebSocket,
    metrics (the debug routes are the tracer's); its slot among several models."""
    cfg, frontend, metrics, chat, path = rt.config, rt.frontend, rt.metrics, rt.chat, rt.model_path
    assert frontend is not None and metrics is not None
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
    return router, api, auth, Slot(served, openai.model_names, router)


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
