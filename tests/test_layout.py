"""The dependency direction the design promises: transport <- lifecycle -> wire <- gpu."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

FORBIDDEN = {
    "transport": {"lifecycle", "gpu", "torch"},
    "gpu": {"lifecycle", "transport", "h11", "wsproto"},
    "wire": {"lifecycle", "transport", "gpu", "torch"},
}


def _imported_top_levels(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_does_not_import_forbidden_layers(package: str) -> None:
    offenders = []
    for path in sorted((ROOT / package).rglob("*.py")):
        bad = _imported_top_levels(path) & FORBIDDEN[package]
        if bad:
            offenders.append(f"{path.relative_to(ROOT)} imports {sorted(bad)}")
    assert not offenders, "\n".join(offenders)


def test_readme_quick_start_is_two_commands() -> None:
    text = (ROOT / "README.md").read_text()
    assert "make serve" in text and "make test" in text
    assert "make test" in (ROOT / ".ci" / "run").read_text()
