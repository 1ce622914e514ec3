"""The worker's thread count (issue 53, point 1): the CPUs a process may use, read from
its affinity and a cgroup tree (fake ones here in both layouts, and this machine's own),
how the count is chosen, and the governor's rule for taking threads away and giving
them back."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from wire.cpu_budget import CpuBudget, cgroup_quota, cpu_budget, worker_threads


def _v2_tree(tmp_path: Path, path: str, limits: dict[str, str]) -> tuple[str, str]:
    """A cgroup v2 tree: ``limits`` maps a folder under the root to its cpu.max."""
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu memory\n")
    (root / path.lstrip("/")).mkdir(parents=True, exist_ok=True)
    for folder, text in limits.items():
        (root / folder).mkdir(parents=True, exist_ok=True)
        (root / folder / "cpu.max").write_text(text + "\n")
    proc = tmp_path / "self-cgroup"
    proc.write_text(f"0::{path}\n")
    return str(root), str(proc)


def test_a_v2_quota_is_read_in_cpus(tmp_path: Path) -> None:
    root, proc = _v2_tree(tmp_path, "/docker/abc", {"docker/abc": "200000 100000"})
    assert cgroup_quota(root, proc) == 2.0


def test_the_tightest_quota_on_the_path_wins(tmp_path: Path) -> None:
    limits = {"kube": "150000 100000", "kube/pod": "max 100000", "kube/pod/c": "400000 100000"}
    root, proc = _v2_tree(tmp_path, "/kube/pod/c", limits)
    assert cgroup_quota(root, proc) == 1.5


def test_no_quota_is_none(tmp_path: Path) -> None:
    root, proc = _v2_tree(tmp_path, "/user.slice", {"user.slice": "max 100000"})
    assert cgroup_quota(root, proc) is None
    assert cgroup_quota(str(tmp_path / "absent"), proc) is None


def test_inside_a_container_its_own_group_is_the_root(tmp_path: Path) -> None:
    # /proc names the host's path, the container mounts its own group at the root
    root, proc = _v2_tree(tmp_path, "/", {".": "50000 100000"})
    (tmp_path / "self-cgroup").write_text("0::/system.slice/docker-123.scope\n")
    assert cgroup_quota(root, proc) == 0.5


def test_a_v1_quota_is_read_where_the_cpu_controller_is_mounted(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    group = root / "cpu,cpuacct" / "docker" / "abc"
    group.mkdir(parents=True)
    (group / "cpu.cfs_quota_us").write_text("300000\n")
    (group / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "self-cgroup"
    proc.write_text("4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n")
    assert cgroup_quota(str(root), str(proc)) == 3.0
    (group / "cpu.cfs_quota_us").write_text("-1\n")  # unlimited
    assert cgroup_quota(str(root), str(proc)) is None


def test_the_budget_is_affinity_and_quota_rounded_down(tmp_path: Path) -> None:
    affinity = len(os.sched_getaffinity(0))
    root, proc = _v2_tree(tmp_path, "/c", {"c": "150000 100000"})
    b = cpu_budget(root, proc)
    assert b == CpuBudget(min(affinity, 1), affinity, 1.5)
    (tmp_path / "x").mkdir()
    root2, proc2 = _v2_tree(tmp_path / "x", "/c", {"c": "10000 100000"})  # 0.1 CPU: still 1
    assert cpu_budget(root2, proc2).cpus == 1
    if affinity > 1:
        assert b.why == "cgroup quota 1.5 CPUs"


def test_this_machines_own_budget() -> None:
    """Read from the real /proc and /sys/fs/cgroup: never more than the affinity mask,
    and no more than a quota where this machine has one."""
    b = cpu_budget()
    assert 1 <= b.cpus <= b.affinity == len(os.sched_getaffinity(0))
    if b.quota is not None:
        assert b.cpus <= max(1, int(b.quota))


@pytest.mark.parametrize(
    ("cpus", "frontends", "threads"),
    [(1, 1, 1), (2, 1, 2), (7, 1, 7), (8, 1, 7), (16, 1, 15), (16, 2, 14), (64, 1, 63)],
)
def test_a_frontend_gets_a_core_only_where_cores_are_many(
    cpus: int, frontends: int, threads: int
) -> None:
    got, why = worker_threads(CpuBudget(cpus, cpus, None), frontends)
    assert got == threads
    assert ("left to the frontend" in why) == (threads < cpus)


def test_threads_come_from_the_flag_then_the_environment_then_the_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gpu.worker.threads import resolve_threads

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert resolve_threads(5, True) == (5, "--threads")
    assert resolve_threads(None, True) == (3, "OMP_NUM_THREADS=3")
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert resolve_threads(None, False) == worker_threads(cpu_budget(), 0)


def test_the_governor_takes_a_thread_from_contention_and_gives_it_back_when_idle() -> None:
    from gpu.worker.threads import ThreadGovernor

    g = ThreadGovernor(4)
    g.threads = 4
    assert g.next_threads(waited=0.02, idle=0.0) == 4  # quiet and busy: as is
    assert g.next_threads(waited=0.81, idle=0.0) == 3  # beside busy loops: one fewer
    # wake-up latency on a quiet machine, CPUs idle meanwhile: not contention
    assert g.next_threads(waited=0.31, idle=0.22) == 4
    g.threads = 1
    assert g.next_threads(waited=0.9, idle=0.0) == 1  # never below one
    assert g.next_threads(waited=0.05, idle=0.3) == 1  # no whole CPU idle: stays
    assert g.next_threads(waited=0.05, idle=1.0) == 2  # a CPU nobody wanted: one more
    assert g.next_threads(waited=1.5, idle=0.9) == 1  # waited more than idle explains
    g.threads = 4
    assert g.next_threads(waited=0.0, idle=3.0) == 4  # never above the resolved count
