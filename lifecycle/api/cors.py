"""CORS (``--cors-allow-origins``): browsers may call the API from the origins named.

Off by default: no CORS header is sent and a preflight ``OPTIONS`` gets the router's
405. With origins named (``*`` for any, as SGLang's open CORS), a request whose
``Origin`` is one of them gets ``Access-Control-Allow-Origin`` on whatever answers it
(the transport's ``Request.response_headers``: a stream's head and errors too) with
``Access-Control-Expose-Headers: X-Request-Id`` so a page can read its request id, and a
preflight (``OPTIONS`` with ``Access-Control-Request-Method``) is answered here, before
the API-key check, with 204, the methods and the headers it asked for. Wraps the app's
handler; nothing else changes.
"""

from __future__ import annotations

from transport import Handler, Request, Response

__all__ = ["cors"]

_METHODS = "GET, POST, PUT, DELETE, OPTIONS"
_MAX_AGE = "600"  # seconds a browser may cache a preflight's answer
# a page's script may read the request id of what it called (docs/api.md, "Request ids")
_EXPOSE = ("access-control-expose-headers", "X-Request-Id")


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
            return [("access-control-allow-origin", "*"), _EXPOSE]
        if origin.rstrip("/") in allowed:
            return [("access-control-allow-origin", origin), ("vary", "Origin"), _EXPOSE]
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
        # whatever answers it: the response, a stream's head, an error (the transport's
        # response_headers)
        request.response_headers = [*(request.response_headers or ()), *headers]
        return await handler(request)

    return wrapped
