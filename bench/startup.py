"""Start-up of ``lifecycle serve --scripted-worker``: from process start to the first
answer (the listener binds first and says 503) and to the first /health 200, and the
frontend's RSS at that 200, for this tree and a baseline ref side by side.

    python bench/startup.py                       # this tree against 6a9acbc, 5 runs each
    python bench/startup.py --baseline none       # this tree only
    python bench/startup.py --baseline REF --runs 9

6a9acbc is the last commit whose frontend imported torch (through gpu/ for the
tokenizer). The baseline is checked out with ``git worktree add`` (removed afterwards)
and run by the same python with the worktree as cwd and first on PYTHONPATH: the
editable install's finder comes after sys.path, so the worktree's packages are the ones
imported (checked before measuring). Runs alternate A B A B after one warm-up each, so
a machine that gets busier costs both alike. Both load the bundled model's tokenizer.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.procs import ServerProcess, free_port, http_status  # noqa: E402

DEFAULT_BASELINE = "6a9acbc"
POLL_S = 0.005


@dataclass(frozen=True, slots=True)
class Startup:
    first_answer_s: float  # the listener answered at all (503 while the worker starts)
    ready_s: float  # the first /health 200
    rss_mib: float  # the frontend process alone, children excluded, at that 200
    torch_mapped: bool  # torch's libraries in the frontend's /proc/PID/maps


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _torch_mapped(pid: int) -> bool:
    maps = Path(f"/proc/{pid}/maps").read_text()
    return "libtorch" in maps or "/torch/_C" in maps


def _env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree)}


def measure(tree: Path, timeout_s: float = 120.0) -> Startup:
    """One ``lifecycle serve --scripted-worker`` from ``tree``, started and stopped."""
    port = free_port()
    argv = [sys.executable, "-m", "lifecycle", "serve", "--scripted-worker"]
    argv += ["--port", str(port), "--log-level", "warning"]
    log = Path(tempfile.mkstemp(prefix="bench-startup-", suffix=".log")[1])
    first = None
    t0 = time.perf_counter()
    with log.open("wb") as out:
        popen = subprocess.Popen(
            argv, cwd=tree, env=_env(tree), stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    server = ServerProcess("startup", popen, "127.0.0.1", port, log)
    try:
        while time.perf_counter() - t0 < timeout_s:
            status = http_status("127.0.0.1", port, "/health", timeout=1.0)
            now = time.perf_counter() - t0
            if status and first is None:
                first = now
            if status == 200:
                return Startup(first or now, now, _rss_mib(popen.pid), _torch_mapped(popen.pid))
            if popen.poll() is not None:
                raise RuntimeError(f"server exited ({popen.returncode}):\n{server.log_tail()}")
            time.sleep(POLL_S)
        raise TimeoutError(f"no /health 200 after {timeout_s:g} s:\n{server.log_tail()}")
    finally:
        server.stop()
        log.unlink(missing_ok=True)


@contextmanager
def worktree(ref: str) -> Iterator[Path]:
    """``git worktree add --detach`` of ``ref`` in a temporary folder, removed after."""
    path = Path(tempfile.mkdtemp(prefix="lc-startup-base-"))
    subprocess.run(
        ["git", "worktree", "add", "--detach", "-q", str(path), ref], cwd=ROOT, check=True
    )
    try:
        imported = subprocess.run(
            [sys.executable, "-c", "import lifecycle; print(lifecycle.__file__)"],
            cwd=path, env=_env(path), capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        if not imported.startswith(str(path)):
            raise RuntimeError(f"the baseline imports {imported}, not the worktree's copy")
        yield path
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT)


def _ref_exists(ref: str) -> bool:
    probe = ["git", "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"]
    return subprocess.run(probe, cwd=ROOT, capture_output=True).returncode == 0


def _describe() -> str:
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=ROOT).returncode != 0
    return f"this tree ({head or '?'}{', modified' if dirty else ''})"


def run(trees: dict[str, Path], runs: int, warmup: int) -> dict[str, list[Startup]]:
    for _ in range(warmup):
        for tree in trees.values():
            measure(tree)
    results: dict[str, list[Startup]] = {name: [] for name in trees}
    for _ in range(runs):
        for name, tree in trees.items():
            results[name].append(measure(tree))
    return results


def report(results: dict[str, list[Startup]]) -> None:
    rows = [
        ("start to first answer (503), s", "first_answer_s", "{:.2f}"),
        ("start to /health 200, s", "ready_s", "{:.2f}"),
        ("frontend RSS at /health 200, MiB", "rss_mib", "{:.0f}"),
    ]
    width = max(34, *(len(n) + 2 for n in results))
    print("min / median / max".ljust(36) + "".join(n.rjust(width) for n in results))
    for label, key, fmt in rows:
        cells = []
        for runs in results.values():
            values = [getattr(r, key) for r in runs]
            spread = (min(values), statistics.median(values), max(values))
            cells.append(" / ".join(fmt.format(v) for v in spread).rjust(width))
        print(label.ljust(36) + "".join(cells))
    mapped = ["yes" if any(r.torch_mapped for r in runs) else "no" for runs in results.values()]
    print("torch mapped in the frontend".ljust(36) + "".join(m.rjust(width) for m in mapped))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", type=int, default=5, help="measured runs per tree")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured runs per tree first")
    p.add_argument(
        "--baseline",
        default=DEFAULT_BASELINE,
        help=f"git ref to measure side by side ('none': this tree only; default {DEFAULT_BASELINE})",
    )
    args = p.parse_args()
    this = _describe()
    print(f"{sys.executable} (Python {sys.version.split()[0]}), {os.cpu_count()} CPUs")
    if args.baseline == "none" or not _ref_exists(args.baseline):
        if args.baseline != "none":
            print(f"baseline {args.baseline} is not in this repository: this tree only")
        report(run({this: ROOT}, args.runs, args.warmup))
        return 0
    with worktree(args.baseline) as base:
        results = run({this: ROOT, f"baseline {args.baseline}": base}, args.runs, args.warmup)
    report(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
