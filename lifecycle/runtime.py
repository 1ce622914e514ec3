"""What serves requests, with HTTP or without: the supervised worker, the tokenizer and
chat template, the frontend, the tracer and the metrics, built from one ``AppConfig``.

``lifecycle.app`` puts the HTTP server and its routes in front of a ``Runtime``;
``lifecycle.engine.Engine`` drives one from Python calls.
"""

from __future__ import annotations

import logging
import os
import shlex
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc

from lifecycle.chat.reasoning import reasoning_in_effect
from lifecycle.core import fields
from lifecycle.core.buffers import CONTROL_HEADROOM
from lifecycle.core.frontend import Frontend, FrontendConfig, ModelLoader
from lifecycle.core.fsm import RequestRecord
from lifecycle.core.origin import DEFAULT_PUBLIC_ROUTES
from lifecycle.link.autoscale import AutoscaleConfig, autoscale_after, autoscale_bounds
from lifecycle.link.pool import POLICIES, Router, WorkerPool
from lifecycle.link.supervisor import STOP_GRACE, Supervisor, SupervisorConfig
from lifecycle.models import ModelSpec, model_arguments, models_in, split_name
from lifecycle.option_args import read_key_file
from lifecycle.options import MODEL_WORKER, OPTIONS, SCRIPTED_WORKER, AppConfig
from lifecycle.tracing.metrics import Metrics
from lifecycle.tracing.probes import Recorder, call_probe
from lifecycle.tracing.replay import replay_record
from lifecycle.tracing.tracer import TraceConfig, Tracer
from modelfile.hub import repo_of_path, resolve_model
from wire.auth import resolve_token
from wire.worker_options import WORKER_OPTIONS

if TYPE_CHECKING:
    from lifecycle.tracing.otel import OtlpExporter
    from modelfile.check import CheckedModel

__all__ = ["AppConfig", "Runtime", "app_config", "server_args", "worker_addresses", "worker_args"]

log = logging.getLogger("lifecycle.runtime")
# Seconds a worker with a disk prefix cache has to stop: its spill writes the most recently
# used blocks first, atomically, so one cut short keeps the newest (about 1,800 SmolLM2
# blocks, 640 MiB, took a few seconds here).
SPILL_GRACE = 30.0


def worker_args(cfg: AppConfig) -> tuple[str, ...]:
    """The ``gpu.worker`` command-line options this configuration implies."""
    args: list[str] = []
    scripted = cfg.worker_module != MODEL_WORKER  # the scripted worker loads no model
    for o in WORKER_OPTIONS:
        if not o.forwarded or (scripted and not o.scripted):
            continue
        value = getattr(cfg, o.serve_name or o.name)
        if value is not None:
            args += [o.cli, str(value)]
    return (*args, *cfg.worker_extra_args)


# Never echoed by /server_info: secrets, and what is not a server argument.
_UNSHOWN = frozenset({"extra", "api_keys", "admin_api_keys", "worker_token", "more_models"})


def model_id(cfg: AppConfig, model_path: str) -> str:
    """The model's name in the APIs (``/v1/models``, each reply's ``model``):
    ``--served-model-name``, else the Hub repo id it was fetched by (or whose cache
    snapshot folder it is), else the model file's name without ``.gguf`` (a folder's
    name), as llama-server and SGLang name it by its path; never the file's free-text
    ``general.name``, which may hold spaces."""
    if cfg.served_model_name:
        return cfg.served_model_name
    if cfg.model_repo:  # --model ORG/NAME[:QUANT]
        return cfg.model_repo
    if Path(model_path).is_dir():  # a hub cache snapshot's folder is its repo's
        return repo_of_path(model_path) or Path(model_path).name
    return Path(model_path).name.removesuffix(".gguf")


def server_args(cfg: AppConfig, model_path: str) -> dict[str, Any]:
    """What ``/server_info`` (and ``Engine.server_info``) echo of the configuration; its
    ``served_model_name`` is the one in effect (``model_id``)."""
    out = {k: v for k, v in asdict(cfg).items() if k not in _UNSHOWN}
    out.update(cfg.extra, model_path=model_path, served_model_name=model_id(cfg, model_path))
    return out


class Runtime:
    """Built in two steps: ``Runtime(cfg)`` makes the supervisor (run it in a task group:
    the worker loads its model meanwhile), ``await load(tg)`` the tokenizer, frontend,
    tracer and metrics. ``close()`` after every request ended; ``stop()`` ends the worker.

    ``model`` is the model file already checked (``modelfile.check``); without it,
    ``await check_model()`` checks it, which callers do before they listen or start the
    worker, so that a file the worker cannot run is one ``ModelFileError``.
    ``loaded=False``: its spawned workers start unloaded (``lifecycle.link.model_set`` loads
    them when a request names the model). ``tracer``: one that another runs and closes
    (``serve_app``: one for every model), which this model's requests join; without
    it, the runtime makes its own (debug routes or ``--trace-log``), runs and closes it."""

    def __init__(
        self,
        cfg: AppConfig,
        model: CheckedModel | None = None,
        *,
        loaded: bool = True,
        tracer: Tracer | None = None,
    ) -> None:
        self.config = cfg
        self.model = model
        self.supervisor = _supervisor(cfg, loaded)
        self._otlp_endpoint = _otlp_endpoint(cfg.otlp_traces_endpoint)
        self.frontend: Frontend | None = None
        self.tracer: Tracer | None = tracer
        self._owns_tracer = tracer is None
        self.metrics: Metrics | None = None
        self.otlp: OtlpExporter | None = None
        self.chat: Any = None
        self.model_path = str(cfg.model or model.path) if model is not None else ""

    @asynccontextmanager
    async def running(self) -> AsyncIterator[anyio.abc.TaskGroup]:
        """The supervisor running in a task group for the body (the worker loads its
        model meanwhile); at the end, however it ends, the worker is stopped, the
        group's tasks cancelled, then ``close()``."""
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.supervisor.run)
                try:
                    yield tg
                finally:
                    with anyio.CancelScope(shield=True):
                        await self.stop()
                    tg.cancel_scope.cancel()
        finally:
            self.close()

    async def check_model(self) -> CheckedModel:
        """The model file checked (once): raises ``ModelFileError``."""
        if self.model is None:
            from modelfile.check import check_model

            self.model = await anyio.to_thread.run_sync(
                check_model,
                self.config.model,
                self.config.context_length,
                self.config.chat_template,
            )
            self.model_path = str(self.config.model or self.model.path)
        return self.model

    async def load(self, tg: anyio.abc.TaskGroup, loader: ModelLoader | None = None) -> Frontend:
        """The tokenizer, frontend, tracer and metrics; ``loader``: the model is loaded
        on demand (``lifecycle.link.model_set``), a call waits for it through this."""
        cfg = self.config
        model = await self.check_model()
        tokenizer, chat, model_config = model.tokenizer, model.chat, model.config
        path = self.model_path
        fe = Frontend(
            self.supervisor,
            tokenizer,
            model_config,
            FrontendConfig(
                max_queued=cfg.max_queued,
                incremental_streaming_output=cfg.incremental_streaming_output,
                request_timeout=cfg.request_timeout,
                weight_version=cfg.weight_version,
                reasoning=reasoning_in_effect(
                    cfg.reasoning_parser, chat.source if chat is not None else None
                ),
            ),
            loader,
        )
        self.frontend, self.chat = fe, chat
        tg.start_soon(fe.calls.watch_deadlines)
        fields.install(fields.UnknownFields(strict=cfg.strict_fields))
        self.metrics = Metrics(fe, model=model_id(cfg, path))
        if self.tracer is not None or cfg.debug_routes or cfg.trace.log_path:
            self.tracer = self._tracer(fe)
            self.metrics.watch_tracer(self.tracer)
            if self._owns_tracer:
                tg.start_soon(self.tracer.run)
        elif cfg.trace.record_prompts:
            log.warning("--trace-prompts records nothing without debug routes or --trace-log")
        if self._otlp_endpoint is not None:
            self.otlp = self._otlp(fe, self._otlp_endpoint)
        return fe

    def worker_name(self) -> str:
        """The worker as traces name it: its address, or its pid when it runs here."""
        remote = worker_addresses(self.config)
        if remote and len(self.supervisor.members) == len(remote):
            return ", ".join(remote)
        return f"local pid {getattr(self.supervisor, 'worker_pid', None)}"

    def worker_of(self, client: Any) -> tuple[int, str] | None:
        """The worker whose client is ``client``: its index (``--dp``) and its address, or
        its pid when it runs here; None for a client a restart replaced."""
        i = self.frontend.worker_index(client) if self.frontend is not None else None
        if i is None:
            return None
        return i, self.supervisor.member_name(i)

    def _tracer(self, fe: Frontend) -> Tracer:
        prompts = self.config.trace.record_prompts
        probe = call_probe(fe.calls, self.worker_of, self.worker_name, prompts)
        recorder = self._recorder(fe) if self.config.trace.record_prompts else None
        tracer = self.tracer or Tracer(self.config.trace)
        # this model's requests, named by its id: its feed tells the tracer of them only
        fe.events.subscribe(tracer.watch(self.served_model_id(), fe.registry, probe, recorder))
        return tracer

    def served_model_id(self) -> str:
        return model_id(self.config, self.model_path)

    def _recorder(self, fe: Frontend) -> Recorder:
        """--trace-prompts: what a finished request's trace keeps to replay it, read from
        its call (still live at its records' terminal edges)."""
        served_id = self.served_model_id()

        def record(rec: RequestRecord) -> dict[str, Any] | None:
            call = fe.calls.of(rec.id)
            return None if call is None else replay_record(call, rec, served_id)

        return record

    def _otlp(self, fe: Frontend, endpoint: str) -> OtlpExporter:
        from lifecycle.tracing.otel import OtlpConfig, OtlpExporter

        config = OtlpConfig(endpoint, model=self.served_model_id())
        otlp = OtlpExporter(config, worker=self.worker_name)
        otlp.install(fe)
        return otlp

    def close(self) -> None:
        """Stops the frontend's feed and logs the traces left (of a tracer it owns): after
        every request task ended, so those cancelled at shutdown reach the log too."""
        if self.frontend is not None:
            self.frontend.events.close()
        if self.tracer is not None and self._owns_tracer:
            self.tracer.close()
        if self.otlp is not None:
            self.otlp.close()  # the spans still queued go out (bounded wait)

    async def stop(self) -> None:
        await self.supervisor.stop()


def _otlp_endpoint(url: str | None) -> str | None:
    """Checked before the worker starts: an http(s) URL, and the otel extra installed
    (``lifecycle.tracing.otel.OtlpUnavailable``, a ValueError that says what to do)."""
    if not url:
        return None
    from lifecycle.tracing.otel import check_endpoint

    return check_endpoint(url)


def _load_tokenizer(model: str | None) -> tuple[Any, Any, Any, str]:
    from modelfile.check import check_model

    checked = check_model(model)
    return checked.tokenizer, checked.chat, checked.config, str(model or checked.path)


def worker_addresses(cfg: AppConfig) -> tuple[str, ...]:
    """The remote workers' addresses (``--worker``, given once or repeated)."""
    if cfg.worker is None:
        return ()
    return (cfg.worker,) if isinstance(cfg.worker, str) else tuple(cfg.worker)


def _supervisor(cfg: AppConfig, loaded: bool = True) -> Supervisor | WorkerPool:
    """One supervisor, or with several workers (``--dp N`` spawned here, ``--worker``
    remote ones, or both) a pool of them behind the router; ``loaded=False``: the
    spawned ones start unloaded (``Supervisor.load``)."""
    remote = worker_addresses(cfg)
    if cfg.ray is not None:
        return _ray_workers(cfg, remote, loaded)
    autoscale = (cfg.ray_autoscale, cfg.ray_autoscale_queue, cfg.ray_autoscale_after)
    if any(v is not None for v in autoscale):
        raise ValueError("--ray-autoscale scales Ray replicas: give --ray with it")
    local = cfg.dp if cfg.dp is not None else (0 if remote else 1)
    if local < 0 or (local < 1 and not remote):
        raise ValueError(f"dp must be at least 1 without --worker, got {cfg.dp}")
    if cfg.router_policy not in POLICIES:
        raise ValueError(f"router_policy must be one of {', '.join(POLICIES)}")
    token = resolve_token(cfg.worker_token) if remote else None
    members = [_one_supervisor(cfg, None, None, loaded) for _ in range(local)]
    members += [_one_supervisor(cfg, address, token) for address in remote]
    if len(members) == 1:
        return members[0]
    return WorkerPool(members, Router(cfg.router_policy))


def _ray_workers(cfg: AppConfig, remote: tuple[str, ...], loaded: bool) -> WorkerPool:
    """``--ray``: ``--dp N`` (1 by default; ``--ray-autoscale``'s MIN) Ray actors run the
    workers (``lifecycle.link.ray_replicas``); with ``--worker`` or an on-demand model,
    or a count outside the autoscale bounds: ValueError."""
    from lifecycle.link.ray_replicas import RayConfig, RayWorkers, replica_resources

    if remote:
        raise ValueError("--ray places the workers itself: no --worker beside it")
    if not loaded:
        raise ValueError("--ray replicas stay loaded: no --models-max below the models given")
    auto = _autoscale(cfg)
    dp = cfg.dp if cfg.dp is not None else (auto.low if auto is not None else 1)
    if dp < 1:
        raise ValueError(f"dp must be at least 1 with --ray, got {dp}")
    if auto is not None and not auto.low <= dp <= auto.high:
        raise ValueError(f"--dp {dp} is outside --ray-autoscale {auto.low}:{auto.high}")
    ray_config = RayConfig(
        cfg.ray or "local", dp, replica_resources(cfg.ray_replica_resources),
        cfg.worker_module, worker_args(cfg), tp=cfg.tp or 1, autoscale=auto,
    )  # fmt: skip
    return RayWorkers(ray_config, _supervisor_config(cfg, None, None), Router(cfg.router_policy))


def _autoscale(cfg: AppConfig) -> AutoscaleConfig | None:
    """``--ray-autoscale MIN:MAX`` and its two tunings as the policy's config; None
    without it (the tunings alone: ValueError)."""
    if cfg.ray_autoscale is None:
        if cfg.ray_autoscale_queue is not None or cfg.ray_autoscale_after is not None:
            raise ValueError("--ray-autoscale-queue and --ray-autoscale-after tune --ray-autoscale")
        return None
    low, high = autoscale_bounds(cfg.ray_autoscale)
    auto = AutoscaleConfig(low, high)
    if cfg.ray_autoscale_queue is not None:
        auto = replace(auto, queue=cfg.ray_autoscale_queue)
    if cfg.ray_autoscale_after is not None:
        up, down = autoscale_after(cfg.ray_autoscale_after)
        auto = replace(auto, up_after=up, down_after=down)
    return auto


def _one_supervisor(
    cfg: AppConfig, address: str | None, token: str | None, loaded: bool = True
) -> Supervisor:
    return Supervisor(_supervisor_config(cfg, address, token), loaded=loaded)


def _supervisor_config(cfg: AppConfig, address: str | None, token: str | None) -> SupervisorConfig:
    sup_config = SupervisorConfig(
        worker=address,
        token=token,
        tls_ca=cfg.worker_tls_ca,
        worker_module=cfg.worker_module,
        worker_args=worker_args(cfg),
        hung_timeout=cfg.hung_timeout,
        warmup=cfg.warmup,
        max_queued=cfg.max_queued + CONTROL_HEADROOM,  # every admitted request, and probes
        # a worker with a disk prefix cache writes its blocks out as it stops
        stop_grace=SPILL_GRACE if cfg.prefix_cache_dir else STOP_GRACE,
    )
    if cfg.restart_backoff:
        sup_config = replace(sup_config, backoff=cfg.restart_backoff)
    return sup_config


FRONTEND_INDEX_ENV = "LIFECYCLE_FRONTEND_INDEX"  # set by serve --frontends in each frontend
# The launcher's private folder, where each frontend publishes its metrics for the others
# (lifecycle/tracing/shared_metrics.py); set by serve --frontends in each frontend.
FRONTENDS_DIR_ENV = "LIFECYCLE_FRONTENDS_DIR"


def _frontend_index() -> int | None:
    value = os.environ.get(FRONTEND_INDEX_ENV)
    return int(value) if value and value.isdigit() else None


def _per_frontend(path: str | None) -> str | None:
    """A path with ``{frontend}`` in it names this frontend's own file (its index, 0
    alone): several frontends never share one trace log."""
    if path is None:
        return None
    index = _frontend_index()
    return path.replace("{frontend}", str(0 if index is None else index))


def app_config(values: Mapping[str, Any], **fixed: Any) -> AppConfig:
    """The ``AppConfig`` for a full set of option values (``option_values`` or
    ``engine_values``); ``fixed`` sets AppConfig fields that are not options. A Hub
    repo id in ``model`` is resolved here, once (``modelfile.hub.resolve_model``: a
    ``HubModelError`` when it cannot be), and the config carries its local path."""
    v = dict(values)
    given = model_arguments(v["model"]) + models_in(v["models_dir"])
    args: list[tuple[str | None, str | None]] = [split_name(a) for a in given]
    (name, spec), *more = args or [(None, None)]
    model = resolve_model(spec, v["revision"], v["hf_file"])  # HubModelError
    v["model"], v["served_model_name"] = model.path, v["served_model_name"] or name
    others = [(n, resolve_model(s)) for n, s in more]  # --model repeated: the same rules
    keys = list(v["api_key"] or ())
    if v["api_key_file"]:
        keys += read_key_file(v["api_key_file"])
    public = tuple(v["public_route"] or DEFAULT_PUBLIC_ROUTES)
    # the options that are the fields of their name, as they are (a few converted below)
    plain = {o.name: v[o.name] for o in OPTIONS if o.into == o.name}
    built: dict[str, Any] = dict(
        model_repo=model.repo_id,
        more_models=tuple(ModelSpec(m.path, m.repo_id, n) for n, m in others),
        worker_module=SCRIPTED_WORKER if v["scripted_worker"] else MODEL_WORKER,
        worker_extra_args=tuple(_split_args(v["worker_args"])),
        restart_backoff=_backoff(v["restart_backoff"]),
        api_keys=tuple(keys),
        admin_api_keys=tuple(v["admin_api_key"] or ()),
        public_routes=() if v["no_public_routes"] else public,
        frontend_index=_frontend_index(),
        frontends_dir=os.environ.get(FRONTENDS_DIR_ENV) or None,
        trace=TraceConfig(
            ring_size=v["trace_ring_size"],
            log_path=_per_frontend(v["trace_log"]),
            log_max_bytes=v["trace_log_max_bytes"],
            log_backups=v["trace_log_backups"],
            record_prompts=v["trace_prompts"],
        ),
        debug_routes=not v["disable_debug_routes"],
        extend=tuple(v["extend"] or ()),
        cors_allow_origins=tuple(
            o.strip() for g in v.get("cors_allow_origins") or () for o in g.split(",") if o.strip()
        ),
    )
    return AppConfig(**{**plain, **built, **fixed})


def _split_args(value: str | list[str] | tuple[str, ...] | None) -> list[str]:
    if not value:
        return []
    return shlex.split(value) if isinstance(value, str) else list(value)


def _backoff(
    value: str | float | list[float] | tuple[float, ...] | None,
) -> tuple[float, ...] | None:
    if value is None or value == "":
        return None
    if isinstance(value, str):
        return tuple(float(x) for x in value.split(","))
    if isinstance(value, int | float):
        return (float(value),)
    return tuple(float(x) for x in value)
