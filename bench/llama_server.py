"""llama.cpp's own ``llama-server`` as the peer: where its binary lies, how it is started,
how much memory it holds.

The binary is built once by ``make bench-peer`` (``tools/build_llama_server.sh``) into a
cache outside the repository. The start flags are those of the measured peer set-up
(``docs/benchmarks.md``, "llama-server as the peer"): 32 slots of 1024 tokens each,
continuous batching, both threads of the machine.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import psutil

from bench.apis import RequestSpec
from bench.procs import ServerProcess

__all__ = [
    "BUILD_NOTE",
    "CTX_SIZE",
    "PARALLEL",
    "binary_path",
    "build_flags",
    "cache_dir",
    "cache_root",
    "peer_spec",
    "rss_mib",
    "server_argv",
    "skip_note",
    "start",
]

PARALLEL = 32
CTX_SIZE = 32768  # 1024 tokens per slot: --parallel turns unified KV off
THREADS = 2
BUILD_NOTE = (
    "llama-server is not built ({path} is absent); skipping the peer.\n"
    "  `make bench-peer` builds it (about 6 minutes on 2 cores, once), "
    "or pass --llama-server PATH."
)


def cache_root(env: Mapping[str, str] | None = None) -> Path:
    """``${XDG_CACHE_HOME:-~/.cache}/lifecycle``: where the benchmarks keep what they build
    or fetch outside the repository (llama-server, ``tools/pypi_gguf.py``'s models)."""
    env = os.environ if env is None else env
    base = env.get("XDG_CACHE_HOME") or str(Path(env.get("HOME", "~")).expanduser() / ".cache")
    return Path(base) / "lifecycle"


def cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """``$LIFECYCLE_PEER_CACHE``, else ``cache_root() / "llama-server"``: the same rule as
    ``tools/build_llama_server.sh``."""
    env = os.environ if env is None else env
    if env.get("LIFECYCLE_PEER_CACHE"):
        return Path(env["LIFECYCLE_PEER_CACHE"])
    return cache_root(env) / "llama-server"


def binary_path(explicit: str | None = None, env: Mapping[str, str] | None = None) -> Path:
    """``explicit`` (``--llama-server PATH``), else where ``make bench-peer`` puts it."""
    return Path(explicit) if explicit else cache_dir(env) / "bin" / "llama-server"


def build_flags(binary: Path) -> str | None:
    """The CPU flags ``tools/build_llama_server.sh`` built ``binary`` with (the set that
    served the model on this machine), None for a binary it did not build."""
    try:
        text = (binary.resolve().parent.parent / "lifecycle-cpu-flags.txt").read_text()
    except OSError:
        return None
    return text.strip() or None


def skip_note(path: Path) -> str | None:
    """None when ``path`` is an executable, else the note saying how to get one."""
    if path.is_file() and os.access(path, os.X_OK):
        return None
    return BUILD_NOTE.format(path=path)


def server_argv(binary: Path, model: str, port: int, host: str = "127.0.0.1") -> list[str]:
    return [
        str(binary),
        "--parallel",
        str(PARALLEL),
        "--cont-batching",
        "--ctx-size",
        str(CTX_SIZE),
        "--threads",
        str(THREADS),
        "--threads-batch",
        str(THREADS),
        "--host",
        host,
        "--port",
        str(port),
        "-m",
        model,
    ]


def peer_spec() -> RequestSpec:
    """Streaming /v1/completions; llama-server honours ``ignore_eos`` there (a -inf bias on
    every end-of-generation token), so every request gets exactly the forced length."""
    return RequestSpec(api="completions", ignore_eos="flag")


def start(binary: Path, model: str, port: int, timeout_s: float = 300.0) -> ServerProcess:
    """Start it and wait for ``/health`` 200, which it answers once the model is loaded."""
    argv = server_argv(binary, model, port)
    return ServerProcess.start("llama-server", argv, port, "/health", timeout_s)


def rss_mib(pid: int) -> float | None:
    """The resident set of one process in MiB, None when it is gone."""
    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except psutil.Error:
        return None
