"""Request lifecycles: state machines, guarded handoffs, API handlers and wiring.

Joins ``transport`` (HTTP/WebSocket) and the worker (``gpu``, spawned by module name, never
imported) through the wire contract; docs/architecture.md maps the rooms.
"""

from typing import TYPE_CHECKING, Any

from lifecycle.core.version import __version__

if TYPE_CHECKING:
    from lifecycle.engine import Engine, EngineError

__all__ = ["Engine", "EngineError", "__version__"]


def __getattr__(name: str) -> Any:
    """``Engine`` on first use: ``import lifecycle`` stays light (no anyio loop, no
    tokenizer, never torch)."""
    if name in ("Engine", "EngineError"):
        from lifecycle import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'lifecycle' has no attribute {name!r}")
