"""The worker's CPU threads: how many, set once in every pool, and fewer while other
processes want the CPUs (docs/worker.md, "Threads", has the measurements).

How many (``resolve_threads``): ``--threads``, else ``OMP_NUM_THREADS`` where the
environment sets it, else the CPUs this process may use (``wire/cpu_budget.py``), less a
core for a frontend beside it on a many-core host: torch's intra-op pool, the native
kernels and, through the environment, the pools of processes this one starts.

Fewer while the CPUs are taken (``ThreadGovernor``): each of a step's ~200 parallel
regions ends at a barrier that waits for every thread, and a thread another busy
process pushed off its core returns only after that process's time slice. The governor
reads this process's run delay (``/proc/self/task/*/schedstat``) and the allowed CPUs'
idle time (``/proc/stat``) and moves the count by one. The thread count changes no
result on the default quantized path (docs/determinism.md): only speed.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import NamedTuple

import torch

from wire.cpu_budget import cpu_budget, worker_threads

__all__ = ["ThreadGovernor", "apply_threads", "resolve_threads", "worker_governor"]

log = logging.getLogger("gpu.worker")

_POOL_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def resolve_threads(threads: int | None, frontend_beside: bool) -> tuple[int, str]:
    """The thread count and why, for the start-up line (``threads 2 (cgroup quota 2.0
    CPUs)``). ``frontend_beside``: a frontend shares this host (a Unix-socket worker)."""
    if threads is not None:
        return threads, "--threads"
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env), f"OMP_NUM_THREADS={env}"
    return worker_threads(cpu_budget(), frontends=1 if frontend_beside else 0)


def worker_governor(threads: int, device: str, tp: int) -> ThreadGovernor:
    """The worker's governor: on the CPU at ``--tp 1`` (the followers of ``--tp`` keep
    their threads, and on CUDA the threads feed the host only);
    ``LIFECYCLE_FIXED_THREADS=1`` holds the count (``bench/contention.py``'s baseline)."""
    fixed = os.environ.get("LIFECYCLE_FIXED_THREADS") == "1"
    return ThreadGovernor(threads, enabled=device == "cpu" and tp == 1 and not fixed)


def apply_threads(threads: int) -> None:
    """Every pool of this process (and of the processes it starts) on ``threads``."""
    torch.set_num_threads(threads)
    for name in _POOL_VARS:
        os.environ[name] = str(threads)


def _run_delay_ns() -> int:
    """The time this process's threads spent runnable and waiting for a CPU, in ns:
    the second field of each thread's schedstat (Linux with schedstats; 0 without)."""
    total = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/schedstat", "rb") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # a thread that just ended
    return total


def _idle_ticks(cpus: frozenset[int]) -> int:
    """Idle and iowait clock ticks of ``cpus`` since boot (``/proc/stat``)."""
    total = 0
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return 0
    for line in lines[1:]:
        if not line.startswith("cpu"):
            break
        name, *fields = line.split()
        if int(name[3:]) in cpus:
            total += int(fields[3]) + int(fields[4])
    return total


_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


class _Sample(NamedTuple):
    wall_ns: int
    delay_ns: int
    idle_ticks: int


class ThreadGovernor:
    """Between ``1`` and ``ceiling`` threads, moved by one at most every ``window_s``
    of stepping. Call ``after_step()`` after each step (cheap: a clock read)."""

    # Our threads wait for a CPU even on a quiet machine (a woken pool thread waits out
    # the scheduler's wake-up latency while CPUs sit idle: docs/worker.md has the
    # figures), so the waiting that idle CPUs cannot explain counts: above this a thread goes.
    CONTENDED = 0.3
    # A window in which the allowed CPUs were idle this many CPUs' worth on average
    # gives one back: a whole CPU nobody wanted while our steps ran.
    IDLE_CPU = 0.8

    def __init__(self, ceiling: int, window_s: float = 0.25, enabled: bool = True) -> None:
        self.ceiling = ceiling
        self.threads = ceiling
        self.window_ns = int(window_s * 1e9)
        self.enabled = enabled and ceiling > 1 and os.path.exists("/proc/self/schedstat")
        try:
            self._cpus = frozenset(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            self._cpus = frozenset(range(os.cpu_count() or 1))
        self._last: _Sample | None = None
        self.changes = 0

    def _sample(self) -> _Sample:
        return _Sample(time.monotonic_ns(), _run_delay_ns(), _idle_ticks(self._cpus))

    def after_step(self) -> None:
        if not self.enabled:
            return
        last = self._last
        if last is None:
            self._last = self._sample()
            return
        if time.monotonic_ns() - last.wall_ns < self.window_ns:
            return
        now = self._sample()
        wall = max(1, now.wall_ns - last.wall_ns)
        waited = (now.delay_ns - last.delay_ns) / wall  # CPUs' worth of waiting
        idle = (now.idle_ticks - last.idle_ticks) * _TICK_S * 1e9 / wall  # CPUs idle
        self._last = now
        threads = self.next_threads(waited, idle)
        log.debug("threads %d: waited %.2f CPUs for a CPU, %.2f idle", self.threads, waited, idle)
        if threads != self.threads:
            log.debug("threads %d -> %d", self.threads, threads)
            self.threads = threads
            self.changes += 1
            torch.set_num_threads(threads)

    def next_threads(self, waited: float, idle: float) -> int:
        """The count after a window in which this process's threads waited ``waited``
        CPUs' worth for a CPU and the allowed CPUs sat ``idle`` CPUs' worth idle."""
        contended = waited - idle > self.CONTENDED
        if contended and self.threads > 1:
            return self.threads - 1
        if idle > self.IDLE_CPU and not contended and self.threads < self.ceiling:
            return self.threads + 1
        return self.threads

    def idle(self) -> None:
        """No steps for a while: the next window starts at the next step."""
        self._last = None
