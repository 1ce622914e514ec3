"""API keys: who may call which route.

Keys arrive as ``Authorization: Bearer <key>`` or ``X-Api-Key: <key>``. Every candidate is
compared with ``hmac.compare_digest`` against the SHA-256 digest of every configured key,
without an early exit, so neither a key's content nor its length shows in the timing.
Admin routes (abort, flush, debug) need an admin key when one is configured; an admin key
is also valid on every other route. With admin keys only, the other routes stay open.
With user keys and no admin key, the admin routes are closed (403, naming
``--admin-api-key``) unless ``open_admin_routes`` opens them to every key; with no keys
at all everything is open. Public routes (``/health`` and ``/metrics`` by default) need
nothing. A request let in with a key carries its ``Caller`` (``request.user``), so that a
user key only ever aborts the requests it made. Keys are never logged: the failure body
and the log line name only the route.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from dataclasses import dataclass

from lifecycle.core.origin import DEFAULT_PUBLIC_ROUTES
from transport import JSONResponse, Request, Response

__all__ = [
    "ADMIN_PREFIXES",
    "ADMIN_ROUTES",
    "Auth",
    "AuthConfig",
    "Caller",
    "forbidden",
    "owner",
    "unauthorized",
]

log = logging.getLogger("lifecycle.api.auth")

ADMIN_ROUTES: frozenset[str] = frozenset(
    {"/abort_request", "/flush_cache", "/models/load", "/models/unload", "/replicas"}
)
ADMIN_PREFIXES: tuple[str, ...] = ("/debug",)


@dataclass(frozen=True, slots=True)
class AuthConfig:
    api_keys: tuple[str, ...] = ()
    admin_api_keys: tuple[str, ...] = ()
    public_routes: tuple[str, ...] = DEFAULT_PUBLIC_ROUTES
    # With user keys and no admin key: every key may use the admin routes (local use).
    open_admin_routes: bool = False

    @property
    def enabled(self) -> bool:
        return bool(self.api_keys or self.admin_api_keys)

    @property
    def admin_policy(self) -> str:
        """Who may use the admin routes, as start-up logs it."""
        routes = (
            "admin routes (/abort_request, /flush_cache, /models/load and unload, /replicas, "
            "/debug)"
        )
        if self.admin_api_keys:
            return f"{routes}: admin keys only"
        if not self.api_keys:
            return f"{routes}: open (no API keys configured)"
        if self.open_admin_routes:
            return f"{routes}: open to every API key (--open-admin-routes)"
        return f"{routes}: closed (no --admin-api-key; --open-admin-routes opens them)"


@dataclass(frozen=True, slots=True)
class Caller:
    """Who a request that came in with a valid key is: its key's digest, and whether
    that key is an admin key. What ``request.user`` holds once ``Auth`` let it in."""

    key: bytes
    admin: bool


def owner(request: Request) -> bytes | None:
    """The owner to record on a call this request creates: its key's digest, or None
    when the request came in without one (no keys configured)."""
    caller = request.user
    return caller.key if isinstance(caller, Caller) else None


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def _matches(candidate: bytes, digests: tuple[bytes, ...]) -> bool:
    found = False
    for d in digests:  # no early exit: the time does not depend on which key matched
        found |= hmac.compare_digest(candidate, d)
    return found


def unauthorized(message: str) -> Response:
    """401 in OpenAI's error shape (what its client raises ``AuthenticationError`` on)."""
    body = {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
    return JSONResponse(body, 401, [("www-authenticate", 'Bearer realm="lifecycle"')])


def forbidden(message: str) -> Response:
    """403 in OpenAI's error shape: the key is right, the route is not for it."""
    body = {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": None,
            "code": "admin_routes_closed",
        }
    }
    return JSONResponse(body, 403)


_CLOSED = (
    "This route is closed: the server has API keys but no admin key. Start it with "
    "--admin-api-key KEY and call this route with that key (or, for local use only, "
    "--open-admin-routes lets every API key call it)."
)


def presented_key(request: Request) -> str | None:
    auth = request.headers.get("authorization")
    if auth is not None:
        scheme, _, token = auth.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    key = request.headers.get("x-api-key")
    if key:
        return key.strip()
    if request.path.startswith("/debug"):
        # A browser cannot set headers on the debug page's own requests or its WebSocket
        # feed: the page forwards the key it was opened with as ?key= (docs/tracing.md).
        given = (request.query().get("key") or [""])[-1]
        return given or None
    return None


class Auth:
    def __init__(self, config: AuthConfig = AuthConfig()) -> None:
        self.config = config
        self._admin = tuple(_digest(k) for k in config.admin_api_keys)
        self._user = tuple(_digest(k) for k in config.api_keys) + self._admin
        self._public = frozenset(config.public_routes)
        # Closed: user keys, no admin key, and nobody opened them.
        self._closed = bool(config.api_keys) and not self._admin and not config.open_admin_routes
        log.info("%s", config.admin_policy)  # one app builds one Auth, at start-up

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    def is_public(self, path: str) -> bool:
        return path in self._public

    @staticmethod
    def is_admin_route(path: str) -> bool:
        return path in ADMIN_ROUTES or path.startswith(ADMIN_PREFIXES)

    def check(self, request: Request, *, admin: bool) -> Response | None:
        """None when the request may go on (``request.user`` then says who it is, when
        it came with a key), else the 401 or 403 to answer with.

        ``admin``: the route is an admin route; it needs an admin key when any is
        configured, and is closed to user keys unless ``open_admin_routes``.
        """
        need_admin = admin and bool(self._admin)
        if not (need_admin or self.config.api_keys):
            return None  # no user keys: only admin routes are closed (by admin keys)
        key = presented_key(request)
        if key is None:
            log.info("401 %s %s: no API key", request.method, request.path)
            return unauthorized(
                "Missing API key: send 'Authorization: Bearer <key>' or 'X-Api-Key: <key>'."
            )
        digest = _digest(key)
        if _matches(digest, self._admin if need_admin else self._user):
            if admin and self._closed:
                log.info("403 %s %s: admin routes are closed", request.method, request.path)
                return forbidden(_CLOSED)
            request.user = Caller(digest, _matches(digest, self._admin))
            return None
        log.info("401 %s %s: wrong API key", request.method, request.path)
        if need_admin and _matches(digest, self._user):
            return unauthorized("This route needs an admin API key.")
        return unauthorized("Incorrect API key provided.")

    def check_route(self, request: Request, route: str) -> Response | None:
        """``check`` for a route template, public routes exempt."""
        if self.is_public(route):
            return None
        return self.check(request, admin=self.is_admin_route(route))
