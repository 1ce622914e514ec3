"""The seeded client/worker simulation at scale (``tests/simulation.py``).

    python bench/simulate.py                  # 10,000 seeds from 0
    python bench/simulate.py --seeds 2000 --start 5000 --concurrency 4

Prints ``scenarios run: N, leaks found: L, broken invariants: B``, then the failing
kinds of scenario and each failing seed with the command that replays it; exits 1 on
any failure.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import anyio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.simulation import SimReport, print_report, run_scenarios  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/simulate.py", description=__doc__)
    p.add_argument("--seeds", type=int, default=10_000)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--limit", type=int, default=50, help="failing seeds to print")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.CRITICAL)  # the server logs every injected fault
    seeds = range(args.start, args.start + args.seeds)
    last = [time.monotonic()]

    def progress(report: SimReport) -> None:
        if time.monotonic() - last[0] >= 10:
            last[0] = time.monotonic()
            print(f"... {report.summary()}", file=sys.stderr, flush=True)

    report = anyio.run(
        lambda: run_scenarios(seeds, concurrency=args.concurrency, progress=progress)
    )
    print_report(report, limit=args.limit)
    return 1 if report.leaks or report.broken else 0


if __name__ == "__main__":
    sys.exit(main())
