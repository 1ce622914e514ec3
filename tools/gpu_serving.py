"""One ``lifecycle serve`` on a model, loaded at several closed-loop concurrencies, with
the frontend's and the worker's CPU time per output token at each.

    python tools/gpu_serving.py --model GGUF [--device cuda] [--levels 1 32 256]
                                [--input-len 64] [--output-len 64] [--json PATH]

The load is ``bench/serving.py``'s (``/generate``, streaming, text prompts, forced
output length); the server is started as ``bench/procs.py`` starts one (own process
group, ready at ``/health`` 200, log in a temporary file). Before the timed run of each
level, one untimed pass of ``C`` requests at the same concurrency lets the worker
capture the decode graphs that level's batch shapes need. CPU time is read before and
after each timed run: the frontend's main process from Linux's per-thread
``schedstat`` (``ServerProcess.cpu_seconds``), the worker and anything else the
server spawned from psutil. A frontend near 100 % of one core is the limit of the
level, whatever the GPU could do.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

import psutil

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.apis import RequestSpec  # noqa: E402
from bench.client import Target  # noqa: E402
from bench.procs import ServerProcess, free_port, http_status  # noqa: E402
from bench.serving import LoadConfig, run_load_sync  # noqa: E402
from bench.workload import WorkloadConfig, make_workload  # noqa: E402

__all__ = ["main"]


def _children_cpu(srv: ServerProcess) -> float:
    """CPU seconds of every process the server spawned (the worker), 10 ms ticks."""
    own = psutil.Process(srv.popen.pid).cpu_times()
    return srv.tree_cpu_seconds() - (own.user + own.system)


def _spawn(cmd: list[str], port: int) -> ServerProcess:
    """``ServerProcess.start`` without the wait, so that a signal during the server's
    start still reaches the ``finally`` that stops it."""
    log = pathlib.Path(tempfile.mkstemp(prefix="gpu-serving-", suffix=".log")[1])
    with log.open("wb") as f:
        popen = subprocess.Popen(
            cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
    return ServerProcess("gpu-serving", popen, "127.0.0.1", port, log)


def _wait_ready(srv: ServerProcess, timeout_s: float) -> None:
    """``/health`` 200, or an error as soon as the server exits or says its worker
    failed to start (it would restart it for ever, and the GPU session's minutes)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if srv.popen.poll() is not None:
            raise RuntimeError(f"the server exited ({srv.popen.returncode}):\n{srv.log_tail()}")
        if "restarting the worker" in srv.log_tail(1 << 16):
            raise RuntimeError(f"the worker failed to start:\n{srv.log_tail()}")
        if http_status(srv.host, srv.port, "/health") == 200:
            return
        time.sleep(0.2)
    raise TimeoutError(f"not ready after {timeout_s:g}s:\n{srv.log_tail()}")


def _server_info(srv: ServerProcess) -> Any:
    """``GET /server_info`` (the worker's HELLO capacity among it), or the error."""
    url = f"http://{srv.host}:{srv.port}/server_info"
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.loads(r.read())
    except (OSError, ValueError) as exc:
        return {"error": str(exc)}


def _decode_facts(info: Any, path: str = "") -> list[tuple[str, Any]]:
    """The fields of ``/server_info`` that say how decode runs and how big the cache is."""
    if isinstance(info, dict):
        return [f for k, v in info.items() for f in _decode_facts(v, f"{path}.{k}".lstrip("."))]
    if isinstance(info, list):
        return [f for i, v in enumerate(info) for f in _decode_facts(v, f"{path}[{i}]")]
    words = ("graph", "kv_cache", "mem_", "device", "dtype", "kv_blocks")
    return [(path, info)] if any(w in path.rsplit(".", 1)[-1] for w in words) else []


def _requests(level: int, args: argparse.Namespace) -> int:
    return args.num_requests or max(16, 4 * level)


def run_level(srv: ServerProcess, level: int, args: argparse.Namespace) -> dict[str, Any]:
    spec = RequestSpec(api="generate", stream=True)
    target = Target(srv.host, srv.port)

    def load(n: int, seed: int, warmup: int) -> Any:
        prompts = make_workload(
            WorkloadConfig("text", n, args.input_len, args.output_len, seed=seed)
        )
        cfg = LoadConfig(level, time_cap_s=args.time_cap, request_timeout_s=args.request_timeout,
                         warmup_requests=warmup, seed=seed, progress=False)  # fmt: skip
        return run_load_sync(target, spec, prompts, cfg)

    if args.warmup_pass:
        load(level, seed=1000 + level, warmup=1)
    fe0, wk0, t0 = srv.cpu_seconds(), _children_cpu(srv), time.perf_counter()
    result = load(_requests(level, args), seed=level, warmup=0)
    wall = time.perf_counter() - t0
    fe, wk = srv.cpu_seconds() - fe0, _children_cpu(srv) - wk0
    m = result.to_dict()
    out_tokens = max(1, m["total_output"])
    return {
        "level": level,  # the client's bound; m["concurrency"] is the measured mean
        **m,
        "frontend_cpu_s": fe,
        "worker_cpu_s": wk,
        "frontend_cpu_per_token_us": fe / out_tokens * 1e6,
        "worker_cpu_per_token_us": wk / out_tokens * 1e6,
        "frontend_core_pct": 100 * fe / max(wall, 1e-9),
        "worker_core_pct": 100 * wk / max(wall, 1e-9),
    }


def _print_row(r: dict[str, Any]) -> None:
    print(
        f"{r['level']:>5} {r['completed']:>5}/{r['completed'] + r['failed']:<5} "
        f"{r['output_throughput']:>9.0f} {r['median_ttft_ms']:>8.1f} {r['p99_ttft_ms']:>8.1f} "
        f"{r['median_itl_ms']:>7.2f} {r['p99_itl_ms']:>7.2f} "
        f"{r['frontend_cpu_per_token_us']:>9.1f} {r['frontend_core_pct']:>6.0f} "
        f"{r['worker_cpu_per_token_us']:>9.1f} {r['worker_core_pct']:>6.0f}",
        flush=True,
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--levels", type=int, nargs="+", default=[1, 32, 256])
    p.add_argument("--num-requests", type=int, default=None, help="per level (default 4C, >=16)")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-running", type=int, default=256)
    p.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=None,
        help="default: the worker's own sizing (on CUDA, --mem-fraction of free memory)",
    )
    p.add_argument("--decode-graphs", default="auto", help="auto | on | eager | off")
    p.add_argument("--time-cap", type=float, default=60.0, help="seconds per level")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--start-timeout", type=float, default=240.0)
    p.add_argument("--no-warmup-pass", dest="warmup_pass", action="store_false")
    p.add_argument("--server-log", default=None, help="copy the server's log here at the end")
    p.add_argument(
        "--pid-file",
        default=None,
        help="the server's process group id, for a "
        "caller that must end it if this script is killed",
    )
    p.add_argument("--json", default=None)
    return p


def _exit_on_sigterm(signum: int, frame: object) -> None:
    # `timeout` sends SIGTERM: unwind so that `finally` stops the server, which runs in a
    # session of its own and would otherwise outlive this script (holding the GPU).
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    port = free_port()
    cmd = [
        sys.executable, "-m", "lifecycle", "serve", "--port", str(port), "--model", args.model,
        "--device", args.device, "--max-running", str(args.max_running),
        "--max-pending", str(2 * args.max_running), "--decode-graphs", args.decode_graphs,
        "--log-level", "warning",
    ]  # fmt: skip
    if args.kv_cache_tokens is not None:
        cmd += ["--kv-cache-tokens", str(args.kv_cache_tokens)]
    print("server:", " ".join(cmd), flush=True)
    srv = _spawn(cmd, port)
    if args.pid_file:
        pathlib.Path(args.pid_file).write_text(f"{srv.popen.pid}\n")
    res: dict[str, Any] = {"command": cmd, "levels": []}
    code = 0
    try:
        t = time.perf_counter()
        _wait_ready(srv, args.start_timeout)
        res["start_s"] = time.perf_counter() - t
        res["server_info"] = _server_info(srv)
        for key, value in _decode_facts(res["server_info"]):
            print(f"  {key}: {value}")
        print(f"ready in {res['start_s']:.1f}s; {args.input_len} tokens in, {args.output_len} "
              "forced out, /generate streaming", flush=True)  # fmt: skip
        print(f"{'conc':>5} {'ok/sent':<11} {'out tok/s':>9} {'TTFT p50':>8} {'TTFT p99':>8} "
              f"{'ITL p50':>7} {'ITL p99':>7} {'fe us/tok':>9} {'fe %':>6} {'wk us/tok':>9} "
              f"{'wk %':>6}", flush=True)  # fmt: skip
        for level in args.levels:
            row = run_level(srv, level, args)
            res["levels"].append(row)
            _print_row(row)
            code |= int(row["failed"] > 0 or row["completed"] == 0)
    finally:
        srv.stop()
        if args.server_log:
            pathlib.Path(args.server_log).write_text(srv.log_tail(1 << 20))
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(res, indent=2, default=str) + "\n")
    print("fe = the frontend process (CPU us per output token, % of one core); wk = the worker")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
