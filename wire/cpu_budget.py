"""How many CPUs this process may actually use, and the worker's thread count from it.

torch's default thread count is every core the machine shows, which is wrong in the
places a server is most often run: a container whose CPU quota is below its visible
cores (a 2-CPU limit on a 64-core host would start 64 threads), a process pinned to a
few cores (``taskset``, a cpuset), a laptop or a CI box with other work on it. Each
parallel region of a step then waits at its barrier for a thread that is off the CPU.

The budget here is the smaller of the CPUs in this process's affinity mask and its
cgroup's CPU quota (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``,
the tightest along the path to the root), rounded down, at least one. Torch-free: the
frontend reads it for its start-up line and the worker for its thread pools
(``gpu/worker/threads.py``). The cgroup tree's root is a parameter, so tests read a fake one.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CpuBudget", "cgroup_quota", "cpu_budget", "worker_threads"]

CGROUP_ROOT = "/sys/fs/cgroup"
PROC_CGROUP = "/proc/self/cgroup"


@dataclass(frozen=True, slots=True)
class CpuBudget:
    cpus: int  # CPUs this process may use: affinity and quota, rounded down, >= 1
    affinity: int  # CPUs in the affinity mask
    quota: float | None  # the cgroup's CPU quota in CPUs; None: unlimited (or unreadable)

    @property
    def why(self) -> str:
        """What set ``cpus``, in words for a log line."""
        if self.quota is not None and self.quota < self.affinity:
            return f"cgroup quota {self.quota:.1f} CPUs"
        return f"{self.affinity} CPUs in this process's affinity"


def _affinity() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _groups(proc_cgroup: str) -> dict[str, str]:
    """``/proc/self/cgroup``: controller (``""`` for v2's unified tree) -> path."""
    out: dict[str, str] = {}
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        for controller in parts[1].split(",") if parts[1] else [""]:
            out[controller] = parts[2]
    return out


def _along(base: Path, path: str) -> list[Path]:
    """The cgroup's folder and each parent's up to ``base``; inside a container whose
    own cgroup is mounted at the root, the path written in /proc may not exist under
    ``base``, and ``base`` itself is the group."""
    rel = Path(path.lstrip("/"))
    folders = [base / rel, *[base / p for p in rel.parents]]
    return [f for f in folders if f.is_dir()] or [base]


def _v2(folder: Path) -> float | None:
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return int(quota) / int(period) if int(period) > 0 else None


def _v1(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def cgroup_quota(root: str = CGROUP_ROOT, proc_cgroup: str = PROC_CGROUP) -> float | None:
    """The tightest CPU quota on this process's cgroup path, in CPUs; None: none."""
    base, groups = Path(root), _groups(proc_cgroup)
    quotas: list[float] = []
    if "" in groups and (base / "cgroup.controllers").exists():  # v2, the unified tree
        quotas += [q for f in _along(base, groups[""]) if (q := _v2(f)) is not None]
    for controller in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):  # v1: where it is mounted
        mount = base / controller
        if "cpu" in groups and mount.is_dir():
            quotas += [q for f in _along(mount, groups["cpu"]) if (q := _v1(f)) is not None]
            break
    return min(quotas) if quotas else None


def cpu_budget(root: str = CGROUP_ROOT, proc_cgroup: str = PROC_CGROUP) -> CpuBudget:
    affinity = _affinity()
    quota = cgroup_quota(root, proc_cgroup)
    cpus = affinity if quota is None else min(affinity, math.floor(quota))
    return CpuBudget(max(1, cpus), affinity, quota)


# A frontend is one Python event loop, at most one core, and on the CPU it is a small
# share of a step's work (about 14 us of frontend time a streamed token against
# milliseconds of model time); where cores are many, one in eight is left to the
# frontends (at most one each), so their loops never wait behind a worker thread.
CORES_PER_FRONTEND_RESERVE = 8


def worker_threads(budget: CpuBudget, frontends: int = 0) -> tuple[int, str]:
    """The worker's thread count beside ``frontends`` local frontend processes, and why
    (for the start-up line: ``threads 2 (cgroup quota 2.0 CPUs)``)."""
    reserve = min(frontends, budget.cpus // CORES_PER_FRONTEND_RESERVE)
    threads = max(1, budget.cpus - reserve)
    why = budget.why
    if reserve:
        why += f", {reserve} left to the frontend{'s' if reserve > 1 else ''}"
    return threads, why
