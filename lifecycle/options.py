"""The options of ``lifecycle serve`` and of ``lifecycle.Engine``, defined once.

Each ``Option`` is one command-line flag (``--max-running``) and one keyword of
``Engine(...)`` (``max_running=``); ``app_config`` turns a full set of values (the
parsed flags, or the Engine's keywords over the defaults) into the ``AppConfig`` both
run on. Options marked ``server`` are about the HTTP listener and its clients (address,
TLS, keys, timeouts of a socket): the Engine has none and refuses them by name.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lifecycle.core.buffers import ADMISSION_BOUND
from lifecycle.core.origin import DEFAULT_PUBLIC_ROUTES
from lifecycle.core.states import DRAIN
from lifecycle.link.pool import POLICIES as ROUTER_POLICIES
from wire.worker_options import WORKER_OPTIONS, WorkerOption, refused_value, value_parser

__all__ = [
    "OPTIONS",
    "Option",
    "add_flags",
    "engine_values",
    "option_values",
    "read_key_file",
]


@dataclass(frozen=True, slots=True)
class Option:
    name: str  # the Engine keyword; the flag is --name-with-dashes
    help: str
    group: str
    type: Callable[[str], Any] | None = str  # None: a switch (store_true)
    default: Any = None
    repeat: bool = False  # the flag may be given several times (a list)
    server: bool = False  # the HTTP listener's: not an Engine option
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    minimum: float | None = None
    maximum: float | None = None
    form: tuple[str, str] | None = None  # a pattern the value matches, and it in words
    worker: WorkerOption | None = None  # a forwarded option: the worker's, whose checks apply
    const: Any = None  # the flag's value when given without one (``--ray`` alone)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def refused(self, value: Any) -> str | None:
        """Why ``value`` is not one this option takes (``refused_value``), or None; a list
        (a repeated flag) item by item."""
        if self.worker is not None:
            return self.worker.refused(value)
        for item in value if isinstance(value, list | tuple) else [value]:
            why = refused_value(item, self.choices, self.minimum, self.maximum, self.form)
            if why is not None:
                return why
        return None

    def parse(self, text: str) -> Any:
        """A flag's text as the option's value (``wire.worker_options.value_parser``)."""
        assert self.type is not None
        return value_parser(self.type, self.refused)(text)


def _o(name: str, help: str, group: str, **kw: Any) -> Option:
    return Option(name, help, group, **kw)


def _forwarded(name: str, group: str) -> Option:
    """A worker option ``lifecycle serve`` offers and passes on (``runtime.worker_args``):
    its help and type are the worker's (``wire.worker_options``); unset, the worker's own
    default applies."""
    o = _WORKER_OPTIONS[name]
    assert o.forwarded, name
    choices = f"{' | '.join(o.choices)}: " if o.choices else ""
    return Option(name, choices + o.help_with_default, group, type=o.type, worker=o)


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


def read_key_file(path: str | Path) -> tuple[str, ...]:
    """``--api-key-file``: one key per line; blank lines and ``#`` comments are skipped."""
    keys = []
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keys.append(line)
    return tuple(keys)


_WORKER_OPTIONS = {o.name: o for o in WORKER_OPTIONS}
_MODEL, _WORKER, _REQ, _HTTP, _TRACE = (
    "model",
    "the worker",
    "requests",
    "the HTTP server",
    "traces and debug routes",
)
_SWITCH: dict[str, Any] = {"type": None, "default": False}

OPTIONS: tuple[Option, ...] = (
    _o(
        "model",
        "a GGUF file, a Hugging Face folder (config.json, *.safetensors, tokenizer.json), "
        "or a Hub repo id ORG/NAME[:QUANT] fetched into the Hugging Face cache (HF_HOME, "
        "HF_HUB_CACHE, HF_TOKEN, HF_HUB_OFFLINE): a GGUF repo's file by its quant tag "
        "(default Q4_K_M, or its one file), a safetensors repo's config, tokenizer and "
        "weights (default: the bundled SmolLM2-135M-Instruct); repeatable: each further "
        "--model is served beside the first, by its own workers, chosen by the request's "
        "model; NAME=SPEC names one in the APIs",
        _MODEL,
        repeat=True,
    ),
    _o("revision", "the Hub repo's branch, tag or commit (default: main)", _MODEL),
    _o(
        "hf_file",
        "the GGUF file of the Hub repo to serve, by its path in the repo (instead of :QUANT)",
        _MODEL,
        metavar="FILE",
    ),
    _o(
        "served_model_name",
        "the model's id in the APIs (default: the repo id, or the file or folder's name)",
        _MODEL,
    ),
    _o(
        "models_dir",
        "a folder whose every GGUF file and model folder (config.json) is a model, "
        "served beside --model and named by its file or folder name (sorted by name)",
        _MODEL,
        server=True,
        metavar="DIR",
    ),
    _o(
        "models_max",
        "models loaded at once (default: all): the first N load at start, another is "
        "loaded when a request names it, the least recently used one without requests "
        "in flight unloaded to make room",
        _MODEL,
        type=int,
        server=True,
        minimum=1,
        metavar="N",
    ),
    _o(
        "sleep_idle_seconds",
        "unload a model (its workers stop, their memory given back) once it had no "
        "request for this long; the next request loads it again (default: never)",
        _MODEL,
        type=float,
        server=True,
        minimum=0.001,
        metavar="S",
    ),
    _o(
        "weight_version",
        "the weights' version, reported as meta_info.weight_version and by /model_info",
        _MODEL,
        default="default",
    ),  # fmt: skip
    _o(
        "strict_model_name",
        "another model name gets 404 model_not_found (default: the "
        "one model serves any name, as SGLang)",
        _MODEL,
        server=True,
        **_SWITCH,
    ),  # fmt: skip
    _o(
        "worker",
        "use a worker started elsewhere (unix:/path, tcp:HOST:PORT or tls:HOST:PORT; "
        "repeatable, and mixes with --dp)",
        _WORKER,
        repeat=True,
    ),  # fmt: skip
    _o(
        "ray",
        "place the --dp N workers on a Ray cluster as actors that Ray restarts: ADDRESS "
        "is a cluster's (host:port, ray://...), auto (RAY_ADDRESS or the one running "
        "here), or local, the default: a cluster of this machine alone (pip install "
        "lifecycle[ray])",
        _WORKER,
        server=True,
        metavar="ADDRESS",
        const="local",
    ),
    _o(
        "ray_replica_resources",
        'the Ray resources each replica asks for, a JSON object (default: {"GPU": 1} '
        'where the cluster has GPUs, else {"CPU": 1})',
        _WORKER,
        server=True,
        metavar="JSON",
    ),
    _o(
        "ray_autoscale",
        "with --ray: grow and shrink the replicas between MIN and MAX on the queue "
        "(one more while more than --ray-autoscale-queue requests per ready replica wait, "
        "one fewer, drained first, while the load fits one fewer; --dp: the count at "
        "start, default MIN)",
        _WORKER,
        server=True,
        metavar="MIN:MAX",
        form=(r"\s*\d+\s*:\s*\d+\s*", "MIN:MAX replicas, e.g. 1:4"),
    ),
    _o(
        "ray_autoscale_queue",
        "--ray-autoscale: requests waiting per ready replica (held beyond what it runs "
        "at once) that ask for one more (default 1)",
        _WORKER,
        server=True,
        type=float,
        minimum=0,
    ),
    _o(
        "ray_autoscale_after",
        "--ray-autoscale: seconds the queue stays long before one more replica, and "
        "the load stays low before one fewer (default 10:60)",
        _WORKER,
        server=True,
        metavar="UP:DOWN",
        form=(r"\s*[0-9.]+\s*:\s*[0-9.]+\s*", "UP:DOWN seconds, e.g. 10:60"),
    ),
    _o(
        "worker_token",
        "the secret remote workers check (default: $LIFECYCLE_WORKER_TOKEN)",
        _WORKER,
    ),  # fmt: skip
    _o(
        "worker_tls_ca",
        "CA file that tls: workers' certificates are checked with",
        _WORKER,
        metavar="FILE",
    ),  # fmt: skip
    _forwarded("device", _WORKER),
    _forwarded("dtype", _WORKER),
    _forwarded("weights", _WORKER),
    _forwarded("context_length", _MODEL),
    _o(
        "chat_template",
        "a Jinja chat template file used instead of the model's (transformers' dialect)",
        _MODEL,
        metavar="FILE",
    ),  # fmt: skip
    _o(
        "reasoning_parser",
        "split <think> reasoning out of chat replies as reasoning_content: qwen3, "
        "qwen3-thinking, deepseek-r1, deepseek-v3, glm45, step3, minimax, kimi (default: "
        "qwen3 when the chat template writes <think>, else none)",
        _MODEL,
        type=lambda name: _known("reasoning", name),
    ),  # fmt: skip
    _o(
        "tool_call_parser",
        "the tool-call format read from replies and forced by tool_choice (SGLang's names): "
        "qwen25 (qwen, hermes), llama3, pythonic (llama4), mistral, deepseekv3 (deepseek), "
        "deepseekv31, qwen3_coder, glm45 (glm), kimi_k2, phi4_mini_json (default: the one "
        "the chat template writes, else qwen25)",
        _MODEL,
        type=lambda name: _known("tools", name),
    ),  # fmt: skip
    _forwarded("max_pending", _WORKER),
    _forwarded("max_running", _WORKER),
    _forwarded("kv_cache_tokens", _WORKER),
    _forwarded("kv_memory_mib", _WORKER),
    _forwarded("kv_cache_dtype", _WORKER),
    _forwarded("mem_fraction", _WORKER),
    _forwarded("decode_graphs", _WORKER),
    _forwarded("overlap", _WORKER),
    _forwarded("mixed_graphs", _WORKER),
    _forwarded("kernels", _WORKER),
    _forwarded("tp", _WORKER),
    _forwarded("threads", _WORKER),
    _o(
        "dp",
        "spawn this many workers, one router in front (data parallel; default 1, or 0 "
        "with --worker)",
        _WORKER,
        type=int,
        minimum=0,
    ),  # fmt: skip
    _o(
        "router_policy",
        "how a call picks its worker: " + " | ".join(ROUTER_POLICIES),
        _WORKER,
        default="cache_aware",
        choices=ROUTER_POLICIES,
    ),  # fmt: skip
    _o("scripted_worker", "spawn the scripted worker (no model; for tests)", _WORKER, **_SWITCH),
    _o(
        "worker_args",
        "extra options for the spawned worker, as one shell-quoted string",
        _WORKER,
        default="",
    ),
    _o(
        "restart_backoff",
        "seconds between worker restarts, comma-separated (the last one repeats)",
        _WORKER,
    ),
    _o(
        "hung_timeout",
        "seconds without progress before the worker counts as hung",
        _WORKER,
        type=float,
        default=60.0,
        minimum=0.1,
    ),  # fmt: skip
    _o(
        "faults",
        "fault plan (JSON, wire.faults) for chaos runs; the spawned worker loads it too",
        _WORKER,
        metavar="FILE",
    ),
    _o(
        "max_queued",
        "requests admitted and not yet dispatched; beyond: 503",
        _REQ,
        type=int,
        default=ADMISSION_BOUND,
        minimum=1,
    ),  # fmt: skip
    _o("incremental_streaming_output", "stream deltas, not cumulative text", _REQ, **_SWITCH),
    _o(
        "strict_fields",
        "refuse (400) a request with a body field this server does not know; by default"
        " it is ignored, logged once per field and counted (the first 64 names; others"
        " together)",
        _REQ,
        **_SWITCH,
    ),  # fmt: skip
    _o(
        "request_timeout",
        "seconds a request may take from arrival to its end before it ends 504 (deadline);"
        " a client's X-Request-Timeout header sets its own",
        _REQ,
        type=float,
        minimum=0.001,
    ),  # fmt: skip
    _o("host", "address to listen on", _HTTP, default="127.0.0.1", server=True),
    _o(
        "port",
        "port to listen on (0: any free one)",
        _HTTP,
        type=int,
        default=30000,
        server=True,
        minimum=0,
        maximum=65535,
    ),
    _o(
        "frontends",
        "frontend processes on the one port (SO_REUSEPORT), sharing the workers; one "
        "that dies ends only its own requests and is started again",
        _HTTP,
        type=int,
        default=1,
        server=True,
        minimum=1,
    ),  # fmt: skip
    _o(
        "reuse_port",
        "share the port with other processes (SO_REUSEPORT; what --frontends sets)",
        _HTTP,
        server=True,
        **_SWITCH,
    ),  # fmt: skip
    _o(
        "send_timeout",
        "seconds a client (or an Engine stream's consumer) may stall a send",
        _HTTP,
        type=float,
        default=30.0,
        minimum=0.001,
    ),  # fmt: skip
    _o(
        "drain_timeout",
        "on SIGTERM/SIGINT, seconds in-flight requests may take before they are ended",
        _HTTP,
        type=float,
        default=DRAIN.timeout_s,
        server=True,
        minimum=0,
    ),
    _o(
        "log_level",
        "logging level: debug | info | warning | error | critical",
        _HTTP,
        default="info",
        server=True,
        form=(r"(?i)debug|info|warning|error|critical", "debug, info, warning, error or critical"),
    ),
    _o("api_key", "accept this API key (repeatable)", _HTTP, repeat=True, server=True),
    _o("api_key_file", "API keys, one per line", _HTTP, server=True),
    _o(
        "admin_api_key",
        "key for the abort/flush/debug routes (repeatable; also valid everywhere)",
        _HTTP,
        repeat=True,
        server=True,
    ),
    _o(
        "public_route",
        "a route that needs no key (repeatable; default: "
        + " and ".join(DEFAULT_PUBLIC_ROUTES)
        + ")",
        _HTTP,
        repeat=True,
        server=True,
    ),
    _o("no_public_routes", "every route needs a key", _HTTP, server=True, **_SWITCH),
    _o("ssl_certfile", "TLS certificate (PEM)", _HTTP, server=True),
    _o("ssl_keyfile", "TLS private key (PEM)", _HTTP, server=True),
    _o("disable_debug_routes", "no /debug routes", _HTTP, server=True, **_SWITCH),
    _o(
        "open_admin_routes",
        "with --api-key and no --admin-api-key, let every key use the abort/flush/debug "
        "routes (local use; they are closed otherwise)",
        _HTTP,
        server=True,
        **_SWITCH,
    ),
    _o("trace_log", "write one JSON line per finished request", _TRACE),
    _o("trace_log_max_bytes", "rotate past this", _TRACE, type=int, default=64 << 20, minimum=1),
    _o("trace_log_backups", "rotated files kept", _TRACE, type=int, default=3, minimum=0),
    _o("trace_ring_size", "finished traces kept", _TRACE, type=int, default=1000, minimum=1),
    _o(
        "trace_prompts",
        "record each finished request's prompt and output token ids, sampling parameters "
        "and model identity in its trace, so that `lifecycle trace replay` can rerun it "
        "(off by default: prompts may be private)",
        _TRACE,
        **_SWITCH,
    ),
    _o(
        "otlp_traces_endpoint",
        "export one OpenTelemetry span per request to this OTLP/HTTP endpoint "
        "(e.g. http://127.0.0.1:4318/v1/traces; needs the otel extra)",
        _TRACE,
    ),
    _o(
        "access_log", "one line per finished request: '-' (stderr) or a file", _HTTP, server=True
    ),  # fmt: skip
    _o(
        "access_log_format",
        "json | common",
        _HTTP,
        default="json",
        server=True,
        choices=("json", "common"),
    ),
    _o("log_requests", "put the prompt text in access log lines", _HTTP, server=True, **_SWITCH),
    _o(
        "extend",
        "call MODULE:FUNCTION with the app's router before serving, so it adds its own "
        "routes with the built-in ones' keys, ids, metrics and access log (repeatable; "
        "docs/operating.md)",
        _HTTP,
        repeat=True,
        server=True,
        metavar="MODULE:FUNCTION",
    ),
    _o(
        "cors_allow_origins",
        "answer CORS requests from this origin ('*': any; repeatable or comma-separated;"
        " default: no CORS headers)",
        _HTTP,
        repeat=True,
        server=True,
        metavar="ORIGIN",
    ),  # fmt: skip
)
_BY_NAME = {o.name: o for o in OPTIONS}


def add_flags(parser: argparse.ArgumentParser, *, server: bool = True) -> None:
    """Every option as a flag of ``parser``, in its group (``server=False``: the
    Engine's, without the HTTP listener's)."""
    groups: dict[str, Any] = {}
    for o in OPTIONS:
        if o.server and not server:
            continue
        g = groups.get(o.group) or groups.setdefault(o.group, parser.add_argument_group(o.group))
        if o.type is None:
            g.add_argument(o.flag, action="store_true", help=o.help)
        elif o.repeat:
            g.add_argument(o.flag, action="append", default=None, type=o.parse, help=o.help)
        elif o.const is not None:
            g.add_argument(
                o.flag, nargs="?", const=o.const, type=o.parse, default=o.default, help=o.help,
                metavar=o.metavar or _meta(o),
            )  # fmt: skip
        else:
            shown = o.help if o.default in (None, "") else f"{o.help} (default: %(default)s)"
            g.add_argument(
                o.flag, type=o.parse, default=o.default, help=shown, metavar=o.metavar or _meta(o)
            )


def _meta(o: Option) -> str:
    """The flag's placeholder in --help: its choices, else its name."""
    return (
        "{" + ",".join(o.worker.choices) + "}" if o.worker and o.worker.choices else o.name.upper()
    )


def option_values(args: argparse.Namespace, *, server: bool = True) -> dict[str, Any]:
    """The options' values from parsed flags (``server=False``: as ``add_flags``)."""
    return {o.name: getattr(args, o.name) for o in OPTIONS if server or not o.server}


def engine_values(model: str | None, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The Engine's keywords over the defaults; an unknown or server-only one is a
    TypeError that names it (and the nearest option)."""
    for name in kwargs:
        o = _BY_NAME.get(name)
        if o is None:
            near = difflib.get_close_matches(name, list(_BY_NAME), n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise TypeError(f"Engine() got an unknown option {name!r}{hint}")
        if o.server:
            raise TypeError(f"{name!r} is an option of the HTTP server; the Engine has none")
        if (why := o.refused(kwargs[name])) is not None:
            raise ValueError(f"Engine() option {name!r}: {why}")
    values = {o.name: o.default for o in OPTIONS}
    return {**values, **kwargs, "model": model if model is not None else kwargs.get("model")}
