"""Path routing with ``{name}`` parameters, 404, and 405 with ``Allow``."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Iterable

from .errors import HTTPError
from .request import Request
from .responses import Response

__all__ = ["Handler", "Router"]

Handler = Callable[[Request], Awaitable[Response]]

_PARAM = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(:path)?\}")


def _compile(path: str) -> re.Pattern[str] | None:
    """A regex for a templated path, or None when the path is static.

    ``{name}`` matches one segment; ``{name:path}`` matches the rest, slashes included.
    """
    if not path.startswith("/"):
        raise ValueError(f"route path must start with '/': {path!r}")
    pos, parts = 0, []
    for m in _PARAM.finditer(path):
        parts.append(re.escape(path[pos : m.start()]))
        parts.append(f"(?P<{m.group(1)}>.+)" if m.group(2) else f"(?P<{m.group(1)}>[^/]+)")
        pos = m.end()
    if not parts:
        return None
    parts.append(re.escape(path[pos:]))
    return re.compile("".join(parts) + r"\Z")


class Router:
    """Dispatch a request to the handler registered for its method and path.

    Static paths are a dict lookup; templated paths are tried in registration order.
    HEAD is served by the GET handler unless one is registered for HEAD.
    """

    def __init__(self) -> None:
        self._static: dict[str, dict[str, Handler]] = {}
        self._dynamic: list[tuple[re.Pattern[str], dict[str, Handler]]] = []
        self._patterns: dict[str, dict[str, Handler]] = {}

    def add(self, methods: str | Iterable[str], path: str, handler: Handler) -> None:
        names = [methods] if isinstance(methods, str) else list(methods)
        pattern = _compile(path)
        if pattern is None:
            table = self._static.setdefault(path, {})
        elif path in self._patterns:
            table = self._patterns[path]
        else:
            table = self._patterns[path] = {}
            self._dynamic.append((pattern, table))
        for method in names:
            table[method.upper()] = handler

    def route(self, methods: str | Iterable[str], path: str) -> Callable[[Handler], Handler]:
        def register(handler: Handler) -> Handler:
            self.add(methods, path, handler)
            return handler

        return register

    def _match(self, request: Request) -> dict[str, Handler] | None:
        table = self._static.get(request.path)
        if table is not None:
            return table
        for pattern, table in self._dynamic:
            m = pattern.match(request.path)
            if m is not None:
                request.path_params = m.groupdict()
                return table
        return None

    async def __call__(self, request: Request) -> Response:
        table = self._match(request)
        if table is None:
            raise HTTPError(404, f"Not Found: {request.path}")
        handler = table.get(request.method)
        if handler is None and request.method == "HEAD":
            handler = table.get("GET")
        if handler is None:
            allowed = set(table)
            if "GET" in allowed:
                allowed.add("HEAD")
            raise HTTPError(
                405,
                f"Method {request.method} not allowed",
                headers=[("allow", ", ".join(sorted(allowed)))],
            )
        return await handler(request)
