"""The worker's step figures in STATS (``specs/wire.cddl``: ``step-histogram``).

A worker counts each scheduler step once, after it ran: its time, its batch (sequences)
and its tokens, each into a fixed-bucket histogram. That is a few additions per step,
never per token. The counts only grow while the worker lives (a restart starts them
again, as a Prometheus counter does), so any number of readers (``/metrics`` scrapes,
``/server_info``) see the same figures and none takes them from another. On the wire a
histogram is ``{"le": bounds, "counts": per bucket, the last one past every bound,
"sum": sum of the values}``; ``read_histogram`` turns that into Prometheus' cumulative
buckets, or None when it is malformed (a worker of another version).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from typing import Any

__all__ = [
    "STEP_BATCH_BOUNDS",
    "STEP_SECONDS_BOUNDS",
    "STEP_TOKENS_BOUNDS",
    "StepStats",
    "WireHistogram",
    "read_histogram",
]

STEP_SECONDS_BOUNDS = (
    0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1,
    0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
STEP_BATCH_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
STEP_TOKENS_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class WireHistogram:
    """Counts per bucket (value <= bound; the last bucket takes the rest) and a sum."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total: float = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def to_wire(self) -> dict[str, Any]:
        return {"le": list(self.bounds), "counts": list(self.counts), "sum": self.total}


class StepStats:
    """One worker's steps since it started: ``record`` once per step that ran."""

    __slots__ = ("batch", "seconds", "tokens")

    def __init__(self) -> None:
        self.seconds = WireHistogram(STEP_SECONDS_BOUNDS)
        self.batch = WireHistogram(STEP_BATCH_BOUNDS)
        self.tokens = WireHistogram(STEP_TOKENS_BOUNDS)

    def record(self, seconds: float, sequences: int, tokens: int) -> None:
        self.seconds.observe(seconds)
        self.batch.observe(sequences)
        self.tokens.observe(tokens)

    def to_wire(self) -> dict[str, Any]:
        """The STATS keys: ``step_seconds``, ``step_batch``, ``step_tokens``."""
        return {
            "step_seconds": self.seconds.to_wire(),
            "step_batch": self.batch.to_wire(),
            "step_tokens": self.tokens.to_wire(),
        }


def read_histogram(value: Any) -> tuple[list[tuple[float, int]], float] | None:
    """A wire histogram -> (cumulative ``(bound, count)`` pairs ending with ``inf``, sum);
    None unless it is well formed: ascending numeric bounds, one more count than bounds,
    each a non-negative integer, a numeric sum."""
    if not isinstance(value, dict):
        return None
    bounds, counts, total = value.get("le"), value.get("counts"), value.get("sum")
    if not (isinstance(bounds, list) and isinstance(counts, list)):
        return None
    if len(counts) != len(bounds) + 1 or not isinstance(total, int | float):
        return None
    if not all(isinstance(b, int | float) and not isinstance(b, bool) for b in bounds):
        return None
    if any(b >= c for b, c in zip(bounds, bounds[1:], strict=False)):
        return None
    if not all(type(c) is int and c >= 0 for c in counts):
        return None
    out, running = [], 0
    for bound, count in zip([*bounds, math.inf], counts, strict=True):
        running += count
        out.append((float(bound), running))
    return out, float(total)
