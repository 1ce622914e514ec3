"""Serving throughput of workers placed by Ray against workers spawned here (issue 58).

    python -m bench.ray_serving [--model PATH] [--dp 2] [--rounds 2] [--num-requests 48]

Starts ``lifecycle serve --dp N`` and ``lifecycle serve --ray --dp N`` (a local Ray
cluster of this machine, on loopback, no dashboard) one after the other on the same
model (default: the bundled SmolLM2-135M-Instruct), and pushes each with the same closed
loop of streamed ``/generate`` requests (``bench.serving``: fixed prompt and output
lengths, output forced by ``ignore_eos``), ``--rounds`` times in turn so that a drift
of the machine falls on both. Prints each round's output tok/s side by side, the means
and their ratio (issue 58's target: ``--ray`` within 5 % of ``--dp``).

Both run ``--threads`` torch threads per worker (default 1): a Ray replica's worker
otherwise takes ``OMP_NUM_THREADS``, which Ray sets to its actor's CPUs, while a worker
spawned here takes the CPUs it may use, and the comparison would be of thread counts.
Ray also starts its worker processes niced (15), and a replica's worker inherits that:
on a machine whose CPUs the load generator and the frontend share with the workers, a
niced worker yields to them and its batches fill sooner. Each line says the workers'
nice value; ``--local-nice N`` renices the workers spawned here to compare like with
like.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Sequence

import httpx
import psutil

from bench.apis import RequestSpec
from bench.client import Target
from bench.serving import LoadConfig, run_load_sync
from bench.workload import WorkloadConfig, make_workload
from tests.scripted import server_process

# Ray finds a node's address from the route to the internet unless told this: with it
# the local cluster, its drivers and workers stay on 127.0.0.1 (as tests/test_ray.py).
LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
TARGET_RATIO = 0.95


def _workers(url: str, server: psutil.Process) -> list[psutil.Process]:
    """The server's worker processes: its Ray replicas' (``/server_info``), else the
    ones it spawned."""
    replicas = httpx.get(url + "/server_info", timeout=10).json().get("ray_replicas")
    if replicas is not None:
        return [psutil.Process(r["pid"]) for r in replicas]
    kids = server.children(recursive=True)
    return [p for p in kids if "gpu.worker" in " ".join(p.cmdline())]


def _throughput(flags: Sequence[str], args: argparse.Namespace) -> tuple[float, int]:
    """Output tok/s of one run against a server started with ``flags``, and its
    workers' nice value."""
    prompts = make_workload(
        WorkloadConfig(
            num_requests=args.num_requests, input_len=args.input_len, output_len=args.output_len
        )
    )
    load = LoadConfig(max_concurrency=args.concurrency, warmup_requests=args.dp, progress=False)
    with server_process(*flags, env=LOOPBACK, timeout=300) as (url, proc):
        workers = _workers(url, psutil.Process(proc.pid))
        if args.local_nice is not None and "--ray" not in flags:
            for w in workers:  # every thread: Linux keeps a nice value per thread
                for t in w.threads():
                    os.setpriority(os.PRIO_PROCESS, t.id, args.local_nice)
        nice = workers[0].nice()
        result = run_load_sync(Target.from_url(url), RequestSpec(), prompts, load)
    if result.errors:
        raise RuntimeError(f"{' '.join(flags)}: requests failed: {result.errors}")
    return result.metrics.output_throughput, nice


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dp", type=int, default=2, help="replicas (workers) of both servers")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each server, in turn")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each worker")
    ap.add_argument("--local-nice", type=int, default=None, help="renice the local workers")
    ap.add_argument("--num-requests", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    args = ap.parse_args(argv)
    base = ["--device", args.device, "--dp", str(args.dp), "--threads", str(args.threads),
            "--log-level", "warning"]  # fmt: skip
    if args.model:
        base += ["--model", args.model]
    modes = {f"--dp {args.dp}": base, f"--ray --dp {args.dp}": [*base, "--ray"]}
    runs: dict[str, list[float]] = {name: [] for name in modes}
    nice: dict[str, int] = {}
    for _ in range(args.rounds):  # in turn: one server per mode per round
        for name, flags in modes.items():
            tok_s, nice[name] = _throughput(flags, args)
            runs[name].append(tok_s)
    print(
        f"{args.num_requests} requests, {args.concurrency} at a time, {args.input_len} "
        f"prompt words, {args.output_len} output tokens, {args.device}, {args.threads} "
        f"thread(s) per worker"
    )
    heads = [f"{name} (nice {nice[name]}) tok/s" for name in modes]
    print(f"{'round':>6}" + "".join(f"{h:>30}" for h in heads))
    for i in range(args.rounds):
        print(f"{i + 1:>6}" + "".join(f"{runs[name][i]:>30.1f}" for name in modes))
    local, ray = (statistics.fmean(runs[name]) for name in modes)
    print(f"{'mean':>6}{local:>30.1f}{ray:>30.1f}")
    ratio = ray / local
    verdict = "met" if ratio >= TARGET_RATIO else "missed"
    print(f"--ray / local: {ratio:.3f} (target: at least {TARGET_RATIO}: {verdict})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
