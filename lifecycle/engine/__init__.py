"""The in-process Engine (docs/engine.md): ``from lifecycle import Engine``."""

from lifecycle.engine.engine import Engine
from lifecycle.engine.requests import EngineError

__all__ = ["Engine", "EngineError"]
