"""Deliberate bugs the suite must catch: ``make mutations`` (issue 54).

Each mutation (``tools/mutation_cases.py``) is a small edit of the product, exact text
replaced in one or more files, and the tests that must fail with it. The runner copies
the working tree as it is (tracked and untracked files, not ignored ones) into a scratch
folder once, applies one mutation at a time there, runs its tests with that copy first
on the import path, and puts the files back. The working tree is never touched.

    python tools/mutations.py                 # every mutation
    python tools/mutations.py --list          # names, origins, what each breaks
    python tools/mutations.py NAME ...        # some of them
    python tools/mutations.py --jobs 2        # two scratch copies side by side

First the mutations' tests run once on the unmutated copy: they must pass there, or
nothing could be said to catch anything (exit 2). Then each mutation ends ``caught``
(its tests failed), ``MISSED`` (they passed: the suite does not hold that promise), or
``STALE`` (its text is no longer in the code, or no test ran:
update the mutation where the code moved). The exit status is 0 only when every one
was caught. Run it before resolving an issue that changes a promised behaviour, and add
the mutations of each new feature; it does not run in CI (about 15 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mutation_cases import MUTATIONS, Mutation  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 900.0  # seconds one mutation's tests may take
# pytest's exit codes: 1 tests failed, 2 interrupted (a collection error: the mutation
# broke an import, which the suite also sees), 5 no tests collected.
FAILED, INTERRUPTED, NO_TESTS = 1, 2, 5


@dataclass(frozen=True, slots=True)
class Outcome:
    mutation: Mutation
    verdict: str  # caught | MISSED | STALE
    seconds: float
    detail: str  # the first failing test, or why it is stale


def scratch_copy(root: Path) -> Path:
    """The working tree as it is, in a new folder (the virtual environment linked)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    dest = Path(tempfile.mkdtemp(prefix="lifecycle-mutations-"))
    for rel in filter(None, listed):
        src = root / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    if (root / ".venv").exists():
        (dest / ".venv").symlink_to(root / ".venv")
    return dest


def apply(m: Mutation, tree: Path) -> dict[Path, str] | str:
    """Apply ``m`` in ``tree``: the files' original texts, or why it cannot apply."""
    originals: dict[Path, str] = {}
    edited: dict[Path, str] = {}
    for edit in m.edits:
        path = tree / edit.path
        if not path.is_file():
            return f"{edit.path} does not exist"
        text = edited.get(path, path.read_text())
        originals.setdefault(path, text)
        if text.count(edit.old) != 1:
            found = text.count(edit.old)
            return f"{edit.path}: the text to replace occurs {found} times, not once"
        edited[path] = text.replace(edit.old, edit.new)
    for path, text in edited.items():
        path.write_text(text)
    return originals


def _first_failure(output: str) -> str:
    for line in output.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line[:160]
    found = re.search(r"^E .*$", output, re.MULTILINE)
    return found.group(0)[:160] if found else output.strip().splitlines()[-1][:160]


def pytest(tests: tuple[str, ...] | list[str], tree: Path) -> tuple[int, str]:
    """Run ``tests`` in ``tree`` (its files first on the import path): exit code, output."""
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    try:
        r = subprocess.run(
            [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
             "-m", "not slow", *tests],
            cwd=tree, env=env, capture_output=True, text=True, timeout=TIMEOUT,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return FAILED, f"timed out after {TIMEOUT:.0f} s"
    return r.returncode, r.stdout + r.stderr


def baseline(chosen: list[Mutation], tree: Path) -> str | None:
    """The mutations' tests on the tree as it is: None when they pass, else the first
    failure (a mutation is caught only where its tests pass without it)."""
    tests = list(dict.fromkeys(t for m in chosen for t in m.tests))
    code, output = pytest(tests, tree)
    return None if code == 0 else _first_failure(output)


def run(m: Mutation, tree: Path) -> Outcome:
    start = time.monotonic()
    originals = apply(m, tree)
    if isinstance(originals, str):
        return Outcome(m, "STALE", 0.0, originals)
    try:
        code, output = pytest(m.tests, tree)
    finally:
        for path, text in originals.items():
            path.write_text(text)
    seconds = time.monotonic() - start
    if code in (FAILED, INTERRUPTED):
        return Outcome(m, "caught", seconds, _first_failure(output))
    if code == 0:
        return Outcome(m, "MISSED", seconds, output.strip().splitlines()[-1][:160])
    why = "no tests collected" if code == NO_TESTS else f"pytest exit {code}"
    return Outcome(m, "STALE", seconds, f"{why}: {_first_failure(output)}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", help="mutations to run (default: all)")
    p.add_argument("--list", action="store_true", help="list the mutations and stop")
    p.add_argument("--jobs", type=int, default=1, help="scratch copies run side by side")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip running the tests on the unmutated tree first")  # fmt: skip
    args = p.parse_args(argv)
    unknown = set(args.names) - {m.name for m in MUTATIONS}
    if unknown:
        p.error(f"unknown mutations: {', '.join(sorted(unknown))}")
    chosen = [m for m in MUTATIONS if not args.names or m.name in args.names]
    if args.list:
        for m in chosen:
            print(f"{m.name:40} {m.origin:22} {m.what}")
        return 0
    jobs = max(1, min(args.jobs, len(chosen)))
    trees = [scratch_copy(ROOT) for _ in range(jobs)]
    print(f"{len(chosen)} mutations, {jobs} scratch cop{'y' if jobs == 1 else 'ies'}", flush=True)
    if not args.no_baseline:
        t0 = time.monotonic()
        failed = baseline(chosen, trees[0])
        if failed is not None:
            for tree in trees:
                shutil.rmtree(tree, ignore_errors=True)
            print(f"the tests fail on the unmutated tree, so nothing can be caught: {failed}")
            return 2
        print(f"baseline: every mutation's tests pass unmutated ({time.monotonic() - t0:.0f} s)")
    pending = iter(chosen)
    lock = threading.Lock()
    outcomes: list[Outcome] = []

    def worker(tree: Path) -> None:  # takes the next mutation until none is left
        while True:
            with lock:
                m = next(pending, None)
            if m is None:
                return
            o = run(m, tree)
            with lock:
                outcomes.append(o)
                _report(o)

    try:
        threads = [threading.Thread(target=worker, args=(t,)) for t in trees]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for tree in trees:
            shutil.rmtree(tree, ignore_errors=True)
    caught = sum(o.verdict == "caught" for o in outcomes)
    print(f"\n{caught} of {len(outcomes)} caught", end="")
    others = [o for o in outcomes if o.verdict != "caught"]
    print(f"; not caught: {', '.join(o.mutation.name for o in others)}" if others else "")
    return 0 if not others else 1


def _report(o: Outcome) -> None:
    print(f"{o.verdict:7} {o.seconds:6.1f} s  {o.mutation.name:40} {o.detail}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
