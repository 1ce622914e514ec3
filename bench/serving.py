"""Load generator for a running server, reporting what SGLang's ``bench_serving`` reports.

    python -m bench.serving --base-url http://127.0.0.1:30000 --api generate \\
        --max-concurrency 4 --num-requests 64 --input-len 128 --output-len 64

Closed loop (``--max-concurrency C``, requests as fast as slots free up) or open loop
(``--request-rate R``: Poisson arrivals; combined with ``--max-concurrency`` arrivals
wait for a slot, as in ``bench_serving``). A run stops issuing requests once
``--num-requests`` have started or ``--time-cap`` seconds have passed; requests in
flight then finish. Metric definitions: ``bench/metrics.py``.

``--dataset grounded`` sends input-grounded requests (rewrite a function or a paragraph
with one change, repeat one: ``bench/workload.py``), each rendered in the chat template
of ``--chat-template-model`` for ``/generate`` and completions (``--api chat`` sends the
user's turn as it is), and by default lets the model stop at its end of turn.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import anyio

from bench.apis import IGNORE_EOS_MODES, RequestSpec
from bench.client import ConnectionPool, Target, send_request
from bench.metrics import BenchmarkMetrics, RequestOutput, compute_metrics, format_report
from bench.workload import Prompt, WorkloadConfig, chat_wrapped, make_workload

__all__ = ["LoadConfig", "LoadResult", "main", "run_load", "run_load_sync"]


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """How hard and how long to push. ``max_concurrency`` None means unbounded."""

    max_concurrency: int | None = None
    request_rate: float = math.inf
    time_cap_s: float = 600.0
    request_timeout_s: float = 300.0
    warmup_requests: int = 1
    seed: int = 1
    progress: bool = True


@dataclass(slots=True)
class LoadResult:
    """Outputs of the requests that started, their metrics, and the client's own cost."""

    metrics: BenchmarkMetrics
    outputs: list[RequestOutput]
    not_started: int
    client_cpu_s: float
    connections_opened: int
    errors: dict[str, int] = field(default_factory=dict)
    # Requests that succeeded with fewer or more tokens than they forced (``ignore_eos``
    # on): (prompt index, tokens the client counted, tokens forced). A server that keeps
    # every token has none.
    short: list[tuple[int, int, int]] = field(default_factory=list)

    def to_dict(self, details: bool = False) -> dict[str, Any]:
        d: dict[str, Any] = self.metrics.to_dict()
        d.update(
            not_started=self.not_started,
            client_cpu_s=self.client_cpu_s,
            client_cpu_pct=100 * self.client_cpu_s / max(self.metrics.duration_s, 1e-9),
            connections_opened=self.connections_opened,
            errors=self.errors,
            short=self.short,
        )
        if details:
            d["requests"] = [asdict(o) for o in self.outputs]
        return d


@dataclass(slots=True)
class _Progress:
    total: int
    started: int = 0
    done: int = 0
    failed: int = 0
    tokens: int = 0

    def line(self, elapsed: float) -> str:
        rate = self.tokens / elapsed if elapsed > 0 else 0.0
        return (
            f"[{elapsed:7.1f}s] done {self.done}/{self.total}  failed {self.failed}  "
            f"in flight {self.started - self.done - self.failed}  out tok {self.tokens} "
            f"({rate:.1f}/s)"
        )


async def _report_progress(p: _Progress, t0: float, interval: float) -> None:
    tty = sys.stderr.isatty()
    while True:
        await anyio.sleep(interval)
        msg = p.line(time.perf_counter() - t0)
        sys.stderr.write(f"\r{msg}" if tty else f"{msg}\n")
        sys.stderr.flush()


async def _warm_up(pool: ConnectionPool, spec: RequestSpec, prompt: Prompt, n: int) -> None:
    """``bench_serving``'s warm-up: the first prompt, at most 32 output tokens."""
    if n <= 0:
        return
    short = Prompt(prompt.prompt, prompt.prompt_len, min(prompt.output_len, 32))
    outs = [await send_request(pool, spec, short, 120.0) for _ in range(n)]
    if not any(o.success for o in outs):
        raise RuntimeError(f"warm-up failed: {outs[0].error}")


async def run_load(
    target: Target, spec: RequestSpec, prompts: Sequence[Prompt], cfg: LoadConfig
) -> LoadResult:
    """Send ``prompts`` under ``cfg`` and measure; the wall clock starts after warm-up."""
    pool = ConnectionPool(target)
    try:
        await _warm_up(pool, spec, prompts[0], cfg.warmup_requests)
        return await _timed_run(pool, spec, prompts, cfg)
    finally:
        await pool.aclose()


async def _timed_run(
    pool: ConnectionPool, spec: RequestSpec, prompts: Sequence[Prompt], cfg: LoadConfig
) -> LoadResult:
    rng = random.Random(cfg.seed)
    slots = anyio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    outputs: list[RequestOutput | None] = [None] * len(prompts)
    progress = _Progress(total=len(prompts))
    cpu0, t0 = time.process_time(), time.perf_counter()
    deadline = t0 + cfg.time_cap_s

    async def one(i: int) -> None:
        if slots is not None:
            await slots.acquire()
        try:
            if time.perf_counter() >= deadline:
                return  # queued past the time cap: never sent
            progress.started += 1
            out = await send_request(pool, spec, prompts[i], cfg.request_timeout_s)
            outputs[i] = out
            if out.success:
                progress.done += 1
                progress.tokens += out.output_len
            else:
                progress.failed += 1
        finally:
            if slots is not None:
                slots.release()

    async with anyio.create_task_group() as outer:
        if cfg.progress:
            outer.start_soon(_report_progress, progress, t0, 1.0)
        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                if time.perf_counter() >= deadline:
                    break
                tg.start_soon(one, i)
                if math.isfinite(cfg.request_rate):
                    await anyio.sleep(rng.expovariate(cfg.request_rate))
        outer.cancel_scope.cancel()
    duration = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    if cfg.progress:
        sys.stderr.write(f"\r{progress.line(duration)}\n")
    done = [o for o in outputs if o is not None]
    errors: dict[str, int] = {}
    for o in done:
        if not o.success:
            key = o.error.split(":", 1)[0][:60]
            errors[key] = errors.get(key, 0) + 1
    forced = spec.ignore_eos != "off"
    short = [
        (i, o.output_len, prompts[i].output_len)
        for i, o in enumerate(outputs)
        if forced and o is not None and o.success and o.output_len != prompts[i].output_len
    ]
    return LoadResult(
        metrics=compute_metrics(done, duration),
        outputs=done,
        not_started=len(prompts) - len(done),
        client_cpu_s=cpu,
        connections_opened=pool.opened,
        errors=errors,
        short=short,
    )


def run_load_sync(
    target: Target, spec: RequestSpec, prompts: Sequence[Prompt], cfg: LoadConfig
) -> LoadResult:
    """``run_load`` from synchronous code (a fresh event loop)."""

    async def go() -> LoadResult:
        return await run_load(target, spec, prompts, cfg)

    return anyio.run(go)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.serving",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--api", choices=("generate", "completions", "chat"), default="generate")
    p.add_argument("--disable-stream", action="store_true", help="non-streaming requests")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--request-rate", type=float, default=math.inf, help="req/s, Poisson")
    p.add_argument("--time-cap", type=float, default=600.0, help="stop issuing after S seconds")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--dataset", choices=("text", "ids", "jsonl", "grounded"), default="text")
    p.add_argument("--dataset-path", default=None, help="JSONL file for --dataset jsonl")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--ignore-eos",
        choices=IGNORE_EOS_MODES,
        default=None,
        help="default: off for --dataset grounded (answers end where the model ends "
        "them), flag otherwise",
    )
    p.add_argument(
        "--chat-template-model",
        default=None,
        metavar="FILE",
        help="--dataset grounded on /generate or completions: the GGUF whose chat template "
        "wraps each prompt (default: the bundled SmolLM2)",
    )
    p.add_argument("--eog-ids", type=int, nargs="+", default=[0, 2, 4])
    p.add_argument("--model", default="default", help="'model' field of OpenAI requests")
    p.add_argument("--stream-usage", action="store_true", help="ask for usage in OpenAI streams")
    p.add_argument("--extra-request-body", default="{}", help="JSON merged into every body")
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--output-file", default=None, help="write the results as JSON")
    p.add_argument("--output-details", action="store_true", help="per-request data in JSON")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    grounded = args.dataset == "grounded"
    spec = RequestSpec(
        api=args.api,
        stream=not args.disable_stream,
        ignore_eos=args.ignore_eos or ("off" if grounded else "flag"),
        eog_ids=tuple(args.eog_ids),
        model=args.model,
        stream_usage=args.stream_usage,
        extra_body=json.loads(args.extra_request_body),
    )
    prompts = make_workload(
        WorkloadConfig(
            kind=args.dataset,
            num_requests=args.num_requests,
            input_len=args.input_len,
            output_len=args.output_len,
            range_ratio=args.range_ratio,
            seed=args.seed,
            path=args.dataset_path,
        )
    )
    if grounded and args.api != "chat":
        prompts = chat_wrapped(prompts, args.chat_template_model)
    cfg = LoadConfig(
        max_concurrency=args.max_concurrency,
        request_rate=args.request_rate,
        time_cap_s=args.time_cap,
        request_timeout_s=args.request_timeout,
        warmup_requests=args.warmup_requests,
        seed=args.seed,
        progress=not args.quiet,
    )
    result = run_load_sync(Target.from_url(args.base_url), spec, prompts, cfg)
    header = {
        "Backend:": f"{args.api} ({'stream' if spec.stream else 'unary'}) at {args.base_url}",
        "Traffic request rate:": args.request_rate,
        "Max request concurrency:": args.max_concurrency or "not set",
    }
    print(format_report(result.metrics, header))
    d = result.to_dict()
    print(
        f"Client CPU: {d['client_cpu_s']:.2f} s ({d['client_cpu_pct']:.1f}% of one core), "
        f"{result.connections_opened} connections, not started: {result.not_started}"
    )
    for err, n in sorted(result.errors.items()):
        print(f"  failed x{n}: {err}")
    for i, got, want in result.short:
        print(f"  !! request {i}: {got} tokens counted where {want} were forced")
    if args.output_file:
        d.update(
            api=args.api,
            stream=spec.stream,
            max_concurrency=args.max_concurrency,
            request_rate=args.request_rate,
            base_url=args.base_url,
        )
        d = result.to_dict(details=args.output_details) | d
        with open(args.output_file, "w") as f:
            json.dump(d, f, indent=2, default=str)
    return 0 if result.metrics.completed else 1


if __name__ == "__main__":
    raise SystemExit(main())
