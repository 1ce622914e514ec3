"""Handoff buffers: admission (handler -> dispatcher) and egress (dispatcher -> client writer).

Both are in-memory and sans-IO: no awaiting, no clock, no event. Whoever reads a
buffer is woken by its own means (a ``GenerateCall`` by the sink that wraps the buffer,
``lifecycle.core.call``). The dispatcher side is synchronous and never blocks: a slow
client does not slow the worker or other requests, it only receives fewer, larger
chunks (one per wake-up, holding everything appended since its last read), and never a
gap.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["ADMISSION_BOUND", "CONTROL_HEADROOM", "AdmissionQueue", "Chunk", "OutputBuffer",
           "OutputOverflow"]  # fmt: skip

ADMISSION_BOUND = 1024  # requests admitted and not yet dispatched (--max-queued's default)
# Dispatch-queue places beyond the admission bound: control probes (the warm-up, the
# health generation) go through the worker client without taking an admission slot.
CONTROL_HEADROOM = 8


class AdmissionQueue:
    """A bounded count of requests admitted and not yet released.

    ``try_admit`` refuses when full: the caller then ends the request error(overloaded),
    so nothing waits unboundedly in memory. Every admitted request calls ``release``
    exactly once, when it leaves the frontend's queue (dispatched or ended).
    """

    __slots__ = ("capacity", "_depth")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._depth = 0

    @property
    def depth(self) -> int:
        return self._depth

    @property
    def full(self) -> bool:
        return self._depth >= self.capacity

    def try_admit(self) -> bool:
        if self._depth >= self.capacity:
            return False
        self._depth += 1
        return True

    def release(self) -> None:
        if self._depth <= 0:
            raise RuntimeError("AdmissionQueue.release() without a matching try_admit()")
        self._depth -= 1


class OutputOverflow(RuntimeError):
    """More tokens arrived than the request may ever produce: a worker bug, not a drop."""


@dataclass(slots=True)
class Chunk:
    """Everything appended since the previous read; ``end`` once the terminal is reached.

    ``start`` is the output position of ``ids[0]``; ``extras`` are the non-empty
    ``extra`` maps in append order, each as given for its own append.
    """

    ids: list[int]
    extras: list[dict[str, Any]] = field(default_factory=list)
    end: Any | None = None
    start: int = 0


class OutputBuffer:
    """Append-only output of one sample, drained by its client writer.

    ``limit`` is the most tokens the sample may ever produce (its ``max_new_tokens``
    plus ``FrontendConfig.output_margin``; each of ``n`` samples has a buffer of its own);
    exceeding it raises OutputOverflow rather than growing without bound.
    The terminal marker (a finish-reason dict or a Cause) is delivered only with or after
    the last data, so a reader never sees the end before all tokens.
    """

    __slots__ = ("limit", "total", "_ids", "_extras", "_end", "_delivered_end", "_taken")

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        self.limit = limit
        self.total = 0
        self._ids: list[int] = []
        self._extras: list[dict[str, Any]] = []
        self._end: Any | None = None
        self._delivered_end = False
        self._taken = 0

    @property
    def ended(self) -> bool:
        return self._end is not None

    @property
    def pending(self) -> int:
        """Tokens appended and not yet taken."""
        return len(self._ids)

    def append(self, ids: list[int], extra: dict[str, Any] | None = None) -> bool:
        """Add new tokens (dispatcher side: sync, never blocks). False once ended.

        Output that arrives after the end (a late step for a request that was already
        aborted or failed) is ignored: the reader has its terminal already.
        """
        if self._end is not None:
            return False
        if self.total + len(ids) > self.limit:
            raise OutputOverflow(
                f"{self.total + len(ids)} tokens exceed this request's limit {self.limit}"
            )
        self._ids.extend(ids)
        self.total += len(ids)
        if extra:
            self._extras.append(extra)
        return True

    def finish(self, reason: Any) -> bool:
        """Set the terminal marker; the first one wins. False if already ended."""
        if reason is None:
            raise ValueError("the terminal marker cannot be None")
        if self._end is not None:
            return False
        self._end = reason
        return True

    def take_nowait(self) -> Chunk | None:
        """Everything available now, or None if there is nothing new."""
        if not self._ids and not self._extras and (self._end is None or self._delivered_end):
            # After the end was delivered, keep answering it (idempotent readers).
            return Chunk([], [], self._end, self._taken) if self._delivered_end else None
        ids, self._ids = self._ids, []
        extras, self._extras = self._extras, []
        start, self._taken = self._taken, self._taken + len(ids)
        if self._end is not None:
            self._delivered_end = True
        return Chunk(ids, extras, self._end, start)
