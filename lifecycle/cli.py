"""Command line: ``lifecycle serve``, ``lifecycle worker``, ``lifecycle generate``."""

from __future__ import annotations

import argparse
import functools
import importlib.util
import logging
import os
import runpy
import signal
import sys
from typing import TYPE_CHECKING

from lifecycle.option_args import add_flags, option_values
from lifecycle.options import MODEL_WORKER
from lifecycle.runtime import app_config
from lifecycle.tracing.cli import add_trace_parser, run_trace
from wire.worker_options import OneLineParser

if TYPE_CHECKING:
    from lifecycle.app import AppConfig
    from modelfile.check import CheckedModel

__all__ = ["main"]


_CONFIG_HELP = (
    "options from a TOML (or YAML) file; LIFECYCLE_<OPTION> variables override it, flags both"
)


def _build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="lifecycle", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    # gpu.worker.generate's own parser reads the rest (its flags, --help and errors): not restated
    sub.add_parser(
        "generate", add_help=False, help="print a greedy continuation of a prompt (offline)"
    )

    srv = sub.add_parser("serve", help="serve the SGLang-native and OpenAI HTTP APIs")
    srv.add_argument("--config", default=None, metavar="FILE", help=_CONFIG_HELP)
    add_flags(srv)  # lifecycle/options.py: the same options as Engine(...)

    bat = sub.add_parser("batch", help="answer a JSONL file of requests (resumable)")
    bat.add_argument("input", help="JSONL: OpenAI batch-file lines or /generate bodies")
    bat.add_argument("output", help="JSONL results; rerun with the same file to resume")
    bat.add_argument("--no-progress", action="store_true", help="no progress bar")
    bat.add_argument("--config", default=None, metavar="FILE", help=_CONFIG_HELP)
    add_flags(bat, server=False)  # the Engine's options

    wrk = sub.add_parser("worker", help="run a standalone model worker (gpu.worker)")
    wrk.add_argument(
        "--listen",
        required=True,
        help="unix:/path, tcp:HOST:PORT or tls:HOST:PORT (with --tls-cert); --token, "
        "--tls-cert, --tls-key, --tp and the model options go to gpu.worker",
    )
    add_trace_parser(sub)
    return parser


def _serve(args: argparse.Namespace, serve_argv: list[str]) -> int:
    import anyio

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    if args.faults:
        _install_faults(args.faults)
    from lifecycle.app import slot_configs
    from modelfile.check import check_model
    from modelfile.gguf_meta import ModelFileError

    try:  # before anything listens or spawns: one line, not a worker's traceback
        cfg = app_config(option_values(args))  # a Hub repo id fetched (modelfile.hub)
        slots = slot_configs(cfg)  # --model repeated: two under one name are refused
        models = tuple(check_model(c.model, c.context_length, c.chat_template) for c in slots)
    except (ModelFileError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    checks = (_refused_worker_options, _refused_device, _unresolved_extension, _port_taken)
    for refused in (*(check(cfg) for check in checks), _refused_backends(cfg, models)):
        if refused is not None:  # the worker's own rules, this torch, the port
            print(f"error: {refused}", file=sys.stderr)
            return 2
    if cfg.otlp_traces_endpoint:  # Runtime checks it too; here it stops with a message
        from lifecycle.tracing.otel import OtlpUnavailable, check_endpoint

        try:
            check_endpoint(cfg.otlp_traces_endpoint)
        except OtlpUnavailable as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if cfg.frontends > 1:  # this process runs the workers and the frontends, serves none
        from lifecycle.frontends import run_frontends

        return run_frontends(cfg, serve_argv)
    try:
        anyio.run(_run_until_signalled, cfg, models)
    except BaseException as exc:  # a start-up failure, however deep in the task groups
        if (failed := _startup_failure(exc)) is None:
            raise
        print(f"error: {failed}", file=sys.stderr)
        return 2
    return 0


def _startup_failure(exc: BaseException) -> BaseException | None:
    """The start-up failure (the worker refused to start, the port could not be bound)
    that ended the server, found in task groups' exception groups; None if none did."""
    from lifecycle.app import CannotListen
    from lifecycle.link.supervisor import WorkerRefusedToStart

    if isinstance(exc, WorkerRefusedToStart | CannotListen):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            if (found := _startup_failure(inner)) is not None:
                return found
    return None


def _unresolved_extension(cfg: AppConfig) -> str | None:
    """Why an ``--extend`` name cannot be called (lifecycle/extend.py), or None."""
    from lifecycle.extend import ExtensionError, resolve_extension

    for spec in cfg.extend:
        try:
            resolve_extension(spec)
        except ExtensionError as exc:
            return str(exc)
    return None


def _spawns_model_worker(cfg: AppConfig) -> bool:
    """Workers running models start here (not remote ones, not the scripted one)."""
    return cfg.worker_module == MODEL_WORKER and not (cfg.worker and not cfg.dp)


def _refused_device(cfg: AppConfig) -> str | None:
    """``--device cuda`` where the installed torch is a CPU build, known from its
    version (``2.13.0+cpu``) without importing it: the frontend never imports torch. A
    CUDA build on a machine without a card is the worker's to refuse (one line, exit 2)
    before this process binds its port."""
    if not (cfg.device or "").startswith("cuda") or not _spawns_model_worker(cfg):
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        return None  # lifecycle worker says to install the worker extra
    if "+cpu" in torch_version:
        return f"--device {cfg.device}: this torch ({torch_version}) is built without CUDA; use --device cpu"
    return None


def _port_taken(cfg: AppConfig) -> str | None:
    """Why ``--port`` cannot be listened on, found by binding it once before the workers
    start (unless the port is shared on purpose: ``--reuse-port``); None when it can."""
    import socket

    if cfg.port == 0 or cfg.reuse_port:
        return None
    try:
        infos = socket.getaddrinfo(cfg.host, cfg.port, type=socket.SOCK_STREAM)
    except OSError as exc:
        return f"--host {cfg.host}: {exc}"
    for family, kind, proto, _name, address in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the listener does
            try:
                s.bind(address)
            except OSError as exc:
                return f"--port {cfg.port}: cannot listen on {cfg.host}:{cfg.port}: {exc.strerror or exc}"
    return None


def _refused_worker_options(cfg: AppConfig) -> str | None:
    """Why the workers spawned here would refuse their options at start, before anything
    listens (``wire.worker_options.refused_combination``); None when they take them, or
    none is spawned (remote workers have their own options; the scripted one no model)."""
    from wire.worker_options import WORKER_OPTIONS, refused_combination

    if not _spawns_model_worker(cfg):
        return None
    forwarded = [o for o in WORKER_OPTIONS if o.forwarded]
    return refused_combination({o.name: getattr(cfg, o.serve_name or o.name) for o in forwarded})


def _refused_backends(cfg: AppConfig, models: tuple[CheckedModel, ...]) -> str | None:
    """Why a backend the options ask for (``--kernels triton``, ``--tp``, ``--decode-graphs
    on`` or ``eager``) cannot run a feature of a model's layers, before anything listens
    (``modelfile.layer_spec``: each backend's row; the worker refuses the same at start);
    None when every one runs every model, or no model worker is spawned here."""
    from modelfile.layer_spec import refusal, spec_of

    if not _spawns_model_worker(cfg):
        return None
    asked = [("torch", "")]
    if cfg.kernels == "triton":
        asked.append(("triton", "--kernels triton"))
    if (cfg.tp or 1) > 1:
        asked.append(("tp", f"--tp {cfg.tp}"))
    if cfg.decode_graphs in ("on", "eager"):
        asked.append(("graphs", f"--decode-graphs {cfg.decode_graphs}"))
    for model in models:
        spec = spec_of(model.config)
        for backend, option in asked:
            if (why := refusal(backend, spec)) is not None:
                by = f", asked for by {option}" if option else ""
                return f"{model.path}: {why}{by}"
    return None


async def _run_until_signalled(cfg: AppConfig, models: tuple[CheckedModel, ...]) -> None:
    """Serve ``cfg``. The first SIGTERM/SIGINT drains (App.drain), a second one stops at
    once; either way the app is then cancelled, so the worker gets SHUTDOWN and is reaped
    (the worker itself ignores both: ``wire/child.py``). Under the launcher of
    ``--frontends N`` the launcher decides: SIGTERM drains (once), ``CHILD_CUT`` stops at
    once, SIGINT (Ctrl-C, which reaches the launcher too) is ignored here."""
    import anyio

    from lifecycle.app import App, serve_app
    from lifecycle.frontends import CHILD_CUT, CHILD_DRAIN

    launched = cfg.frontend_index is not None
    if launched:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    watched = (CHILD_DRAIN, CHILD_CUT) if launched else (signal.SIGTERM, signal.SIGINT)
    async with anyio.create_task_group() as tg:
        apps: list[App] = []

        async def stop_after_drain() -> None:
            await apps[0].drain()
            tg.cancel_scope.cancel()

        async def watch_signals() -> None:
            with anyio.open_signal_receiver(*watched) as signals:
                async for signum in signals:
                    draining = bool(apps) and apps[0].frontend.draining
                    cut = signum == CHILD_CUT if launched else draining
                    if launched and draining and not cut:
                        continue  # the launcher's SIGTERM after the group's: one drain
                    if apps and cut:
                        with anyio.move_on_after(2.0):  # the cut's errors, then the close
                            await apps[0].stop_now()
                    if not apps or cut:
                        tg.cancel_scope.cancel()
                        return
                    tg.start_soon(stop_after_drain)

        tg.start_soon(watch_signals)
        apps.append(await tg.start(functools.partial(serve_app, models=models), cfg))


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


def _batch(args: argparse.Namespace) -> int:
    """``lifecycle batch``: an Engine over the file; the summary on stderr."""
    from lifecycle.engine import Engine

    logging.basicConfig(level="WARNING", format="%(asctime)s %(name)s %(levelname)s %(message)s")
    values = option_values(args, server=False)
    progress = False if args.no_progress else None  # None: on a terminal
    with Engine(values.pop("model"), **values) as engine:
        summary = engine.run_batch(args.input, args.output, progress=progress)
    print(summary.line(), file=sys.stderr)
    for cause, n in sorted(summary.errors.items()):
        print(f"  failed x{n}: {cause}", file=sys.stderr)
    return 0 if summary.failed == 0 else 1


def run_worker_module(module: str, argv: list[str]) -> int:
    """Run a ``gpu`` entry point (``gpu.worker``, ``gpu.worker.generate``) by module name, so that
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


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """The command line over the config file and the environment (``lifecycle/config.py``):
    for ``serve`` and ``batch`` their values become the flags' defaults, then the flags
    are read again. Raises ``ConfigError``."""
    import os

    from lifecycle.config import layered

    parser = _build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command in ("serve", "batch"):
        values = layered(args.config, os.environ, server=args.command == "serve")
        if values:
            sub = parser._subparsers._group_actions[0].choices[args.command]  # type: ignore[union-attr,index]
            sub.set_defaults(**values)
            args, rest = parser.parse_known_args(argv)
    return args, rest


def main(argv: list[str] | None = None) -> int:
    from lifecycle.config import ConfigError

    try:
        args, rest = parse_args(argv)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.command == "worker":
        return run_worker_module(MODEL_WORKER, ["--listen", args.listen, *rest])
    if args.command == "generate":  # python -m gpu.worker.generate, whose flags these are
        return run_worker_module("gpu.worker.generate", rest)
    if rest:
        print(f"lifecycle {args.command}: error: unrecognized arguments: {' '.join(rest)}",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.command == "serve":
        serve_argv = list(sys.argv[1:] if argv is None else argv)
        return _serve(args, serve_argv[serve_argv.index("serve") + 1 :])
    if args.command == "trace":
        try:
            return run_trace(args)
        except BrokenPipeError:  # `lifecycle trace ... | head`: the reader had enough
            # Python's recipe: stdout goes nowhere, so its flush at exit raises nothing.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
    if args.command == "batch":
        return _batch(args)
    print(f"unknown command {args.command}", file=sys.stderr)
    return 2
