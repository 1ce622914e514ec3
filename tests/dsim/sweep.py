"""Many seeds, in one process or several: scenarios run, shapes covered, violations."""

from __future__ import annotations

import multiprocessing
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tests.dsim.run import run_seed
from tests.dsim.world import model

__all__ = ["Report", "hunt", "sweep"]


@dataclass(slots=True)
class Report:
    scenarios: int = 0
    shapes: set[Any] = field(default_factory=set)
    failures: list[tuple[int, list[tuple[str, str]]]] = field(default_factory=list)
    known: list[tuple[int, str]] = field(default_factory=list)
    by_invariant: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0
    virtual_s: float = 0.0

    def add(self, seed: int, shape: Any, violations: list[tuple[str, str]], virtual_s: float,
            known: str | None) -> None:  # fmt: skip
        self.scenarios += 1
        self.shapes.add(shape)
        self.virtual_s += virtual_s
        if violations and known is not None:
            self.known.append((seed, known))
        elif violations:
            self.failures.append((seed, violations))
            self.by_invariant.update({name for name, _ in violations})

    def summary(self) -> str:
        rate = self.scenarios / self.seconds if self.seconds else 0.0
        return (
            f"scenarios run: {self.scenarios}; distinct shapes: {len(self.shapes)}; "
            f"violations: {len(self.failures)} {dict(self.by_invariant)}; "
            f"known findings: {len(self.known)}; "
            f"{self.seconds:.1f} s ({rate:.0f} scenarios/s), {self.virtual_s:.0f} virtual s"
        )


def _one(seed: int) -> tuple[int, Any, list[tuple[str, str]], float, str | None]:
    r = run_seed(seed)
    return seed, r.shape, r.violations, r.virtual_s, r.known


def sweep(seeds: Iterable[int], jobs: int = 1) -> Report:
    report = Report()
    t0 = time.perf_counter()
    if jobs <= 1:
        for seed in seeds:
            report.add(*_one(seed))
    else:
        model()  # loaded once, before the fork: every process shares it
        ctx = multiprocessing.get_context("fork")
        with ctx.Pool(jobs) as pool:
            for item in pool.imap_unordered(_one, seeds, chunksize=64):
                report.add(*item)
        report.failures.sort()
        report.known.sort()
    report.seconds = time.perf_counter() - t0
    return report


def hunt(invariant: str, seeds: Iterable[int]) -> tuple[int | None, int, str]:
    """Run seeds in order until one reports ``invariant``: (that seed, seeds run, what broke)."""
    n = 0
    for seed in seeds:
        n += 1
        for name, what in run_seed(seed).violations:
            if name == invariant:
                return seed, n, what
    return None, n, ""
