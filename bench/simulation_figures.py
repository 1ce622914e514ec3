"""The reliability table's two simulation figures (``bench/reliability.py``): neither
needs the server that the other figures run against. Each returns its table rows
(figure, counts, value, target) and prints the replay command of the first failures."""

from __future__ import annotations

import time

__all__ = ["Row", "dsim", "simulation"]

Row = tuple[str, str, str, str]  # figure, counts, value, target


async def simulation(seeds: int) -> list[Row]:
    """The seeded client/worker simulation (tests/simulation.py), in-process server of its
    own: scenarios run, leaks found, broken invariants."""
    from tests.simulation import run_scenarios

    t0 = time.monotonic()
    report = await run_scenarios(range(seeds))
    counts = f"{report.scenarios} seeded scenarios, {time.monotonic() - t0:.0f} s"
    for seed, problem in report.broken[:10]:
        print(f"    seed {seed}: {problem} (replay: python -m tests.simulation --seed {seed})")
    return [("simulation: leaks found", counts, str(report.leaks), "0"),
            ("simulation: broken invariants", counts, str(len(report.broken)), "0")]  # fmt: skip


def dsim(seeds: int, jobs: int) -> list[Row]:
    """The deterministic simulation (tests/dsim), in ``jobs`` processes: no server of
    this run is involved, every scenario builds its own in memory."""
    from tests.dsim.run import replay_command
    from tests.dsim.sweep import sweep

    report = sweep(range(seeds), jobs=jobs)
    rate = report.scenarios / report.seconds if report.seconds else 0.0
    counts = f"{report.scenarios} scenarios, {jobs} processes, {report.seconds:.0f} s"
    for seed, violations in report.failures[:10]:
        name, what = violations[0]
        print(f"    seed {seed}: {name}: {what} (replay: {replay_command(seed)})")
    return [
        ("deterministic simulation: scenarios run", counts, f"{report.scenarios} ({rate:.0f}/s)",
         ">= 100,000 in 10 min"),
        ("deterministic simulation: distinct shapes", counts, str(len(report.shapes)), "-"),
        ("deterministic simulation: violations", counts, str(len(report.failures)), "0"),
        ("deterministic simulation: known findings", counts, str(len(report.known)),
         "listed in tests/dsim/known.py"),
    ]  # fmt: skip
