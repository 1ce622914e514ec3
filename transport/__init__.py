"""An embeddable HTTP/1.1 and WebSocket server on anyio, h11 and wsproto.

Knows nothing about models: it moves requests, responses, SSE events and WebSocket
messages, and enforces connection limits and timeouts.
"""

from __future__ import annotations

from .config import ServerConfig
from .errors import HTTPError
from .request import Headers, Request
from .responses import (
    JSONResponse,
    Response,
    SSEResponse,
    StreamResponse,
    WebSocketResponse,
)
from .routing import Handler, Router
from .server import Server, run, serve
from .sse import SSEEvent
from .websocket import WebSocket, WebSocketClosed

__all__ = [
    "HTTPError",
    "Handler",
    "Headers",
    "JSONResponse",
    "Request",
    "Response",
    "Router",
    "SSEEvent",
    "SSEResponse",
    "Server",
    "ServerConfig",
    "StreamResponse",
    "WebSocket",
    "WebSocketClosed",
    "WebSocketResponse",
    "run",
    "serve",
]
