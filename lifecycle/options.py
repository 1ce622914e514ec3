"""The options of ``lifecycle serve`` and of ``lifecycle.Engine``, declared once, in
``AppConfig``: the configuration both run on is the schema of its own options.

A field declared with ``option(...)`` is one command-line flag (``--max-running``), one
config-file key and ``LIFECYCLE_*`` variable (``lifecycle/config.py``), one keyword of
``Engine(...)`` (``max_running=``) and the ``AppConfig`` field of that name: its name,
type (the field's annotation), default, help and checks are written there and nowhere
else. ``forwarded(...)`` fields are the worker's options (``wire.worker_options``: help,
type and checks are the worker's), which ``lifecycle serve`` passes on. ``fed_by(...)``
fields are computed from the options they list (``--api-key`` and ``--api-key-file`` make
``api_keys``; ``runtime.app_config`` says how); ``_PROCESS`` options set up the process
(logging, a fault plan), not the app. The declarators and the ``Option`` they make are in
``lifecycle/option_fields.py``. ``OPTIONS`` is all of them, in ``--help``'s order, made
from these declarations; ``lifecycle/option_args.py`` makes them flags and checks the
Engine's keywords. Options marked ``server`` are about the HTTP listener and its clients
(address, TLS, keys, timeouts of a socket): the Engine has none and refuses them by name.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from lifecycle.core.buffers import ADMISSION_BOUND
from lifecycle.core.origin import DEFAULT_PUBLIC_ROUTES
from lifecycle.core.states import DRAIN
from lifecycle.link.pool import POLICIES as ROUTER_POLICIES
from lifecycle.models import ModelSpec
from lifecycle.option_fields import Option, declared, fed_by, forwarded, option
from lifecycle.tracing.tracer import TraceConfig

__all__ = ["MODEL_WORKER", "OPTIONS", "SCRIPTED_WORKER", "AppConfig"]


def _known(kind: str, name: str) -> str:
    """A parser name the API knows (argparse reports the ``ValueError``'s list)."""
    if kind == "reasoning":
        from lifecycle.chat.reasoning import reasoning_format as lookup
    else:
        from lifecycle.chat.tool_formats import tool_format as lookup  # type: ignore[assignment]
    try:
        lookup(name)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return name


_MODEL, _WORKER, _REQ, _HTTP, _TRACE = (
    "model",
    "the worker",
    "requests",
    "the HTTP server",
    "traces and debug routes",
)
_SWITCH: dict[str, Any] = {"type": None, "default": False}
# The worker modules spawned by name (python -m ...; never imported here): the model's,
# and the scripted one of --scripted-worker.
MODEL_WORKER, SCRIPTED_WORKER = "gpu.worker", "lifecycle.testing.scripted_worker"
_TRACED = TraceConfig()  # the tracer's defaults, which its options take


@dataclass(frozen=True, slots=True)
class AppConfig:
    """What serves requests (``lifecycle.runtime.Runtime``), and the schema of the options
    that set it; the fields without a declarator are set by the code that builds it."""

    model: str | None = option(
        "a GGUF file, a Hugging Face folder (config.json, *.safetensors, tokenizer.json), "
        "or a Hub repo id ORG/NAME[:QUANT] fetched into the Hugging Face cache (HF_HOME, "
        "HF_HUB_CACHE, HF_TOKEN, HF_HUB_OFFLINE): a GGUF repo's file by its quant tag "
        "(default Q4_K_M, or its one file), a safetensors repo's config, tokenizer and "
        "weights (default: the bundled SmolLM2-135M-Instruct); repeatable: each further "
        "--model is served beside the first, by its own workers, chosen by the request's "
        "model; NAME=SPEC names one in the APIs",
        _MODEL,
        repeat=True,
    )  # in the config: the first one's local path (a Hub repo id resolved); None: SmolLM2
    revision: str | None = option("the Hub repo's branch, tag or commit (default: main)", _MODEL)
    hf_file: str | None = option(
        "the GGUF file of the Hub repo to serve, by its path in the repo (instead of :QUANT)",
        _MODEL,
        metavar="FILE",
    )
    served_model_name: str | None = option(
        "the model's id in the APIs (default: the repo id, or the file or folder's name)",
        _MODEL,
    )
    model_repo: str | None = None  # the Hub repo ``model`` was fetched from (its id)
    more_models: tuple[ModelSpec, ...] = fed_by(  # and --model repeated: beside the first
        Option(
            "models_dir",
            "a folder whose every GGUF file and model folder (config.json) is a model, "
            "served beside --model and named by its file or folder name (sorted by name)",
            _MODEL,
            server=True,
            metavar="DIR",
        ),
        default=(),
    )
    models_max: int | None = option(
        "models loaded at once (default: all): the first N load at start, another is "
        "loaded when a request names it, the least recently used one without requests "
        "in flight unloaded to make room",
        _MODEL,
        server=True,
        minimum=1,
        metavar="N",
    )
    sleep_idle_seconds: float | None = option(
        "unload a model (its workers stop, their memory given back) once it had no "
        "request for this long; the next request loads it again (default: never)",
        _MODEL,
        server=True,
        minimum=0.001,
        metavar="S",
    )
    weight_version: str = option(
        "the weights' version, reported as meta_info.weight_version and by /model_info",
        _MODEL,
        default="default",
    )  # fmt: skip
    strict_model_name: bool = option(
        "another model name gets 404 model_not_found (default: the "
        "one model serves any name, as SGLang)",
        _MODEL,
        server=True,
        **_SWITCH,
    )  # fmt: skip
    worker: str | tuple[str, ...] | None = option(
        "use a worker started elsewhere (unix:/path, tcp:HOST:PORT or tls:HOST:PORT; "
        "repeatable, and mixes with --dp)",
        _WORKER,
        repeat=True,
    )  # fmt: skip
    ray: str | None = option(
        "place the --dp N workers on a Ray cluster as actors that Ray restarts: ADDRESS "
        "is a cluster's (host:port, ray://...), auto (RAY_ADDRESS or the one running "
        "here), or local, the default: a cluster of this machine alone (pip install "
        "lifecycle[ray])",
        _WORKER,
        server=True,
        metavar="ADDRESS",
        const="local",
    )
    ray_replica_resources: str | None = option(
        'the Ray resources each replica asks for, a JSON object (default: {"GPU": 1} '
        'where the cluster has GPUs, else {"CPU": 1})',
        _WORKER,
        server=True,
        metavar="JSON",
    )
    ray_autoscale: str | None = option(
        "with --ray: grow and shrink the replicas between MIN and MAX on the queue "
        "(one more while more than --ray-autoscale-queue requests per ready replica wait, "
        "one fewer, drained first, while the load fits one fewer; --dp: the count at "
        "start, default MIN)",
        _WORKER,
        server=True,
        metavar="MIN:MAX",
        form=(r"\s*\d+\s*:\s*\d+\s*", "MIN:MAX replicas, e.g. 1:4"),
    )
    ray_autoscale_queue: float | None = option(
        "--ray-autoscale: requests waiting per ready replica (held beyond what it runs "
        "at once) that ask for one more (default 1)",
        _WORKER,
        server=True,
        minimum=0,
    )
    ray_autoscale_after: str | None = option(
        "--ray-autoscale: seconds the queue stays long before one more replica, and "
        "the load stays low before one fewer (default 10:60)",
        _WORKER,
        server=True,
        metavar="UP:DOWN",
        form=(r"\s*[0-9.]+\s*:\s*[0-9.]+\s*", "UP:DOWN seconds, e.g. 10:60"),
    )
    worker_token: str | None = option(
        "the secret remote workers check (default: $LIFECYCLE_WORKER_TOKEN)",
        _WORKER,
    )  # fmt: skip
    worker_tls_ca: str | None = option(
        "CA file that tls: workers' certificates are checked with",
        _WORKER,
        metavar="FILE",
    )  # None: the system's CAs
    device: str | None = forwarded(_WORKER)
    dtype: str | None = forwarded(_WORKER)
    weights: str | None = forwarded(_WORKER)
    context_length: int | None = forwarded(_MODEL)  # tokens served; None: the model's own
    chat_template: str | None = option(
        "a Jinja chat template file used instead of the model's (transformers' dialect)",
        _MODEL,
        metavar="FILE",
    )  # fmt: skip
    reasoning_parser: str | None = option(
        "split <think> reasoning out of chat replies as reasoning_content: qwen3, "
        "qwen3-thinking, deepseek-r1, deepseek-v3, glm45, step3, minimax, kimi (default: "
        "qwen3 when the chat template writes <think>, else none)",
        _MODEL,
        type=lambda name: _known("reasoning", name),
    )  # fmt: skip
    tool_call_parser: str | None = option(
        "the tool-call format read from replies and forced by tool_choice (SGLang's names): "
        "qwen25 (qwen, hermes), llama3, pythonic (llama4), mistral, deepseekv3 (deepseek), "
        "deepseekv31, qwen3_coder, glm45 (glm), kimi_k2, phi4_mini_json (default: the one "
        "the chat template writes, else qwen25)",
        _MODEL,
        type=lambda name: _known("tools", name),
    )  # fmt: skip
    max_pending: int | None = forwarded(_WORKER)
    max_running: int | None = forwarded(_WORKER)
    kv_cache_tokens: int | None = forwarded(_WORKER)
    kv_memory_mib: int | None = forwarded(_WORKER)
    kv_cache_dtype: str | None = forwarded(_WORKER)
    prefix_cache_dir: str | None = forwarded(_WORKER)
    prefix_cache_disk_mib: int | None = forwarded(_WORKER)
    speculative: str | None = forwarded(_WORKER)
    speculative_tokens: int | None = forwarded(_WORKER)
    speculative_draft: str | None = forwarded(_WORKER)
    speculative_ngram_min: int | None = forwarded(_WORKER)
    speculative_ngram_max: int | None = forwarded(_WORKER)
    mem_fraction: float | None = forwarded(_WORKER)
    decode_graphs: str | None = forwarded(_WORKER)
    overlap: str | None = forwarded(_WORKER)
    mixed_graphs: str | None = forwarded(_WORKER)
    kernels: str | None = forwarded(_WORKER)
    tp: int | None = forwarded(_WORKER)
    threads: int | None = forwarded(_WORKER)
    dp: int | None = option(
        "spawn this many workers, one router in front (data parallel; default 1, or 0 "
        "with --worker)",
        _WORKER,
        minimum=0,
    )  # fmt: skip
    router_policy: str = option(
        "how a call picks its worker: " + " | ".join(ROUTER_POLICIES),
        _WORKER,
        default="cache_aware",
        choices=ROUTER_POLICIES,
    )  # fmt: skip
    worker_module: str = fed_by(
        Option("scripted_worker", "spawn the scripted worker (no model; for tests)", _WORKER,
               **_SWITCH),
        default=MODEL_WORKER,
    )  # fmt: skip
    worker_extra_args: tuple[str, ...] = fed_by(
        Option(
            "worker_args",
            "extra options for the spawned worker, as one shell-quoted string",
            _WORKER,
            default="",
        ),
        default=(),
    )
    restart_backoff: tuple[float, ...] | None = option(
        "seconds between worker restarts, comma-separated (the last one repeats)",
        _WORKER,
        type=str,
    )  # None: SupervisorConfig's default
    hung_timeout: float = option(
        "seconds without progress before the worker counts as hung",
        _WORKER,
        default=60.0,
        minimum=0.1,
    )  # fmt: skip
    warmup: bool = True
    max_queued: int = option(
        "requests admitted and not yet dispatched; beyond: 503",
        _REQ,
        default=ADMISSION_BOUND,
        minimum=1,
    )  # fmt: skip
    incremental_streaming_output: bool = option(
        "stream deltas, not cumulative text", _REQ, **_SWITCH
    )
    strict_fields: bool = option(
        "refuse (400) a request with a body field this server does not know; by default"
        " it is ignored, logged once per field and counted (the first 64 names; others"
        " together)",
        _REQ,
        **_SWITCH,
    )  # fmt: skip
    request_timeout: float | None = option(
        "seconds a request may take from arrival to its end before it ends 504 (deadline);"
        " a client's X-Request-Timeout header sets its own",
        _REQ,
        minimum=0.001,
    )  # fmt: skip
    host: str = option("address to listen on", _HTTP, default="127.0.0.1", server=True)
    port: int = option(
        "port to listen on (0: any free one)",
        _HTTP,
        default=30000,
        server=True,
        minimum=0,
        maximum=65535,
    )
    frontends: int = option(
        "frontend processes on the one port (SO_REUSEPORT), sharing the workers; one "
        "that dies ends only its own requests and is started again",
        _HTTP,
        default=1,
        server=True,
        minimum=1,
    )  # lifecycle/frontends.py
    frontend_index: int | None = None  # which of --frontends N this process is; None: alone
    frontends_dir: str | None = None  # --frontends N: the folder where their metrics meet
    reuse_port: bool = option(
        "share the port with other processes (SO_REUSEPORT; what --frontends sets)",
        _HTTP,
        server=True,
        **_SWITCH,
    )  # fmt: skip
    send_timeout: float = option(
        "seconds a client (or an Engine stream's consumer) may stall a send",
        _HTTP,
        default=30.0,
        minimum=0.001,
    )  # fmt: skip
    drain_timeout: float = option(
        "on SIGTERM/SIGINT, seconds in-flight requests may take before they are ended",
        _HTTP,
        default=DRAIN.timeout_s,
        server=True,
        minimum=0,
    )
    api_keys: tuple[str, ...] = fed_by(
        Option("api_key", "accept this API key (repeatable)", _HTTP, repeat=True, server=True),
        Option("api_key_file", "API keys, one per line", _HTTP, server=True),
        default=(),
    )
    admin_api_keys: tuple[str, ...] = fed_by(  # also guard /debug/* (AppRouter: admin)
        Option(
            "admin_api_key",
            "key for the abort/flush/debug routes (repeatable; also valid everywhere)",
            _HTTP,
            repeat=True,
            server=True,
        ),
        default=(),
    )
    public_routes: tuple[str, ...] = fed_by(
        Option(
            "public_route",
            "a route that needs no key (repeatable; default: "
            + " and ".join(DEFAULT_PUBLIC_ROUTES)
            + ")",
            _HTTP,
            repeat=True,
            server=True,
        ),
        Option("no_public_routes", "every route needs a key", _HTTP, server=True, **_SWITCH),
        default=DEFAULT_PUBLIC_ROUTES,
    )
    ssl_certfile: str | None = option("TLS certificate (PEM)", _HTTP, server=True)
    ssl_keyfile: str | None = option("TLS private key (PEM)", _HTTP, server=True)
    debug_routes: bool = fed_by(  # /debug, /debug/requests, /debug/feed (docs/tracing.md)
        Option("disable_debug_routes", "no /debug routes", _HTTP, server=True, **_SWITCH),
        default=True,
    )
    open_admin_routes: bool = option(
        "with --api-key and no --admin-api-key, let every key use the abort/flush/debug "
        "routes (local use; they are closed otherwise)",
        _HTTP,
        server=True,
        **_SWITCH,
    )
    trace: TraceConfig = fed_by(  # ring size, --trace-log and its rotation
        Option("trace_log", "write one JSON line per finished request", _TRACE),
        Option("trace_log_max_bytes", "rotate past this", _TRACE, type=int,
               default=_TRACED.log_max_bytes, minimum=1),
        Option("trace_log_backups", "rotated files kept", _TRACE, type=int,
               default=_TRACED.log_backups, minimum=0),
        Option("trace_ring_size", "finished traces kept", _TRACE, type=int,
               default=_TRACED.ring_size, minimum=1),
        Option(
            "trace_prompts",
            "record each finished request's prompt and output token ids, sampling "
            "parameters and model identity in its trace, so that `lifecycle trace replay` "
            "can rerun it (off by default: prompts may be private)",
            _TRACE,
            type=None,
            default=_TRACED.record_prompts,
        ),
        default=_TRACED,
    )  # fmt: skip
    otlp_traces_endpoint: str | None = option(
        "export one OpenTelemetry span per request to this OTLP/HTTP endpoint "
        "(e.g. http://127.0.0.1:4318/v1/traces; needs the otel extra)",
        _TRACE,
    )  # docs/monitoring.md
    access_log: str | None = option(
        "one line per finished request: '-' (stderr) or a file", _HTTP, server=True
    )  # fmt: skip
    access_log_format: str = option(
        "json | common",
        _HTTP,
        default="json",
        server=True,
        choices=("json", "common"),
    )
    log_requests: bool = option(
        "put the prompt text in access log lines", _HTTP, server=True, **_SWITCH
    )
    extend: tuple[str, ...] = option(
        "call MODULE:FUNCTION with the app's router before serving, so it adds its own "
        "routes with the built-in ones' keys, ids, metrics and access log (repeatable; "
        "docs/operating.md)",
        _HTTP,
        default=(),
        repeat=True,
        server=True,
        metavar="MODULE:FUNCTION",
    )  # lifecycle/extend.py
    cors_allow_origins: tuple[str, ...] = option(
        "answer CORS requests from this origin ('*': any; repeatable or comma-separated;"
        " default: no CORS headers)",
        _HTTP,
        default=(),
        repeat=True,
        server=True,
        metavar="ORIGIN",
    )  # fmt: skip
    extra: dict[str, Any] = field(default_factory=dict)


# Options of the serving process, not of the app: ``lifecycle serve`` sets up its logging
# and installs the fault plan (the Engine the plan) before it builds the ``AppConfig``.
_PROCESS = (
    Option(
        "faults",
        "fault plan (JSON, wire.faults) for chaos runs; the spawned worker loads it too",
        _WORKER,
        metavar="FILE",
    ),
    Option(
        "log_level",
        "logging level: debug | info | warning | error | critical",
        _HTTP,
        default="info",
        server=True,
        form=(r"(?i)debug|info|warning|error|critical", "debug, info, warning, error or critical"),
    ),
)

OPTIONS: tuple[Option, ...] = (*declared(AppConfig), *_PROCESS)
