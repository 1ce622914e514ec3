"""Our server against what a user would run instead, same model file, same machine, same run.

    python -m bench.compare                    # make bench-compare
    python -m bench.compare --mode frontend    # make bench-frontend

``--mode model`` (default) serves the bundled GGUF with ``python -m lifecycle serve`` and
with a peer, then runs the same closed loop load against both at each concurrency level,
alternating A B A B so that drift of the machine's speed hits both alike, and prints
output tok/s, TTFT and ITL for both and our/peer ratios, each run's CPU steal share, the
TTFT of a long prompt no prefix cache can serve, and each server's RSS. The peer
(``--peer``) is llama.cpp's ``llama-server`` (continuous batching, built once by ``make
bench-peer``) or llama-cpp-python's server (``python -m llama_cpp.server``, an optional
extra that builds llama.cpp when installed). The default, ``auto``, takes llama-server
when its binary exists, else llama-cpp-python; a peer that is absent is skipped with a
note saying how to get it. ``--baseline-rev REV`` adds our server as it was at commit REV
to the same rotation, so that a change is measured against the commit before it, and the
peer, in one run.

``--mode frontend`` puts no model anywhere: our server drives a scripted instant worker
(``python -m lifecycle.testing.scripted_worker``), the baseline is a FastAPI/uvicorn app doing the
same scripted work (``bench/baseline_fastapi.py``), and the table adds each server
process's CPU microseconds per request and per streamed token. ``--pace-ms`` spaces the
tokens in both stacks alike (the scripted worker's step delay, the baseline's token
delay), as a model would, instead of all at once.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench import llama_server
from bench.contenders import (
    OURS_CMD,
    OURS_FRONTEND_CMD,
    PEERS,
    SCRIPTED_WORKER_CMD,
    Contender,
    resolve_peer,
    start_frontend_contenders,
    start_model_contenders,
)
from bench.cpu_steal import steal_share, steal_ticks
from bench.metrics import RequestOutput, compute_metrics
from bench.procs import busy_cpu_seconds
from bench.server_figures import STEAL_LIMIT, fresh_prefix_ttft, print_extras, server_rss
from bench.serving import LoadConfig, LoadResult, run_load_sync
from bench.workload import WorkloadConfig, make_workload

__all__ = ["LevelResult", "compare", "main", "print_table"]


@dataclass(slots=True)
class LevelResult:
    """All reps of one contender at one concurrency, pooled."""

    outputs: list[RequestOutput] = field(default_factory=list)
    duration_s: float = 0.0
    requests_sent: int = 0
    server_cpu_s: float = 0.0
    client_cpu_s: float = 0.0
    foreign_cpu_s: float = 0.0
    rep_tok_s: list[float] = field(default_factory=list)
    rep_steal: list[float] = field(default_factory=list)
    # Frontend mode: the same requests with a longer output, for the marginal token cost.
    long_cpu_s: float = 0.0
    long_tokens: int = 0
    long_requests: int = 0
    short: int = 0  # successful requests whose token count was not the forced one

    def add_long(self, res: LoadResult, server_cpu_s: float) -> None:
        self.long_cpu_s += server_cpu_s
        self.long_tokens += sum(o.output_len for o in res.outputs if o.success)
        self.long_requests += len(res.outputs)

    def add(
        self, res: LoadResult, server_cpu_s: float, foreign_cpu_s: float, steal: float = 0.0
    ) -> None:
        self.rep_steal.append(steal)
        self.outputs += res.outputs
        self.short += len(res.short)
        self.duration_s += res.metrics.duration_s
        self.requests_sent += len(res.outputs)
        self.server_cpu_s += server_cpu_s
        self.client_cpu_s += res.client_cpu_s
        self.foreign_cpu_s += foreign_cpu_s
        self.rep_tok_s.append(res.metrics.output_throughput)

    def summary(self) -> dict[str, Any]:
        m = compute_metrics(self.outputs, self.duration_s)
        tokens = max(m.total_output, 1)
        return {
            "completed": m.completed,
            "failed": m.failed,
            "short": self.short,
            "output_tok_s": m.output_throughput,
            "rep_output_tok_s": self.rep_tok_s,
            "request_throughput": m.request_throughput,
            "ttft_p50_ms": m.ttft_ms.median,
            "ttft_p99_ms": m.ttft_ms.p99,
            "itl_p50_ms": m.itl_ms.median,
            "itl_p99_ms": m.itl_ms.p99,
            "e2e_p50_ms": m.e2e_latency_ms.median,
            "server_cpu_us_per_request": 1e6 * self.server_cpu_s / max(self.requests_sent, 1),
            "server_cpu_us_per_token": 1e6 * self.server_cpu_s / tokens,
            **self._marginal(m.total_output),
            "client_cpu_pct": 100 * self.client_cpu_s / max(self.duration_s, 1e-9),
            "foreign_cpu_pct": 100 * self.foreign_cpu_s / max(self.duration_s, 1e-9),
            "rep_steal_pct": [100 * x for x in self.rep_steal],
        }

    def _marginal(self, tokens: int) -> dict[str, float]:
        """CPU per streamed token as the slope between the two output lengths, and per
        request as what is left at zero tokens (a least-squares line through two points)."""
        if not self.long_requests or not self.requests_sent:
            return {}
        short_req, long_req = tokens / self.requests_sent, self.long_tokens / self.long_requests
        short_cpu = self.server_cpu_s / self.requests_sent
        long_cpu = self.long_cpu_s / self.long_requests
        if long_req <= short_req:
            return {}
        per_token = (long_cpu - short_cpu) / (long_req - short_req)
        return {
            "marginal_cpu_us_per_token": 1e6 * per_token,
            "fixed_cpu_us_per_request": 1e6 * (short_cpu - per_token * short_req),
        }


def compare(contenders: list[Contender], args: argparse.Namespace) -> dict[int, dict[str, Any]]:
    """Every level, ``reps`` times each contender in turn (A B A B)."""
    results: dict[int, dict[str, LevelResult]] = {}
    for c in contenders:  # one untimed warm-up each, so the first level is not penalised
        run_load_sync(c.target, c.spec, _prompts(args, 4, seed=0), LoadConfig(progress=False))
    for conc in args.levels:
        n = args.num_requests if args.num_requests else (16 if args.mode == "model" else 256)
        n = max(n, conc)
        level = results.setdefault(conc, {c.label: LevelResult() for c in contenders})
        for rep in range(args.reps):
            for c in contenders:
                print(f"== concurrency {conc}, rep {rep + 1}/{args.reps}: {c.label}", flush=True)
                cfg = LoadConfig(
                    max_concurrency=conc,
                    time_cap_s=args.time_cap,
                    warmup_requests=0,
                    progress=not args.quiet,
                    seed=rep,
                )
                # Fresh prompts for every level and rep (both contenders get the same):
                # with one seed per rep, a later level repeated an earlier one's prompts
                # and llama-server's RAM prompt cache served them (TTFT p50 216 ms at
                # c=32 against 6.8 s on fresh prompts, 2026-12-04).
                seed = 1 + rep + 1000 * conc
                prompts = _prompts(args, n, seed=seed)
                cpu0, tree0, busy0, steal0 = (
                    c.proc.cpu_seconds(),
                    c.proc.tree_cpu_seconds(),
                    busy_cpu_seconds(),
                    steal_ticks(),
                )
                res = run_load_sync(c.target, c.spec, prompts, cfg)
                steal = steal_share(steal0, steal_ticks())
                for i, got, want in res.short:  # every forced token must arrive
                    print(f"!! {c.label}: request {i} (seed {seed}) counted {got} tokens "
                          f"where {want} were forced", flush=True)  # fmt: skip
                # Whatever else ran meanwhile: machine busy time minus the server's
                # process tree and this client. Above ~10% of a core the figures are noise.
                foreign = busy_cpu_seconds() - busy0 - (c.proc.tree_cpu_seconds() - tree0)
                foreign = max(0.0, foreign - res.client_cpu_s)
                level[c.label].add(res, c.proc.cpu_seconds() - cpu0, foreign, steal)
                if args.mode == "frontend" and args.long_output_len > args.output_len:
                    print(f"   same, {args.long_output_len} output tokens", flush=True)
                    long_prompts = _prompts(args, n, seed=seed, output_len=args.long_output_len)
                    cpu0 = c.proc.cpu_seconds()
                    res = run_load_sync(c.target, c.spec, long_prompts, cfg)
                    level[c.label].add_long(res, c.proc.cpu_seconds() - cpu0)
    return {conc: {k: v.summary() for k, v in lv.items()} for conc, lv in results.items()}


def _prompts(
    args: argparse.Namespace, n: int, seed: int, output_len: int | None = None
) -> list[Any]:
    return make_workload(
        WorkloadConfig(
            kind="text",
            num_requests=n,
            input_len=args.input_len,
            output_len=output_len or args.output_len,
            seed=seed,
        )
    )


def _fmt_ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


def print_table(summary: dict[int, dict[str, Any]], labels: list[str], frontend: bool) -> None:
    cols = [
        ("output_tok_s", "out tok/s", 1),
        ("ttft_p50_ms", "TTFT p50 ms", 1),
        ("ttft_p99_ms", "TTFT p99 ms", 1),
        ("itl_p50_ms", "ITL p50 ms", 2),
        ("itl_p99_ms", "ITL p99 ms", 2),
    ]
    if frontend:
        cols += [
            ("server_cpu_us_per_request", "CPU us/req (all of it)", 0),
            ("server_cpu_us_per_token", "CPU us/tok (all of it / tokens)", 1),
            ("fixed_cpu_us_per_request", "CPU us per request (fixed part)", 0),
            ("marginal_cpu_us_per_token", "CPU us per streamed token (marginal)", 1),
        ]
    # ours against each other contender (the peer, and ``base``: ours at --baseline-rev)
    others = labels[1:]
    for key, title, digits in cols:
        print(f"\n{title}")
        head = f"{'conc':>5} " + " ".join(f"{lb:>12}" for lb in labels)
        print(head + "".join(f" {labels[0] + '/' + b:>14}" for b in others))
        for conc, row in summary.items():
            vals = [row[lb].get(key, float("nan")) for lb in labels]
            line = f"{conc:>5} " + " ".join(f"{v:>12.{digits}f}" for v in vals)
            print(line + "".join(f" {_fmt_ratio(vals[0], v):>14}" for v in vals[1:]))

    def per_level(fmt: Callable[[dict[str, Any]], str]) -> str:
        return "; ".join(
            f"c={conc}: " + ", ".join(f"{lb} {fmt(row[lb])}" for lb in labels)
            for conc, row in summary.items()
        )

    print("\nrequests completed/failed: " + per_level(lambda r: f"{r['completed']}/{r['failed']}"))
    if any(r.get("short") for lv in summary.values() for r in lv.values()):
        print(
            "!! requests with fewer or more tokens than forced: "
            + per_level(lambda r: str(r.get("short", 0)))
        )
    print(
        "other processes' CPU during the runs, % of one core (above ~10 the figures are noise): "
        + per_level(lambda r: f"{r['foreign_cpu_pct']:.0f}")
    )
    print(
        f"CPU steal per run, % of the CPUs (above {100 * STEAL_LIMIT:.0f} not comparable): "
        + per_level(lambda r: "/".join(f"{x:.1f}" for x in r.get("rep_steal_pct", [])))
    )
    for conc, row in summary.items():
        for lb in labels:
            for i, x in enumerate(row[lb].get("rep_steal_pct", [])):
                if x > 100 * STEAL_LIMIT:
                    print(f"NOT COMPARABLE: c={conc} {lb} rep {i + 1} ran with {x:.1f} % steal")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.compare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--mode", choices=("model", "frontend"), default="model")
    p.add_argument("--levels", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="requests per level and rep (default 16 model, 256 frontend; "
        "at least the concurrency)",
    )
    p.add_argument("--reps", type=int, default=2, help="A B alternations per level")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument(
        "--long-output-len",
        type=int,
        default=256,
        help="frontend mode: each run is repeated at this output length; the CPU slope "
        "between the two lengths is the cost per streamed token",
    )
    p.add_argument(
        "--api",
        choices=("generate", "completions"),
        default=None,
        help="API used for our server (default completions against llama-server, the "
        "same load as the peer's; generate otherwise); a peer always gets /v1/completions",
    )
    p.add_argument("--time-cap", type=float, default=120.0, help="per run, seconds")
    p.add_argument("--model", default=None, help="GGUF file (default: the bundled SmolLM2)")
    p.add_argument(
        "--peer-python",
        default=None,
        help="python with llama-cpp-python[server] (default: .venv-ref, then this one)",
    )
    p.add_argument(
        "--peer",
        choices=PEERS,
        default="auto",
        help="model mode: the server to compare with. auto (default) = llama-server when "
        "its binary exists (--llama-server, else the `make bench-peer` cache), else "
        "llama-cpp-python",
    )
    p.add_argument(
        "--llama-server",
        default=None,
        metavar="PATH",
        help="the llama-server binary (default: "
        "${LIFECYCLE_PEER_CACHE:-${XDG_CACHE_HOME:-~/.cache}/lifecycle/llama-server}"
        "/bin/llama-server, what `make bench-peer` builds)",
    )
    p.add_argument("--no-peer", action="store_true")
    p.add_argument(
        "--ttft-prompt-len",
        type=int,
        default=500,
        help="model mode: after the levels, the TTFT at c=1 of prompts this long that start "
        "with a random nonce (no prefix cache can serve them); 0 skips it",
    )
    p.add_argument("--ttft-requests", type=int, default=3,
                   help="fresh-prefix prompts per rep (0: no fresh-prefix TTFT)")  # fmt: skip
    p.add_argument("--ours-cmd", default=OURS_CMD)
    p.add_argument(
        "--baseline-rev",
        default=None,
        metavar="REV",
        help="model mode: also run our server as it was at this commit (unpacked with git "
        "archive), label base, in the same A B C rotation: a change measured against the "
        "commit before it, in one run",
    )
    p.add_argument("--ours-frontend-cmd", default=OURS_FRONTEND_CMD)
    p.add_argument("--worker-cmd", default=SCRIPTED_WORKER_CMD)
    p.add_argument("--baseline-http", choices=("auto", "h11", "httptools"), default="auto")
    p.add_argument(
        "--pace-ms",
        type=float,
        default=0.0,
        help="frontend mode: space tokens this far apart in both stacks (the scripted "
        "worker's step delay, the baseline's token delay); 0 = instant",
    )
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--output-file", default=None, help="write the summary as JSON")
    p.add_argument("--quiet", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    model_mode = args.mode == "model"
    if model_mode and not args.no_peer:
        args.peer, note = resolve_peer(args.peer, llama_server.binary_path(args.llama_server))
        if note:
            print(note, file=sys.stderr)
    else:
        args.peer = None
    args.api = args.api or ("completions" if args.peer == "llama-server" else "generate")
    start = start_model_contenders if model_mode else start_frontend_contenders
    contenders, procs = start(args)
    ttft: dict[str, Any] = {}
    rss: dict[str, dict[str, float | None]] = {}
    try:
        if not contenders:
            print("nothing to benchmark: no server started", file=sys.stderr)
            return 1
        summary = compare(contenders, args)
        if model_mode and args.ttft_prompt_len > 0 and args.ttft_requests > 0:
            ttft = fresh_prefix_ttft(contenders, args)
        if model_mode:
            rss = {c.label: server_rss(c) for c in contenders}
    finally:
        for proc in procs:
            proc.stop()
    labels = [c.label for c in contenders]
    print_table(summary, labels, frontend=not model_mode)
    if model_mode:
        print_extras(ttft, rss, args.ttft_prompt_len)
    if args.output_file:
        meta = {k: v for k, v in vars(args).items() if isinstance(v, str | int | float | list)}
        with open(args.output_file, "w") as f:
            json.dump({"args": meta, "levels": summary, "ttft": ttft, "rss": rss}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
