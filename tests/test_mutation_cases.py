"""The planted bugs of ``tools/mutation_cases.py`` stay plantable: every edit's text occurs
exactly once in its file, and every test a mutation names exists. ``make mutations``
(not in CI: ~15 minutes) reports a case whose text moved as STALE only when it runs; this
says so at once, where the code that moved it lands."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from mutation_cases import MUTATIONS, Mutation  # noqa: E402


@pytest.mark.parametrize("m", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_every_edit_finds_its_text_once(m: Mutation) -> None:
    for e in m.edits:
        text = (ROOT / e.path).read_text()
        assert text.count(e.old) == 1, (
            f"{m.name}: {e.path} holds its text {text.count(e.old)} times"
        )
        assert e.new != e.old


@pytest.mark.parametrize("m", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_every_named_test_exists(m: Mutation) -> None:
    assert m.tests, m.name
    for t in m.tests:
        path, _, node = t.partition("::")
        assert (ROOT / path).is_file(), f"{m.name}: no {path}"
        if node:
            name = node.split("::")[-1].split("[")[0]
            tree = ast.parse((ROOT / path).read_text())
            defined = {
                n.name
                for n in ast.walk(tree)
                if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
            }
            assert name in defined, f"{m.name}: {path} has no {name}"
