"""What unloading a model gives back, and what loading it again costs (issue 55, point 3).

    python -m bench.model_memory [--model PATH] [--sleep 2] [--device cpu]

Starts ``lifecycle serve --sleep-idle-seconds S`` on the model (default: the bundled
SmolLM2-135M-Instruct), sends one greedy request, and reads the resident memory (RSS,
from /proc through psutil) of the server process and of each worker process it spawned:
loaded, then once the model was idle S seconds and ``/v1/models`` says ``unloaded``.
Then one request wakes it: its latency beside a request to the loaded model (the
baseline, same run), and its tokens beside the first request's (the same).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import httpx
import psutil

from tests.scripted import server_process


def _rss(proc: psutil.Process) -> tuple[int, int, int]:
    """The server's own RSS, its workers' summed RSS, and how many workers run."""
    workers = [c for c in proc.children(recursive=True) if "gpu.worker" in " ".join(c.cmdline())]
    own = proc.memory_info().rss
    return own, sum(w.memory_info().rss for w in workers), len(workers)


def _state(url: str) -> str:
    return str(httpx.get(url + "/v1/models").json()["data"][0]["state"])


def _generate(url: str) -> tuple[list[int], float]:
    body: dict[str, Any] = {"text": "The capital of France is",
                            "sampling_params": {"max_new_tokens": 16, "temperature": 0}}  # fmt: skip
    start = time.monotonic()
    r = httpx.post(url + "/generate", json=body, timeout=300)
    r.raise_for_status()
    return list(r.json()["output_ids"]), time.monotonic() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    ap.add_argument("--sleep", type=float, default=2.0, help="--sleep-idle-seconds")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    flags = ["--device", args.device, "--sleep-idle-seconds", str(args.sleep),
             "--log-level", "warning"]  # fmt: skip
    if args.model:
        flags += ["--model", args.model]
    with server_process(*flags, timeout=300) as (url, proc):
        server = psutil.Process(proc.pid)
        first, _ = _generate(url)
        _, warm = _generate(url)  # the baseline: the model loaded
        loaded = _rss(server)
        while _state(url) != "unloaded":
            time.sleep(0.1)
        while _rss(server)[2]:
            time.sleep(0.05)
        unloaded = _rss(server)
        again, woken = _generate(url)
        mib = 1 << 20
        print(f"model: {httpx.get(url + '/v1/models').json()['data'][0]['id']} on {args.device}")
        print(f"{'':24} {'server RSS':>11} {'workers RSS':>12} {'workers':>8}")
        for name, (own, workers, n) in (("loaded", loaded), ("unloaded (asleep)", unloaded)):
            print(f"{name:24} {own / mib:8.0f} MiB {workers / mib:9.0f} MiB {n:8d}")
        given = loaded[0] + loaded[1] - unloaded[0] - unloaded[1]
        print(f"given back by unloading: {given / mib:.0f} MiB")
        print(f"request to the loaded model: {warm * 1e3:8.0f} ms")
        print(f"request that loads it again: {woken * 1e3:8.0f} ms")
        print(f"same tokens after waking: {again == first}")


if __name__ == "__main__":
    main()
