"""Small HTTP helpers shared by the connection drivers: headers, dates, errors, closing."""

from __future__ import annotations

import math
import time
from email.utils import formatdate
from http import HTTPStatus

import anyio
import anyio.abc
import h11

from .config import ServerConfig
from .errors import HTTPError
from .responses import Response

__all__ = [
    "cancelled",
    "close_stream",
    "error_response",
    "framing_problem",
    "origin_form",
    "http_date",
    "preamble",
    "reason",
    "response_headers",
    "scan_head",
]

# After a graceful close we read (and drop) what the client still sends until it closes,
# or is silent this long, so that unread request bytes do not make the kernel answer with
# a reset that could destroy the response before the client reads it (RFC 9112 section
# 9.6, "tear-down"). A client still uploading the body of a request we answered is read
# on while it sends, up to LINGER_MAX_SECONDS in all: it reads our answer once it is done.
LINGER_SECONDS = 1.0
LINGER_MAX_SECONDS = 5.0

_REASONS = {s.value: s.phrase.encode("ascii") for s in HTTPStatus}
_date_cache: list = [0, b""]


def reason(status: int) -> bytes:
    return _REASONS.get(status, b"")


def http_date() -> bytes:
    """The Date header value, formatted once per second (RFC 9110 section 6.6.1)."""
    now = int(time.time())
    if now != _date_cache[0]:
        _date_cache[0] = now
        _date_cache[1] = formatdate(now, usegmt=True).encode("ascii")
    return _date_cache[1]


_preambles: dict[str, tuple[bytes, bytes]] = {}


def preamble(server: str) -> bytes:
    """The Date and Server header lines every response starts with, built once a second."""
    date = http_date()
    entry = _preambles.get(server)
    if entry is None or entry[0] is not date:
        entry = (date, b"date: " + date + b"\r\nserver: " + server.encode("latin-1") + b"\r\n")
        _preambles[server] = entry
    return entry[1]


def response_headers(
    headers: list[tuple[str, str]], config: ServerConfig, closing: bool
) -> list[tuple[bytes, bytes]]:
    out = [(b"date", http_date()), (b"server", config.server_header.encode("latin-1"))]
    out.extend((name.encode("latin-1"), value.encode("latin-1")) for name, value in headers)
    if closing:
        out.append((b"connection", b"close"))
    return out


def scan_head(request: h11.Request) -> tuple[list[tuple[bytes, bytes]], int, int | None, bool]:
    """One pass over a parsed head: its (lower-cased name, value) pairs, its size in bytes
    (give or take whitespace), its declared Content-Length (h11 validated it) and whether
    it carries Transfer-Encoding (h11 let only ``chunked`` through)."""
    items = getattr(request.headers, "_full_items", None)
    if items is not None:  # h11's own list: iterating the Sequence wrapper costs 3x more
        pairs = [(name, value) for _, name, value in items]
    else:
        pairs = list(request.headers)
    size = len(request.method) + len(request.target) + len(request.http_version) + 8
    declared = None
    coded = False
    for name, value in pairs:
        size += len(name) + len(value) + 4
        if name == b"content-length":
            declared = int(value)
        elif name == b"transfer-encoding":
            coded = True
    return pairs, size, declared, coded


def framing_problem(request: h11.Request, declared: int | None, coded: bool) -> str | None:
    """Why a request's body framing cannot be trusted, or None (RFC 9112 section 6.3).

    h11 frames a request carrying both Content-Length and Transfer-Encoding by the
    latter, as section 6.3 rule 3 says, but the same rule says the connection must then
    close: a proxy in front that framed it by Content-Length would take the chunked body
    for a second request (request smuggling). We refuse such a request outright, and a
    Transfer-Encoding on HTTP/1.0, which section 6.1 says must be treated as faulty
    framing, the same way.
    """
    if not coded:
        return None
    if declared is not None:
        return "Content-Length and Transfer-Encoding together (RFC 9112 section 6.3)"
    if request.http_version == b"1.0":
        return "Transfer-Encoding in an HTTP/1.0 request (RFC 9112 section 6.1)"
    return None


def origin_form(method: bytes, target: bytes) -> bytes | None:
    """The origin-form target (path and query) a request is routed by, or None for a
    target we do not serve (RFC 9112 section 3.2).

    A server must accept the absolute form (section 3.2.2): it is routed by its path and
    query. The authority form belongs to CONNECT, which this server does not tunnel, and
    the asterisk form to OPTIONS (routed as ``*``); anything else is not a target.
    """
    if target[:1] == b"/":
        return target
    if target == b"*":
        return target if method == b"OPTIONS" else None
    scheme, sep, rest = target.partition(b"://")
    if not sep or scheme.lower() not in (b"http", b"https"):
        return None
    cut = min((i for i in (rest.find(b"/"), rest.find(b"?")) if i >= 0), default=len(rest))
    if cut == 0:  # no authority: section 4.2.1 of RFC 9110 makes it invalid
        return None
    path = rest[cut:]
    return path if path[:1] == b"/" else b"/" + path


def error_response(error: HTTPError) -> Response:
    return Response(error.body, error.status, error.headers, error.content_type)


def cancelled() -> bool:
    """Whether the calling task's scope is cancelled (checked before a shielded close)."""
    return anyio.current_effective_deadline() == -math.inf


async def close_stream(stream: anyio.abc.ByteStream, graceful: bool) -> None:
    """Close a connection: gracefully (flush, half-close, linger) or at once (abort)."""
    if graceful:
        base = getattr(stream, "transport_stream", stream)  # TLS: half-close the socket
        try:
            await base.send_eof()
        except (NotImplementedError, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass
        with anyio.move_on_after(LINGER_MAX_SECONDS):
            try:
                while True:
                    with anyio.fail_after(LINGER_SECONDS):
                        if not await stream.receive(65536):
                            break
            except (
                TimeoutError,
                anyio.EndOfStream,
                anyio.BrokenResourceError,
                anyio.ClosedResourceError,
                OSError,
            ):
                pass
            except Exception:  # a TLS peer that vanishes without close_notify
                pass
    try:
        await stream.aclose()
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
        pass
