"""Command line: ``lifecycle serve``, ``lifecycle worker``, ``lifecycle generate``."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import runpy
import shlex
import signal
import sys
from typing import TYPE_CHECKING

from lifecycle.core.states import DRAIN
from lifecycle.tracing.cli import add_serve_options, add_trace_parser, run_trace, serve_options

if TYPE_CHECKING:
    from lifecycle.app import AppConfig

__all__ = ["main"]


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lifecycle", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="print a greedy continuation of a prompt (offline)")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None, help="GGUF file (default: bundled SmolLM2)")
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--device", default=None)

    srv = sub.add_parser("serve", help="serve the SGLang-native HTTP API")
    srv.add_argument("--model", default=None, help="GGUF file (default: bundled SmolLM2)")
    srv.add_argument("--served-model-name", default=None)
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=30000)
    _add_worker_flags(srv)
    _add_request_flags(srv)
    srv.add_argument(
        "--faults",
        default=None,
        metavar="FILE",
        help="fault plan (JSON, wire.faults) for chaos runs; the spawned worker loads it too",
    )
    srv.add_argument("--log-level", default="info")
    _add_edge_flags(srv)
    add_serve_options(srv)

    wrk = sub.add_parser("worker", help="run a standalone model worker (gpu.worker)")
    wrk.add_argument("--listen", required=True, help="unix:/path or tcp:HOST:PORT")
    add_trace_parser(sub)
    return parser


def _add_worker_flags(srv: argparse.ArgumentParser) -> None:
    """Which worker ``serve`` drives, and what it may hold."""
    srv.add_argument(
        "--worker", default=None, help="use a worker started elsewhere (unix:/path or HOST:PORT)"
    )
    srv.add_argument("--device", default=None, help="cpu | cuda (default: cuda when present)")
    srv.add_argument("--dtype", default=None)
    srv.add_argument(
        "--max-pending",
        type=int,
        default=None,
        help="requests the worker may hold (running + waiting)",
    )
    srv.add_argument("--max-running", type=int, default=None)
    srv.add_argument("--kv-cache-tokens", type=int, default=None)
    srv.add_argument(
        "--scripted-worker",
        action="store_true",
        help="spawn the scripted worker (no model; for benchmarks and tests)",
    )
    srv.add_argument(
        "--worker-args",
        default="",
        help="extra options for the spawned worker, as one shell-quoted string",
    )
    srv.add_argument(
        "--restart-backoff",
        default=None,
        help="seconds between worker restarts, comma-separated (the last one repeats)",
    )


def _add_request_flags(srv: argparse.ArgumentParser) -> None:
    """Admission, streaming and the timeouts a request lives under."""
    srv.add_argument(
        "--max-queued",
        type=int,
        default=1024,
        help="requests admitted and not yet dispatched; beyond: 503",
    )
    srv.add_argument(
        "--incremental-streaming-output",
        action="store_true",
        help="stream deltas instead of cumulative text/output_ids",
    )
    srv.add_argument("--send-timeout", type=float, default=30.0)
    srv.add_argument("--hung-timeout", type=float, default=60.0)
    srv.add_argument(
        "--drain-timeout",
        type=float,
        default=DRAIN.timeout_s,
        help="on SIGTERM/SIGINT, seconds in-flight requests may take before they are ended",
    )


def _add_edge_flags(srv: argparse.ArgumentParser) -> None:
    srv.add_argument(
        "--api-key", action="append", default=[], help="accept this API key (repeatable)"
    )
    srv.add_argument("--api-key-file", default=None, help="API keys, one per line")
    srv.add_argument(
        "--admin-api-key",
        action="append",
        default=[],
        help="key for the abort/flush/debug routes (repeatable; also valid everywhere)",
    )
    srv.add_argument(
        "--public-route",
        action="append",
        default=None,
        help="a route that needs no key (repeatable; default: /health and /metrics)",
    )
    srv.add_argument("--no-public-routes", action="store_true", help="every route needs a key")
    srv.add_argument("--ssl-certfile", default=None)
    srv.add_argument("--ssl-keyfile", default=None)


def _edge_options(args: argparse.Namespace) -> dict[str, object]:
    from lifecycle.api.auth import DEFAULT_PUBLIC_ROUTES, read_key_file

    keys = list(args.api_key)
    if args.api_key_file:
        keys += read_key_file(args.api_key_file)
    public: tuple[str, ...] = tuple(args.public_route or DEFAULT_PUBLIC_ROUTES)
    return {
        "api_keys": tuple(keys),
        "admin_api_keys": tuple(args.admin_api_key),
        "public_routes": () if args.no_public_routes else public,
        "ssl_certfile": args.ssl_certfile,
        "ssl_keyfile": args.ssl_keyfile,
    }


def _serve(args: argparse.Namespace) -> int:
    import anyio

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    if args.faults:
        _install_faults(args.faults)
    anyio.run(_run_until_signalled, _app_config(args))
    return 0


def _app_config(args: argparse.Namespace) -> AppConfig:
    from lifecycle.app import AppConfig

    return AppConfig(
        host=args.host,
        port=args.port,
        model=args.model,
        served_model_name=args.served_model_name,
        worker=args.worker,
        worker_module="lifecycle.testing.scripted_worker" if args.scripted_worker else "gpu.worker",
        worker_extra_args=tuple(shlex.split(args.worker_args)),
        device=args.device,
        dtype=args.dtype,
        max_pending=args.max_pending,
        max_running=args.max_running,
        kv_cache_tokens=args.kv_cache_tokens,
        max_queued=args.max_queued,
        incremental_streaming_output=args.incremental_streaming_output,
        send_timeout=args.send_timeout,
        hung_timeout=args.hung_timeout,
        drain_timeout=args.drain_timeout,
        restart_backoff=(
            tuple(float(x) for x in args.restart_backoff.split(","))
            if args.restart_backoff
            else None
        ),
        **_edge_options(args),  # type: ignore[arg-type]
        **serve_options(args),
    )


async def _run_until_signalled(cfg: AppConfig) -> None:
    """Serve ``cfg``. The first SIGTERM/SIGINT drains (App.drain), a second one stops at
    once; either way the app is then cancelled, so the worker gets SHUTDOWN and is reaped."""
    import anyio

    from lifecycle.app import App, serve_app

    async with anyio.create_task_group() as tg:
        apps: list[App] = []

        async def stop_after_drain() -> None:
            await apps[0].drain()
            tg.cancel_scope.cancel()

        async def watch_signals() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    if not apps or apps[0].frontend.draining:
                        tg.cancel_scope.cancel()
                        return
                    tg.start_soon(stop_after_drain)

        tg.start_soon(watch_signals)
        apps.append(await tg.start(serve_app, cfg))


def _install_faults(path: str) -> None:
    """This process and, through the environment, the worker it spawns (which reads the
    file again at each start). SIGHUP reloads the file here: a chaos run changes the
    plan of a live frontend without a restart."""
    import os

    from wire import faults

    faults.install(faults.load_plan(path))
    os.environ[faults.ENV_VAR] = os.path.abspath(path)

    def reload(signum: int, frame: object) -> None:
        try:
            faults.install(faults.load_plan(path))
        except (OSError, ValueError, TypeError) as exc:
            logging.getLogger("lifecycle.faults").error("fault plan not reloaded: %s", exc)

    signal.signal(signal.SIGHUP, reload)


def run_worker_module(module: str, argv: list[str]) -> int:
    """Run a ``gpu`` entry point (``gpu.worker``, ``gpu.generate``) by module name, so that
    this package never imports the worker: ``python -m module argv``, in this process."""
    if importlib.util.find_spec("torch") is None:
        print(
            f"error: {module} needs torch, which this install lacks; "
            "install the worker extra: pip install 'lifecycle[worker]'",
            file=sys.stderr,
        )
        return 2
    sys.argv = [module, *argv]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


def main(argv: list[str] | None = None) -> int:
    args, rest = _build_parser().parse_known_args(argv)
    if args.command == "worker":
        return run_worker_module("gpu.worker", ["--listen", args.listen, *rest])
    if rest:
        print(f"unrecognized arguments: {' '.join(rest)}", file=sys.stderr)
        return 2
    if args.command == "serve":
        return _serve(args)
    if args.command == "generate":
        gen = [args.prompt, "--max-new-tokens", str(args.max_new_tokens)]
        gen += ["--model", args.model] if args.model else []
        gen += ["--device", args.device] if args.device else []
        gen += ["--chat"] if args.chat else []
        return run_worker_module("gpu.generate", gen)
    if args.command == "trace":
        return run_trace(args)
    print(f"unknown command {args.command}", file=sys.stderr)
    return 2
