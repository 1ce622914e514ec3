"""The deterministic simulation from the command line.

python -m tests.dsim --seed N              replay one seed: its trace and violations
python -m tests.dsim --seeds 1000 --jobs 2 run seeds 0..999: scenarios, shapes, violations
python -m tests.dsim --mutate NAME         break the product (tests.dsim.mutations) and
                                           count the seeds until the simulation notices
"""

from __future__ import annotations

import argparse
import sys

from tests.dsim.mutations import MUTATIONS, mutated
from tests.dsim.run import replay_command, run_seed
from tests.dsim.sweep import hunt, sweep


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.dsim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--seed", type=int, help="replay this seed and print its trace")
    p.add_argument("--seeds", type=int, default=1000, help="how many seeds to run")
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--jobs", type=int, default=1, help="processes")
    p.add_argument("--mutate", choices=sorted(MUTATIONS), help="break the product this way")
    args = p.parse_args(argv)
    if args.mutate:
        with mutated(args.mutate) as m:
            if args.seed is not None:
                return replay(args.seed)
            seeds = range(args.start, args.start + args.seeds)
            seed, n, what = hunt(m.invariant, seeds)
            found = (
                f"seed {seed} after {n} seeds: {what}"
                if seed is not None
                else f"NOT found in {n} seeds"
            )
            print(f"mutation {m.name} ({m.what}) -> {m.invariant}: {found}")
            return 0 if seed is not None else 1
    if args.seed is not None:
        return replay(args.seed)
    report = sweep(range(args.start, args.start + args.seeds), jobs=args.jobs)
    print(report.summary())
    for seed, violations in report.failures[:20]:
        print(
            f"seed {seed}: {violations[0][0]}: {violations[0][1]}\n  replay: {replay_command(seed)}"
        )
    return 0 if not report.failures else 1


def replay(seed: int) -> int:
    result = run_seed(seed, keep_trace=True)
    print("\n".join(result.trace))
    for name, what in result.violations:
        print(f"VIOLATION {name}: {what}")
    if result.known:
        print(result.known)
    print(f"seed {seed}: {'ok' if result.ok else 'FAILED'}; {result.virtual_s:.3f} virtual s, "
          f"{result.passes} loop passes, {result.real_s * 1e3:.1f} ms")  # fmt: skip
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
