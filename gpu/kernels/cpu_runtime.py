"""Process-wide CPU settings for a torch worker, applied before torch is imported
(docs/worker.md, "Threads", has the measurements):

* **OpenMP wake-ups.** libgomp's pool threads spin forever (``OMP_WAIT_POLICY=ACTIVE``:
  they starve the barrier's other thread on a shared CPU) or sleep at once (``PASSIVE``:
  a wake-up, a VM exit here, at each of a step's ~200 parallel regions). About 0.3 ms of
  spin (libgomp counts ~100,000 spins per ms) covers the gaps inside a forward and still
  sleeps between steps and when idle.
* **Page faults on large temporaries.** glibc serves big allocations with ``mmap`` and
  trims freed heap back to the OS, so every step faults the same tens of MB in again; a
  fixed mmap threshold and a high trim threshold keep that memory in the heap.

* **A load's temporaries.** With that trim threshold the blocks a load reads, copies and
  packs stay in the heap once freed; ``trim_heap`` gives their pages back after the load.

An environment that already sets ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` wins.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

__all__ = ["SPIN_COUNT", "TRIM_THRESHOLD", "trim_heap", "tune_cpu_runtime"]

SPIN_COUNT = "30000"
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit
TRIM_THRESHOLD = 512 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def _libc() -> ctypes.CDLL | None:
    """The C library, where it is glibc-like and loadable (Linux); None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def tune_cpu_runtime() -> dict[str, object]:
    """Apply both settings; returns what was set (for the worker's log)."""
    applied: dict[str, object] = {}
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        if "torch" not in sys.modules:  # libgomp reads it once, when torch loads it
            os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
            applied["GOMP_SPINCOUNT"] = SPIN_COUNT
    if (libc := _libc()) is not None:
        try:
            if libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1:
                applied["mmap_threshold"] = MMAP_THRESHOLD
            if libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1:
                applied["trim_threshold"] = TRIM_THRESHOLD
        except AttributeError:  # not glibc (musl has no mallopt): keep defaults
            pass
    return applied


def trim_heap() -> bool:
    """Return the heap's free pages to the system (glibc's ``malloc_trim``): what a load
    freed, kept resident by the trim threshold above. False where there is no glibc."""
    if (libc := _libc()) is None:
        return False
    try:
        return bool(libc.malloc_trim(0))
    except AttributeError:  # not glibc
        return False
