"""CORS (``--cors-allow-origins``): browsers may call the API from the origins named.

Off by default: no CORS header is sent and a preflight ``OPTIONS`` gets the router's
405. With origins named (``*`` for any, as SGLang's open CORS), a request whose
``Origin`` is one of them gets ``Access-Control-Allow-Origin`` on its response (streamed
ones too: the header goes out with the stream's head), and a preflight (``OPTIONS`` with
``Access-Control-Request-Method``) is answered here, before the API-key check, with 204,
the methods and the headers it asked for. Wraps the app's handler; nothing else changes.
"""

from __future__ import annotations

from typing import Any

from transport import Handler, HTTPError, Request, Response

__all__ = ["cors"]

_METHODS = "GET, POST, PUT, DELETE, OPTIONS"
_MAX_AGE = "600"  # seconds a browser may cache a preflight's answer


def cors(handler: Handler, origins: tuple[str, ...]) -> Handler:
    """``handler`` answering CORS for ``origins`` (``*``: any); ``handler`` itself when
    there are none."""
    if not origins:
        return handler
    any_origin = "*" in origins
    allowed = frozenset(o.rstrip("/") for o in origins)

    def allow(request: Request) -> list[tuple[str, str]]:
        origin = request.headers.get("origin")
        if not origin:
            return []
        if any_origin:
            return [("access-control-allow-origin", "*")]
        if origin.rstrip("/") in allowed:
            return [("access-control-allow-origin", origin), ("vary", "Origin")]
        return []

    async def wrapped(request: Request) -> Response:
        headers = allow(request)
        if not headers:
            return await handler(request)
        if request.method == "OPTIONS" and request.headers.get("access-control-request-method"):
            asked = request.headers.get("access-control-request-headers")
            return Response(b"", 204, [*headers,
                ("access-control-allow-methods", _METHODS),
                ("access-control-allow-headers", asked or "*"),
                ("access-control-max-age", _MAX_AGE),
            ])  # fmt: skip
        _on_respond(request, headers)  # a stream's head goes out inside the handler
        try:
            response = await handler(request)
        except HTTPError as exc:
            exc.headers.extend(headers)
            raise
        if request.responded is None:
            response.headers.extend(headers)
        return response

    return wrapped


def _on_respond(request: Request, headers: list[tuple[str, str]]) -> None:
    """Add ``headers`` to a response the handler sends itself (``request.respond``)."""
    send = getattr(request, "_responder", None)
    if send is None:
        return

    async def responder(req: Request, response: Any) -> bool:
        response.headers.extend(headers)
        return await send(req, response)

    request._responder = responder
