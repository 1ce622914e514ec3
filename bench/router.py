"""Prefix affinity over ``serve --dp 2``: 8 distinct 300-token system prompts, 64 requests
each in one random order, through each router policy in the same run; prints the
``cached_tokens`` summed over the requests against the ideal (every request but each
prompt's first reusing its whole prefix), the time, and how the calls were spread.

    python bench/router.py                      # real model, both policies, 512 requests
    python bench/router.py --families 4 --per-family 16 --policies cache_aware

Each worker's KV cache is sized (``--kv-cache-tokens``, default 2048: about six of the
prefixes) so that no worker can hold all eight: a policy that sends every prompt
everywhere thrashes the caches; one that keeps a prompt on one worker does not.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.procs import ServerProcess, free_port, serve_argv  # noqa: E402


def workload(families: int, per_family: int, prefix: int, seed: int) -> list[tuple[int, list[int]]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000, 40000) for _ in range(prefix)] for _ in range(families)]
    reqs = [(k, prefixes[k] + [rng.randrange(1000, 40000) for _ in range(8)])
            for k in range(families) for _ in range(per_family)]  # fmt: skip
    rng.shuffle(reqs)
    return reqs


async def drive(url: str, reqs: list[tuple[int, list[int]]], concurrency: int) -> list[int]:
    slots = asyncio.Semaphore(concurrency)
    cached = [0] * len(reqs)

    async def one(c: httpx.AsyncClient, i: int, ids: list[int]) -> None:
        async with slots:
            r = await c.post("/generate", json={"input_ids": ids,
                             "sampling_params": {"max_new_tokens": 1}})  # fmt: skip
            r.raise_for_status()
            cached[i] = r.json()["meta_info"]["cached_tokens"]

    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        await asyncio.gather(*(one(c, i, ids) for i, (_k, ids) in enumerate(reqs)))
    return cached


def run_policy(args: argparse.Namespace, policy: str, reqs: list) -> dict:
    port = free_port()
    flags: dict[str, object] = {"dp": 2, "router_policy": policy, "max_running": 8,
                                "max_pending": 16, "kv_cache_tokens": args.kv_cache_tokens}  # fmt: skip
    argv = serve_argv(port, scripted=False, **flags)
    srv = ServerProcess.start(f"router-{policy}", argv, port, "/health", timeout_s=600, cwd=ROOT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600  # /health is 200 with one ready: wait for both
        while not all(
            w["ready"] for w in httpx.get(url + "/server_info").json()["internal_states"]
        ):
            if time.monotonic() > deadline:
                raise RuntimeError("the workers did not all start")
            time.sleep(0.2)
        t0 = time.perf_counter()
        cached = asyncio.run(drive(url, reqs, args.concurrency))
        dt = time.perf_counter() - t0
        info = httpx.get(url + "/server_info", timeout=10).json()
    finally:
        srv.stop()
    return {"cached": sum(cached), "seconds": dt, "picks": info["router"]["picks"],
            "hits": info["router"]["affinity_hits"]}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--families", type=int, default=8)
    p.add_argument("--per-family", type=int, default=64)
    p.add_argument("--prefix", type=int, default=300, help="tokens of each system prompt")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--kv-cache-tokens", type=int, default=2048, help="per worker")
    p.add_argument("--policies", nargs="+", default=["cache_aware", "round_robin"])
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    reqs = workload(args.families, args.per_family, args.prefix, args.seed)
    ideal = args.prefix * (len(reqs) - args.families)
    print(f"{len(reqs)} requests: {args.families} prefixes of {args.prefix} tokens x "
          f"{args.per_family}, concurrency {args.concurrency}, 2 workers of "
          f"{args.kv_cache_tokens} KV tokens each; ideal cached_tokens {ideal}")  # fmt: skip
    for policy in args.policies:
        r = run_policy(args, policy, reqs)
        print(f"  {policy:<12} cached_tokens {r['cached']:>7} = {100 * r['cached'] / ideal:5.1f} % "
              f"of ideal, {r['seconds']:6.1f} s, picks {r['picks']}, affinity hits {r['hits']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
