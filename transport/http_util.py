"""Small HTTP helpers shared by the connection drivers: headers, dates, errors, closing."""

from __future__ import annotations

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
    "close_stream",
    "error_response",
    "http_date",
    "preamble",
    "reason",
    "response_headers",
    "scan_head",
]

# After a graceful close we read (and drop) what the client still sends for this long, so
# that unread request bytes do not make the kernel answer with a reset that could destroy
# the response before the client reads it (RFC 9112 section 9.6, "tear-down").
LINGER_SECONDS = 1.0

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


def scan_head(request: h11.Request) -> tuple[list[tuple[bytes, bytes]], int, int | None]:
    """One pass over a parsed head: its (lower-cased name, value) pairs, its size in bytes
    (give or take whitespace) and its declared Content-Length (h11 validated it)."""
    items = getattr(request.headers, "_full_items", None)
    if items is not None:  # h11's own list: iterating the Sequence wrapper costs 3x more
        pairs = [(name, value) for _, name, value in items]
    else:
        pairs = list(request.headers)
    size = len(request.target) + 16
    declared = None
    for name, value in pairs:
        size += len(name) + len(value) + 4
        if name == b"content-length":
            declared = int(value)
    return pairs, size, declared


def error_response(error: HTTPError) -> Response:
    return Response(error.body, error.status, error.headers, error.content_type)


async def close_stream(stream: anyio.abc.ByteStream, graceful: bool) -> None:
    """Close a connection: gracefully (flush, half-close, linger) or at once (abort)."""
    if graceful:
        base = getattr(stream, "transport_stream", stream)  # TLS: half-close the socket
        try:
            await base.send_eof()
        except (NotImplementedError, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass
        with anyio.move_on_after(LINGER_SECONDS):
            try:
                while await stream.receive(65536):
                    pass
            except (
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
