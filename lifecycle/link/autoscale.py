"""How many replicas a Ray deployment wants for its load (``--ray-autoscale MIN:MAX``).

The core only: ``Autoscaler.target`` takes one reading (the time, the replicas wanted
now, and what each ready one holds) and answers the count wanted next; it never reads a
clock or touches a replica (``RayWorkers`` reads and applies it every ``TICK_S``).

- **Queued**: what a ready replica holds (in flight at its worker plus queued for it)
  beyond what it runs at once (its HELLO's ``max_running``). While the queued requests
  per ready replica stay above ``queue`` for ``up_after`` seconds, and every replica
  wanted is ready (one still starting would take them), one more, up to ``high``.
- **Low**: what all of them hold would run on one replica fewer, none queued. Low for
  ``down_after`` seconds: one fewer (drained first), down to ``low``.

Each change starts both waits again, so the count moves one replica at a time.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["TICK_S", "AutoscaleConfig", "Autoscaler", "autoscale_bounds", "autoscale_after"]

TICK_S = 0.5  # how often the load is read


@dataclass(frozen=True, slots=True)
class AutoscaleConfig:
    low: int  # MIN replicas
    high: int  # MAX replicas
    queue: float = 1.0  # queued requests per ready replica that ask for one more
    up_after: float = 10.0  # seconds the queue stays above ``queue`` before one more
    down_after: float = 60.0  # seconds the load stays low before one fewer


def autoscale_bounds(text: str) -> tuple[int, int]:
    """``--ray-autoscale MIN:MAX``: 1 <= MIN <= MAX; ValueError saying what it takes."""
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text)
    if m is None:
        raise ValueError(f"--ray-autoscale takes MIN:MAX replicas (e.g. 1:4), got {text!r}")
    low, high = int(m[1]), int(m[2])
    if low < 1 or low > high:
        raise ValueError(f"--ray-autoscale MIN:MAX needs 1 <= MIN <= MAX, got {low}:{high}")
    return low, high


def autoscale_after(text: str) -> tuple[float, float]:
    """``--ray-autoscale-after UP:DOWN`` seconds, both positive; ValueError otherwise."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*:\s*([0-9.]+)\s*", text)
    try:
        up, down = (float(m[1]), float(m[2])) if m else (0.0, 0.0)
    except ValueError:
        up = down = 0.0
    if up <= 0 or down <= 0:
        raise ValueError(
            f"--ray-autoscale-after takes UP:DOWN seconds > 0 (e.g. 10:60), got {text!r}"
        )
    return up, down


class Autoscaler:
    """The count of replicas wanted, from one reading after another (module docstring)."""

    def __init__(self, config: AutoscaleConfig) -> None:
        self.config = config
        self._busy_since: float | None = None
        self._low_since: float | None = None

    def target(self, now: float, count: int, held: Sequence[int], running: int) -> int:
        """The count wanted after this reading. ``count``: replicas wanted now; ``held``:
        the requests each ready replica holds; ``running``: how many one runs at once."""
        cfg = self.config
        ready = len(held)
        queued = sum(max(0, h - running) for h in held)
        busy = ready == count and queued > cfg.queue * ready
        low = count > cfg.low and not queued and sum(held) <= running * (count - 1)
        self._busy_since = _since(self._busy_since, now) if busy else None
        self._low_since = _since(self._low_since, now) if low else None
        want = count
        if self._busy_since is not None and now - self._busy_since >= cfg.up_after:
            want = min(count + 1, cfg.high)
        elif self._low_since is not None and now - self._low_since >= cfg.down_after:
            want = max(count - 1, cfg.low)
        if want != count:
            self._busy_since = self._low_since = None
        return max(cfg.low, min(cfg.high, want))


def _since(start: float | None, now: float) -> float:
    return now if start is None else start
