"""Figures bench/compare.py takes once per server beside its load table: the TTFT of a
long prompt that no prefix cache can serve, each server's resident memory, and the CPU
steal verdict (a run during which the hypervisor took more than ``STEAL_LIMIT`` of the
CPUs is not comparable with one during which it did not)."""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import urllib.request
from typing import TYPE_CHECKING, Any

from bench import llama_server
from bench.cpu_steal import steal_share, steal_ticks
from bench.procs import ServerProcess
from bench.serving import LoadConfig, run_load_sync
from bench.workload import Prompt, WorkloadConfig, make_workload

if TYPE_CHECKING:
    from bench.contenders import Contender

__all__ = ["STEAL_LIMIT", "fresh_prefix_ttft", "print_extras", "server_rss"]

STEAL_LIMIT = 0.10


def _fresh_prefix_prompts(n: int, length: int, seed: int) -> list[Prompt]:
    """``length``-word prompts that each start with a random nonce, so that no prompt or
    slot cache can serve any prefix of them; one output token each."""
    base = make_workload(
        WorkloadConfig(kind="text", num_requests=n, input_len=length, output_len=1, seed=seed)
    )
    return [Prompt(f"[{secrets.token_hex(6)}] {p.prompt}", p.prompt_len, 1) for p in base]


def fresh_prefix_ttft(contenders: list[Contender], args: argparse.Namespace) -> dict[str, Any]:
    """TTFT at concurrency 1 of ``--ttft-prompt-len`` prompts with a fresh prefix, A B A B:
    per contender the median and every sample, in ms."""
    samples: dict[str, list[float]] = {c.label: [] for c in contenders}
    steal: dict[str, list[float]] = {c.label: [] for c in contenders}
    cfg = LoadConfig(max_concurrency=1, time_cap_s=args.time_cap, warmup_requests=0, progress=False)
    for rep in range(args.reps):
        for c in contenders:
            print(f"== TTFT of {args.ttft_prompt_len} fresh tokens, rep {rep + 1}: {c.label}")
            prompts = _fresh_prefix_prompts(args.ttft_requests, args.ttft_prompt_len, 100 + rep)
            s0 = steal_ticks()
            res = run_load_sync(c.target, c.spec, prompts, cfg)
            steal[c.label].append(100 * steal_share(s0, steal_ticks()))
            samples[c.label] += [1e3 * o.ttft for o in res.outputs if o.success]
    return {
        lb: {
            "median_ms": sorted(v)[len(v) // 2] if v else float("nan"),
            "samples_ms": v,
            "rep_steal_pct": steal[lb],
        }
        for lb, v in samples.items()
    }


def _worker_pids(proc: ServerProcess) -> list[int]:
    """Our model workers' pids, as our server's ``/server_info`` reports them."""
    url = f"http://{proc.host}:{proc.port}/server_info"
    with urllib.request.urlopen(url, timeout=30) as r:
        info = json.load(r)
    return [int(s["pid"]) for s in info.get("internal_states", []) if s.get("pid")]


def server_rss(c: Contender) -> dict[str, float | None]:
    """Resident MiB: for ours the model worker (and the frontend beside it), for a peer
    its one process."""
    rss = llama_server.rss_mib
    if c.kind != "ours":
        return {"process": rss(c.proc.popen.pid)}
    try:
        workers = _worker_pids(c.proc)
    except (OSError, ValueError, KeyError) as exc:
        print(f"ours: /server_info gave no worker pid ({exc})", file=sys.stderr)
        workers = []
    worker = sum(filter(None, (rss(p) for p in workers))) if workers else None
    return {"worker": worker, "frontend": rss(c.proc.popen.pid)}


def print_extras(ttft: dict[str, Any], rss: dict[str, dict[str, float | None]], n: int) -> None:
    """The fresh-prefix TTFT and the RSS lines, after the table."""

    def mib(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}"

    labels = list(rss)
    if ttft:
        vals = [ttft[lb]["median_ms"] for lb in labels]
        line = ", ".join(f"{lb} {v:.0f}" for lb, v in zip(labels, vals, strict=True))
        ratio = "".join(
            f"; {labels[0]}/{lb} {vals[0] / v:.2f}"
            for lb, v in zip(labels[1:], vals[1:], strict=True)
        )
        steal = ", ".join(
            f"{lb} " + "/".join(f"{x:.1f}" for x in ttft[lb]["rep_steal_pct"]) for lb in labels
        )
        print(f"\nTTFT of a {n}-token prompt with a fresh prefix at c=1, median ms: {line}{ratio}")
        print(f"  steal per rep, %: {steal}")
        for lb in labels:
            if any(x > 100 * STEAL_LIMIT for x in ttft[lb]["rep_steal_pct"]):
                print(f"NOT COMPARABLE: the TTFT of {lb} ran with steal above 10 %")
    parts = []
    for lb, r in rss.items():
        if "worker" in r:
            parts.append(f"{lb} worker {mib(r['worker'])} (frontend {mib(r['frontend'])})")
        else:
            parts.append(f"{lb} {mib(r['process'])}")
    print("RSS after the runs, idle, MiB: " + ", ".join(parts))
