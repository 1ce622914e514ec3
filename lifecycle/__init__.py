"""Request lifecycles: state machines, guarded handoffs, API handlers and wiring.

Joins ``transport`` (HTTP/WebSocket) and ``gpu`` (the worker) through the wire contract.
"""

__version__ = "0.1.0"
