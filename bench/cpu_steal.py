"""The CPU's steal time from ``/proc/stat``: a leg that ran while the hypervisor gave its
cores to someone else is not comparable with one that did not."""

from __future__ import annotations

from pathlib import Path

__all__ = ["steal_share", "steal_ticks"]


def steal_ticks() -> tuple[int, int]:
    """(steal, total) jiffies of all CPUs so far; (0, 0) where ``/proc/stat`` is absent."""
    try:
        f = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return 0, 0
    vals = [int(x) for x in f]
    return vals[7] if len(vals) > 7 else 0, sum(vals)


def steal_share(start: tuple[int, int], end: tuple[int, int]) -> float:
    """The steal share of the CPU time between two ``steal_ticks`` readings."""
    return (end[0] - start[0]) / max(end[1] - start[1], 1)
