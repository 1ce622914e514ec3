"""Offline throughput: N prompts through ``Engine.generate`` against the HTTP server at
its best concurrency, same worker options, same prompts, same run.

    python bench/offline.py                          # 512 prompts x 64 tokens, real model
    python bench/offline.py --prompts 64 --rounds 1  # a quick look
    python bench/offline.py --scripted               # frontend only (the scripted worker)

Each round runs the Engine (one ``generate`` call with the whole list; it feeds the
worker at most 2x its credits at a time) and then ``lifecycle serve`` driven by the
closed-loop client of ``bench/serving.py`` at ``--concurrency`` (non-streaming
``/generate``), alternating A B A B so the machine's drift hits both alike. Output
lengths are forced (``ignore_eos``) so both make the same tokens. Prints output tok/s
per round and the medians, and Engine/HTTP.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.apis import RequestSpec  # noqa: E402
from bench.client import Target  # noqa: E402
from bench.procs import ServerProcess, free_port, serve_argv  # noqa: E402
from bench.serving import LoadConfig, run_load_sync  # noqa: E402
from bench.workload import WorkloadConfig, make_workload  # noqa: E402


def _worker_options(args: argparse.Namespace) -> dict[str, object]:
    opts: dict[str, object] = {"max_running": args.max_running, "max_pending": args.max_pending}
    if args.scripted:
        return {**opts, "scripted_worker": True, "worker_args": f"--step-delay {args.step_delay}"}
    return {**opts, "device": "cpu", "kv_cache_tokens": args.kv_cache_tokens}


def run_engine(args: argparse.Namespace, prompts: list[str]) -> tuple[float, int]:
    from lifecycle import Engine

    # the same sampling as bench/apis.py's /generate body: greedy, forced length
    sp = {"temperature": 0.0, "max_new_tokens": args.output_len, "ignore_eos": True}
    with Engine(**_worker_options(args)) as engine:  # type: ignore[arg-type]
        engine.generate(prompts[:4], sp, progress=False)  # warm-up
        t0 = time.perf_counter()
        outs = engine.generate(prompts, sp, progress=False)
        dt = time.perf_counter() - t0
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return tokens / dt, tokens


def run_http(args: argparse.Namespace, prompts: list) -> tuple[float, int]:
    port = free_port()
    opts = _worker_options(args)
    scripted = bool(opts.pop("scripted_worker", False))
    opts.pop("worker_args", None)
    opts.pop("device", None)
    argv = serve_argv(port, scripted=scripted, step_delay=args.step_delay, **opts)
    srv = ServerProcess.start("offline-http", argv, port, "/health", timeout_s=600, cwd=ROOT)
    try:
        spec = RequestSpec(api="generate", stream=False, ignore_eos="flag")
        cfg = LoadConfig(max_concurrency=args.concurrency, warmup_requests=4, progress=False)
        result = run_load_sync(Target("127.0.0.1", port), spec, prompts, cfg)
    finally:
        srv.stop()
    m = result.metrics
    if result.errors:
        print(f"  http errors: {result.errors}")
    return m.output_throughput, m.total_output


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--prompts", type=int, default=512)
    p.add_argument("--input-len", type=int, default=64, help="words per prompt")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32, help="the HTTP client's")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-running", type=int, default=32)
    p.add_argument("--max-pending", type=int, default=64)
    p.add_argument("--kv-cache-tokens", type=int, default=16384)
    p.add_argument("--scripted", action="store_true", help="the scripted worker, no model")
    p.add_argument("--step-delay", type=float, default=0.0, help="scripted worker's step (s)")
    args = p.parse_args()
    workload = make_workload(
        WorkloadConfig(
            kind="text",
            num_requests=args.prompts,
            input_len=args.input_len,
            output_len=args.output_len,
            seed=1,
        )
    )
    texts = [str(w.prompt) for w in workload]
    worker = "scripted worker" if args.scripted else "SmolLM2-135M on CPU"
    print(
        f"{args.prompts} prompts x {args.output_len} tokens, {worker}, max_running "
        f"{args.max_running}, max_pending {args.max_pending}; {os.cpu_count()} CPUs, "
        f"Python {sys.version.split()[0]}"
    )
    engine_rates, http_rates = [], []
    for r in range(args.rounds):
        rate, tokens = run_engine(args, texts)
        engine_rates.append(rate)
        print(f"  round {r + 1}: Engine.generate          {rate:8.1f} tok/s ({tokens} tokens)")
        rate, tokens = run_http(args, workload)
        http_rates.append(rate)
        print(
            f"  round {r + 1}: HTTP /generate, conc {args.concurrency:<3} {rate:8.1f} tok/s "
            f"({tokens} tokens)"
        )
    e, h = statistics.median(engine_rates), statistics.median(http_rates)
    print(f"median output tok/s: Engine {e:.1f}, HTTP {h:.1f}; Engine/HTTP {e / h:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
