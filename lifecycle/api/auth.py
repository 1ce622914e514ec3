"""API keys: who may call which route.

Keys arrive as ``Authorization: Bearer <key>`` or ``X-Api-Key: <key>``. Every candidate is
compared with ``hmac.compare_digest`` against the SHA-256 digest of every configured key,
without an early exit, so neither a key's content nor its length shows in the timing.
Admin routes (abort, flush, debug) need an admin key when one is configured; an admin key
is also valid on every other route. With admin keys only, the other routes stay open. Public routes (``/health`` and ``/metrics`` by
default) need nothing. Keys are never logged: the failure body and the log line name only
the route.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from dataclasses import dataclass
from pathlib import Path

from transport import JSONResponse, Request, Response

__all__ = [
    "ADMIN_PREFIXES",
    "ADMIN_ROUTES",
    "DEFAULT_PUBLIC_ROUTES",
    "Auth",
    "AuthConfig",
    "read_key_file",
    "unauthorized",
]

log = logging.getLogger("lifecycle.api.auth")

DEFAULT_PUBLIC_ROUTES: tuple[str, ...] = ("/health", "/metrics")
ADMIN_ROUTES: frozenset[str] = frozenset({"/abort_request", "/flush_cache"})
ADMIN_PREFIXES: tuple[str, ...] = ("/debug",)


@dataclass(frozen=True, slots=True)
class AuthConfig:
    api_keys: tuple[str, ...] = ()
    admin_api_keys: tuple[str, ...] = ()
    public_routes: tuple[str, ...] = DEFAULT_PUBLIC_ROUTES

    @property
    def enabled(self) -> bool:
        return bool(self.api_keys or self.admin_api_keys)


def read_key_file(path: str | Path) -> tuple[str, ...]:
    """One key per line; blank lines and ``#`` comments are skipped."""
    keys = []
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keys.append(line)
    return tuple(keys)


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

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    def is_public(self, path: str) -> bool:
        return path in self._public

    @staticmethod
    def is_admin_route(path: str) -> bool:
        return path in ADMIN_ROUTES or path.startswith(ADMIN_PREFIXES)

    def check(self, request: Request, *, admin: bool) -> Response | None:
        """None when the request may go on, else the 401 to answer with.

        ``admin``: the route is an admin route; it needs an admin key when any is
        configured (otherwise any API key will do).
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
