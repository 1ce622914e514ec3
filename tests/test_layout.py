"""The dependency direction the design promises:

    transport <- lifecycle -> wire <- gpu
                 lifecycle -> modelfile <- gpu

and, inside ``lifecycle``, api -> core, tracing -> core, testing -> core, never back.
The frontend spawns the worker by module name (``python -m gpu.worker``): not an import."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

FORBIDDEN = {
    "lifecycle": {"gpu", "torch"},
    "modelfile": {"lifecycle", "transport", "gpu", "wire", "torch"},
    "transport": {"lifecycle", "gpu", "torch", "modelfile"},
    "gpu": {"lifecycle", "transport", "h11", "wsproto"},
    "wire": {"lifecycle", "transport", "gpu", "torch", "modelfile"},
}

# lifecycle's own rooms: what each may not import (the arrows run api/tracing/testing
# -> core; the app and the CLI at the top join them; production never imports testing).
FORBIDDEN_INSIDE = {
    "lifecycle/core": {
        "lifecycle.api",
        "lifecycle.tracing",
        "lifecycle.testing",
        "lifecycle.app",
        "lifecycle.cli",
    },
    "lifecycle/api": {"lifecycle.tracing", "lifecycle.testing", "lifecycle.app", "lifecycle.cli"},
    "lifecycle/tracing": {"lifecycle.api", "lifecycle.testing", "lifecycle.app", "lifecycle.cli"},
    "lifecycle/testing": {"lifecycle.api", "lifecycle.tracing", "lifecycle.app", "lifecycle.cli"},
}


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _imported_top_levels(path: Path) -> set[str]:
    return {name.split(".")[0] for name in _imported_modules(path)}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_does_not_import_forbidden_layers(package: str) -> None:
    offenders = []
    for path in sorted((ROOT / package).rglob("*.py")):
        bad = _imported_top_levels(path) & FORBIDDEN[package]
        if bad:
            offenders.append(f"{path.relative_to(ROOT)} imports {sorted(bad)}")
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize("room", sorted(FORBIDDEN_INSIDE))
def test_lifecycle_rooms_import_one_way(room: str) -> None:
    offenders = []
    for path in sorted((ROOT / room).rglob("*.py")):
        for name in sorted(_imported_modules(path)):
            bad = [f for f in FORBIDDEN_INSIDE[room] if name == f or name.startswith(f + ".")]
            if bad:
                offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not offenders, "\n".join(offenders)


def test_readme_quick_start_is_two_commands() -> None:
    text = (ROOT / "README.md").read_text()
    assert "make serve" in text and "make test" in text
    assert "make test" in (ROOT / ".ci" / "run").read_text()
