"""The dependency direction the design promises:

    transport <- lifecycle -> wire <- gpu
                 lifecycle -> modelfile <- gpu

and, inside ``lifecycle``, never back:

    api -> tracing -> core,  api -> faces -> chat -> core,  testing -> link -> core

(the HTTP routes report to the observability room, which knows no route; ``faces`` is
what each API's bodies and replies say without HTTP, and ``chat`` the text side, both of
which the Engine uses while it imports nothing of ``lifecycle.api`` nor ``transport``;
``link`` is the process and socket side, which the sans-IO core reaches only through
``lifecycle.core.ports``). The frontend spawns the worker by module name (``python -m
gpu.worker``): not an import."""

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
# -> core, api -> faces -> chat; the app and the CLI at the top join them; production
# never imports testing).
_TOP = {
    "lifecycle.app",
    "lifecycle.cli",
    "lifecycle.runtime",
    "lifecycle.engine",
    "lifecycle.options",
    "lifecycle.option_args",
    "lifecycle.option_fields",
}
_ROOMS = {
    "lifecycle.api",
    "lifecycle.faces",
    "lifecycle.chat",
    "lifecycle.link",
    "lifecycle.tracing",
    "lifecycle.testing",
}
FORBIDDEN_INSIDE = {
    "lifecycle/core": {*_ROOMS, *_TOP},
    "lifecycle/chat": {*_ROOMS - {"lifecycle.chat"}, *_TOP},
    # the APIs without HTTP: the routes (lifecycle/api) and the Engine both use them
    "lifecycle/faces": {*_ROOMS - {"lifecycle.faces", "lifecycle.chat"}, *_TOP, "transport"},
    "lifecycle/link": {*_ROOMS - {"lifecycle.link"}, *_TOP},
    # the faces reach the worker link through lifecycle/core/ports.py, never its classes
    "lifecycle/api": {"lifecycle.testing", "lifecycle.link", *_TOP},
    # the tracer knows requests, not HTTP: its routes (lifecycle/api/debug.py) do
    "lifecycle/tracing": {*_ROOMS - {"lifecycle.tracing"}, *_TOP, "transport"},
    # the scripted worker is a wire peer: it frames the protocol with the link's stream
    "lifecycle/testing": {*_ROOMS - {"lifecycle.testing", "lifecycle.link"}, *_TOP},
    # the runtime without HTTP, at any time: the AST sees imports inside functions too
    "lifecycle/engine": {"lifecycle.api", "lifecycle.app", "transport"},
}
# The worker's rooms, each importing only those after it (the model and the cache are
# independent of each other): worker -> parallel -> runtime -> backends -> cache, model -> kernels.
_GPU = ("gpu.worker", "gpu.parallel", "gpu.runtime", "gpu.backends", "gpu.cache", "gpu.model")
FORBIDDEN_INSIDE.update(
    {room.replace(".", "/"): {*_GPU[: i + 1]} - {room} for i, room in enumerate(_GPU)}
)
FORBIDDEN_INSIDE["gpu/model"] |= {"gpu.cache"}
FORBIDDEN_INSIDE["gpu/cache"] |= {"gpu.model"}
FORBIDDEN_INSIDE["gpu/kernels"] = {*_GPU}


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
def test_rooms_inside_import_one_way(room: str) -> None:
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


def _load_layout_graph():  # tools/ is not a package: load the script as a module
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "layout_graph", ROOT / "tools" / "layout_graph.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of a directed graph as a path, or None when it is acyclic."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_rooms_import_one_way_and_the_picture_is_current() -> None:
    graph = _load_layout_graph()
    rooms: dict[str, set[str]] = {}
    for src, dst in graph.arrows():
        rooms.setdefault(src, set()).add(dst)
    assert _cycle(rooms) is None, f"rooms import in a circle: {' -> '.join(_cycle(rooms) or [])}"
    assert graph.main(["--check"]) == 0, "run python tools/layout_graph.py --write"


def test_no_module_imports_in_a_circle() -> None:
    graph = _load_layout_graph()
    modules: dict[str, set[str]] = {}
    for top in ("lifecycle", "transport", "gpu", "wire", "modelfile"):
        for path in sorted((ROOT / top).rglob("*.py")):
            name = graph._module_name(path)
            known = {n for n in graph._imports(path, name) if n.split(".")[0] == top}
            # "from pkg import mod" names a module; "from mod import Name" names its module
            modules[name] = {
                n if (ROOT / (n.replace(".", "/") + ".py")).exists() else n.rpartition(".")[0]
                for n in known
            } - {name}
    for name in list(modules):  # a package's __init__ is not a step in a circle
        modules[name] = {n for n in modules[name] if not (ROOT / n.replace(".", "/")).is_dir()}
    found = _cycle(modules)
    assert found is None, f"modules import in a circle: {' -> '.join(found or [])}"


def test_the_calls_state_does_no_io() -> None:
    """``lifecycle/core/call_state.py`` is the call without I/O: it awaits nothing, reads no
    clock and imports no event loop; ``call.py`` drives it. Only the router sets the
    HTTP context a call takes (``ORIGIN``)."""
    path = ROOT / "lifecycle" / "core" / "call_state.py"
    tree = ast.parse(path.read_text())
    assert not {"anyio", "asyncio", "time"} & _imported_top_levels(path)
    awaits = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Await)]
    assert not awaits, f"call_state.py awaits at lines {awaits}"
    setters = []
    for py in sorted((ROOT / "lifecycle").rglob("*.py")):
        for n in ast.walk(ast.parse(py.read_text())):
            if (
                isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute)
                and n.func.attr == "set"
                and isinstance(n.func.value, ast.Name)
                and n.func.value.id == "ORIGIN"
            ):
                setters.append(str(py.relative_to(ROOT)))
    assert set(setters) == {"lifecycle/api/routes.py"}, setters
