"""The tree's rooms and the imports between them, read from the code (``ast``, nothing run).

    python tools/layout_graph.py            # the Mermaid picture and the arrow list
    python tools/layout_graph.py --write    # refresh the generated block of docs/architecture.md
    python tools/layout_graph.py --check    # exit 1 when that block is stale

A room is a package or a subpackage of ``lifecycle`` (the app and the CLI at its top are
the room ``lifecycle``). An arrow A -> B means some module of A imports a module of B;
its label counts the importing modules. ``tests/test_layout.py`` checks that the block in
``docs/architecture.md`` equals what this prints, so the picture cannot drift.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
BEGIN = "<!-- layout_graph: begin (python tools/layout_graph.py --write) -->"
END = "<!-- layout_graph: end -->"

# Rooms in the order they are drawn, with the process each runs in.
ROOMS: dict[str, str] = {
    "lifecycle": "frontend",
    "lifecycle.api": "frontend",
    "lifecycle.faces": "frontend",
    "lifecycle.chat": "frontend",
    "lifecycle.link": "frontend",
    "lifecycle.tracing": "frontend",
    "lifecycle.testing": "frontend",
    "lifecycle.core": "frontend",
    "transport": "frontend",
    "modelfile": "both",
    "wire": "both",
    "gpu.worker": "worker",
    "gpu.parallel": "worker",
    "gpu.runtime": "worker",
    "gpu.backends": "worker",
    "gpu.cache": "worker",
    "gpu.model": "worker",
    "gpu.kernels": "worker",
}

__all__ = ["ROOMS", "arrows", "render", "room_of"]


def room_of(module: str) -> str | None:
    """The room a dotted module name belongs to (the longest room that prefixes it)."""
    best = None
    for room in ROOMS:
        if (module == room or module.startswith(room + ".")) and (
            best is None or len(room) > len(best)
        ):
            best = room
    return best


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, module: str) -> set[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def arrows() -> dict[tuple[str, str], set[str]]:
    """(from room, to room) -> the modules of the first that import the second."""
    out: dict[tuple[str, str], set[str]] = defaultdict(set)
    for top in {room.split(".")[0] for room in ROOMS}:
        for path in sorted((ROOT / top).rglob("*.py")):
            module = _module_name(path)
            src = room_of(module)
            for name in _imports(path, module):
                dst = room_of(name)
                if src and dst and dst != src:
                    out[(src, dst)].add(module)
    return dict(out)


def _node(room: str) -> str:
    return room.replace(".", "_")


def render() -> str:
    edges = arrows()
    lines = ["```mermaid", "flowchart TD"]
    for process, title in (("frontend", "frontend process"), ("both", "shared by both")):
        lines.append(f'  subgraph {process}["{title}"]')
        lines += [f'    {_node(r)}["{r}/"]' for r, p in ROOMS.items() if p == process]
        lines.append("  end")
    lines.append('  subgraph worker["worker process"]')
    lines += [f'    {_node(r)}["{r}/"]' for r, p in ROOMS.items() if p == "worker"]
    lines.append("  end")
    order = list(ROOMS)
    for (src, dst), modules in sorted(
        edges.items(), key=lambda e: (order.index(e[0][0]), order.index(e[0][1]))
    ):
        lines.append(f"  {_node(src)} -->|{len(modules)}| {_node(dst)}")
    lines.append("```")
    lines += ["", "| from | to | importing modules |", "|---|---|---|"]
    for (src, dst), modules in sorted(
        edges.items(), key=lambda e: (order.index(e[0][0]), order.index(e[0][1]))
    ):
        lines.append(f"| `{src}` | `{dst}` | {len(modules)} |")
    return "\n".join(lines)


def _generated_block(text: str) -> str:
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{DOC.relative_to(ROOT)} has no {BEGIN!r} ... {END!r} block")
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tools/layout_graph.py", description=__doc__)
    p.add_argument("--write", action="store_true", help="refresh docs/architecture.md")
    p.add_argument("--check", action="store_true", help="exit 1 if that block is stale")
    args = p.parse_args(argv)
    picture = render()
    if not (args.write or args.check):
        print(picture)
        return 0
    text = DOC.read_text()
    if args.check:
        if _generated_block(text) != picture:
            print(f"{DOC.relative_to(ROOT)} is stale: run python tools/layout_graph.py --write")
            return 1
        return 0
    head, rest = text.split(BEGIN, 1)
    DOC.write_text(f"{head}{BEGIN}\n{picture}\n{END}{rest.split(END, 1)[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
