"""Request lifecycles: state machines, guarded handoffs, API handlers and wiring.

Joins ``transport`` (HTTP/WebSocket) and the worker (``gpu``, spawned by module name, never
imported) through the wire contract; docs/architecture.md maps the rooms.
"""

from lifecycle.core.version import __version__

__all__ = ["__version__"]
