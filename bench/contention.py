"""The server's speed beside other busy processes, against itself quiet and against
llama-server under the same load.

    python bench/contention.py [--loops N] [--levels 1 32] [--llama-server PATH]

Each contender is started once and measured quiet, then with ``--loops`` busy loops
beside it (one process each spinning in pure Python; by default one per CPU this
process may use), then quiet again: its loaded tokens/s over the mean of the two quiet
legs is the share of its speed it keeps. Fair sharing of every core between one busy
loop and the server's threads gives 0.5x; issue 53 measured 1/37 (12.6-13.4 s for 32
tokens against 0.34-0.37 s) before the worker's thread governor (``gpu/worker/threads.py``).

Contenders: ``ours`` (the defaults: threads from the CPU budget, the governor on),
``ours-fixed`` (the same thread count held fixed, ``LIFECYCLE_FIXED_THREADS=1``: what
the worker did before the governor) and ``llama-server`` (when built by ``make
bench-peer``; ``--threads`` of the machine's CPUs, as in docs/benchmarks.md). Each level
sends greedy streaming completions of ``--output-len`` tokens after ``--input-len``-token
prompts, ``--requests`` of them (at least the level), with a time cap per leg: a
contender that stalls under load reports what it finished in the cap.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import llama_server  # noqa: E402
from bench.apis import RequestSpec  # noqa: E402
from bench.client import Target  # noqa: E402
from bench.contenders import ROOT, default_model_path  # noqa: E402
from bench.procs import ServerProcess, free_port  # noqa: E402
from bench.serving import LoadConfig, run_load_sync  # noqa: E402
from bench.workload import WorkloadConfig, make_workload  # noqa: E402
from wire.cpu_budget import cpu_budget  # noqa: E402

_BUSY = "while True: pass"


@dataclass(slots=True)
class Leg:
    tokens_per_s: float
    finished: int
    sent: int


@contextmanager
def busy_loops(n: int) -> Iterator[None]:
    """``n`` processes spinning on the CPU for the body."""
    procs = [subprocess.Popen([sys.executable, "-c", _BUSY]) for _ in range(n)]
    time.sleep(0.5)  # they are running
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _leg(target: Target, spec: RequestSpec, args: argparse.Namespace, level: int, seed: int) -> Leg:
    n = max(args.requests, level)
    prompts = make_workload(
        WorkloadConfig(
            kind="text",
            num_requests=n,
            input_len=args.input_len,
            output_len=args.output_len,
            seed=seed,
        )  # fmt: skip
    )
    cfg = LoadConfig(
        max_concurrency=level, time_cap_s=args.time_cap, warmup_requests=0, progress=False
    )
    res = run_load_sync(target, spec, prompts, cfg)
    out = sum(o.output_len for o in res.outputs if o.success)
    finished = sum(1 for o in res.outputs if o.success)
    return Leg(out / max(res.metrics.duration_s, 1e-9), finished, len(res.outputs))


def _start_ours(
    label: str, args: argparse.Namespace, model: str, env: dict[str, str]
) -> ServerProcess:
    port = free_port()
    argv = [sys.executable, "-m", "lifecycle", "serve", "--port", str(port), "--model", model]
    argv += ["--kv-cache-tokens", str(llama_server.CTX_SIZE), "--log-level", "warning"]
    argv += ["--threads", str(args.threads)] if args.threads else []
    old = {k: os.environ.get(k) for k in env}
    for k, v in env.items():  # None: unset
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        return ServerProcess.start(label, argv, port, "/health", args.start_timeout, cwd=ROOT)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _contenders(
    args: argparse.Namespace, model: str
) -> list[tuple[str, ServerProcess, RequestSpec, bool]]:
    out = []
    # No OMP_NUM_THREADS from the caller's shell: the worker's own default is measured.
    clean: dict[str, str | None] = {"OMP_NUM_THREADS": None}
    ours_spec = RequestSpec(api="completions", ignore_eos="flag")
    out.append(("ours", _start_ours("ours", args, model, clean), ours_spec, True))
    if not args.no_fixed:
        fixed = {**clean, "LIFECYCLE_FIXED_THREADS": "1"}
        out.append(("ours-fixed", _start_ours("ours-fixed", args, model, fixed), ours_spec, True))
    binary = llama_server.binary_path(args.llama_server)
    note = llama_server.skip_note(binary)
    if note is None:
        proc = llama_server.start(binary, model, free_port(), args.start_timeout)
        out.append(("llama-server", proc, llama_server.peer_spec(), False))
    else:
        print(note, file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF file (default: the bundled SmolLM2)")
    p.add_argument("--loops", type=int, default=None, help="busy loops (default: one per CPU)")
    p.add_argument("--levels", type=int, nargs="+", default=[1, 32])
    p.add_argument("--requests", type=int, default=4, help="requests per leg (at least the level)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--time-cap", type=float, default=60.0, help="seconds per leg at most")
    p.add_argument("--threads", type=int, default=None, help="ours: --threads (default: its own)")
    p.add_argument("--no-fixed", action="store_true", help="leave out ours-fixed")
    p.add_argument(
        "--llama-server", default=None, help="the peer's binary (default: make bench-peer's)"
    )
    p.add_argument("--start-timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    model = args.model or default_model_path()
    budget = cpu_budget()
    loops = args.loops if args.loops is not None else budget.cpus
    print(f"CPU budget: {budget.cpus} ({budget.why}); {loops} busy loops; model {Path(model).name}")
    contenders = _contenders(args, model)
    rows = []
    try:
        for label, proc, spec, keep_alive in contenders:
            target = Target(proc.host, proc.port, keep_alive=keep_alive)
            _leg(target, spec, args, 1, seed=0)  # warm-up, untimed
            for level in args.levels:
                quiet1 = _leg(target, spec, args, level, seed=level)
                with busy_loops(loops):
                    loaded = _leg(target, spec, args, level, seed=level + 1)
                quiet2 = _leg(target, spec, args, level, seed=level + 2)
                quiet = (quiet1.tokens_per_s + quiet2.tokens_per_s) / 2
                rows.append((label, level, quiet, loaded))
                print(
                    f"{label:12s} c={level:<3d} quiet {quiet1.tokens_per_s:7.1f} / "
                    f"{quiet2.tokens_per_s:7.1f} tok/s, loaded {loaded.tokens_per_s:7.1f} tok/s "
                    f"({loaded.finished}/{loaded.sent} finished): {loaded.tokens_per_s / quiet:.2f}x",
                    flush=True,
                )
    finally:
        for _, proc, _, _ in contenders:
            proc.stop()
    print(f"\n| contender | c | quiet tok/s | with {loops} busy loops | kept |")
    print("|---|---|---|---|---|")
    for label, level, quiet, loaded in rows:
        print(
            f"| {label} | {level} | {quiet:.1f} | {loaded.tokens_per_s:.1f} | {loaded.tokens_per_s / quiet:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
