"""A sans-IO fast path for the common HTTP/1.1 exchange, with h11 as the authority.

Most requests a serving frontend sees are small: a complete head and a Content-Length
body that arrive in one read, answered with one Content-Length response or a chunked
stream (SSE). h11 spends about 100 µs on such an exchange; this module does it in a few
µs by accepting only a strict subset of what h11 accepts (RFC 9112 section 3 request
line, section 5 field lines with h11's own grammar, one Host, at most one
Content-Length, no Transfer-Encoding, Expect or Upgrade, no CONNECT, HTTP/1.1 only)
and declining everything else.
A declined request, or a response this module will not write, goes through h11 with
the request's original bytes, so h11 still judges every case this module does not
handle, and answers them exactly as before.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

__all__ = [
    "LAST_CHUNK",
    "NEED_BODY",
    "NEED_MORE",
    "FastRequest",
    "encode_response",
    "encode_stream_head",
    "parse_request",
]

# h11's grammar (h11/_abnf.py), so anything accepted here h11 would accept too.
_TOKEN = rb"[-!#$%&'*+.^_`|~0-9a-zA-Z]+"
_VCHAR = rb"[^\x00\s]"
_VALUE = rb"(?:" + _VCHAR + rb"+(?:[ \t]+" + _VCHAR + rb"+)*)?"
_REQUEST_LINE = re.compile(rb"(" + _TOKEN + rb") (/[\x21-\x7e]*) HTTP/1\.1").fullmatch
_FIELD_LINE = re.compile(rb"(" + _TOKEN + rb"):[ \t]*(" + _VALUE + rb")[ \t]*").fullmatch
_NAME_OK = re.compile(_TOKEN).fullmatch
_VALUE_OK = re.compile(_VALUE).fullmatch
_DIGITS = re.compile(rb"[0-9]{1,18}").fullmatch
# A head h11 can already judge without CRLF CRLF: one ended by bare LFs (RFC 9112 section
# 2.2 lets a recipient take LF for CRLF, and h11 does), or a first byte no request line
# starts with (h11 answers 400 at once). Waiting for more would answer 408 instead.
_H11_DECIDES = re.compile(rb"[\x00-\x20]|.*?\n\r?\n", re.S).match

# Headers that change framing or the exchange: h11 handles any request carrying one.
_DECLINE: Final = frozenset((b"transfer-encoding", b"expect", b"upgrade", b"te"))
# Response headers the writer owns; a handler that sets one goes through h11.
_OWNED: Final = frozenset(("content-length", "transfer-encoding", "connection"))

NEED_MORE: Final = object()  # the head is not all here yet
NEED_BODY: Final = object()  # a good head is here, its (small) body not all yet


@dataclass(slots=True)
class FastRequest:
    """One complete request taken from the front of the buffer."""

    method: str
    target: str
    headers: list[tuple[bytes, bytes]]  # (lower-cased name, value), as h11 gives them
    body: bytes
    size: int  # bytes of the buffer this request used, head and body
    close: bool  # the client asked for Connection: close


def parse_request(buf: bytes, max_head: int, max_body: int) -> FastRequest | object | None:
    """A request from the front of ``buf``; ``NEED_MORE`` or ``NEED_BODY``; or None to
    hand it to h11. Bodies over ``max_body`` go to h11, which streams them through the
    bounded body queue; smaller ones are worth waiting for (clients often write the
    head and the body separately).
    """
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        if len(buf) > max_head or _H11_DECIDES(buf):
            return None
        return NEED_MORE
    if end + 4 > max_head:
        return None
    lines = buf[:end].split(b"\r\n")
    first = _REQUEST_LINE(lines[0])
    if first is None or first.group(1) == b"CONNECT":  # h11 may switch protocols on it
        return None
    headers: list[tuple[bytes, bytes]] = []
    hosts = 0
    length: bytes | None = None
    close = False
    for line in lines[1:]:
        field = _FIELD_LINE(line)
        if field is None:
            return None
        name = field.group(1).lower()
        value = field.group(2)
        headers.append((name, value))
        if name == b"host":
            hosts += 1
        elif name == b"content-length":
            if length is not None or not _DIGITS(value):
                return None
            length = value
        elif name == b"connection":
            close = close or b"close" in [t.strip().lower() for t in value.split(b",")]
        elif name in _DECLINE:
            return None
    if hosts != 1:
        return None
    start = end + 4
    size = start + (int(length) if length is not None else 0)
    if size - start > max_body:
        return None
    if size > len(buf):
        return NEED_BODY
    return FastRequest(
        first.group(1).decode("ascii"),
        first.group(2).decode("latin-1"),
        headers,
        buf[start:size],
        size,
        close,
    )


_lines: dict[tuple[str, str], bytes] = {}  # validated header lines: handlers reuse a few
_LINES_MAX = 512


def _header_line(name: str, value: str) -> bytes | None:
    key = (name, value)
    line = _lines.get(key)
    if line is None:
        raw_name, raw_value = name.encode("latin-1"), value.encode("latin-1")
        if not _NAME_OK(raw_name) or not _VALUE_OK(raw_value) or name.lower() in _OWNED:
            return None
        line = raw_name + b": " + raw_value + b"\r\n"
        if len(_lines) >= _LINES_MAX:
            _lines.clear()
        _lines[key] = line
    return line


def _head(
    status: int, reason: bytes, preamble: bytes, headers: list[tuple[str, str]]
) -> list[bytes] | None:
    """Status line, Date/Server lines and the handler's header lines; None for h11."""
    if not 200 <= status <= 999:
        return None
    parts = [b"HTTP/1.1 %d %s\r\n" % (status, reason), preamble]
    for name, value in headers:
        line = _header_line(name, value)
        if line is None:
            return None
        parts.append(line)
    return parts


def encode_response(
    status: int,
    reason: bytes,
    preamble: bytes,
    headers: list[tuple[str, str]],
    body: bytes,
    head_only: bool,
    close: bool,
) -> bytes | None:
    """The bytes h11 would write for this whole response, or None to let h11 do it.

    ``preamble`` holds the Date and Server lines. Like h11, a closing response ends its
    head with ``Connection: close`` and a HEAD response keeps its Content-Length.
    """
    parts = _head(status, reason, preamble, headers)
    if parts is None:
        return None
    bodiless = status in (204, 304)
    if not bodiless:
        parts.append(b"content-length: %d\r\n" % len(body))
    if close:
        parts.append(b"Connection: close\r\n")
    parts.append(b"\r\n")
    if body and not bodiless and not head_only:
        parts.append(body)
    return b"".join(parts)


def encode_stream_head(
    status: int, reason: bytes, preamble: bytes, headers: list[tuple[str, str]], close: bool
) -> bytes | None:
    """The head h11 writes for a body of unknown length to an HTTP/1.1 request (chunked
    framing), or None to let h11 do it. The body's chunks are ``%x\\r\\n<data>\\r\\n`` and
    it ends with ``LAST_CHUNK``."""
    parts = _head(status, reason, preamble, headers)
    if parts is None or status in (204, 304):
        return None
    parts.append(b"Transfer-Encoding: chunked\r\n")
    if close:
        parts.append(b"Connection: close\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)


LAST_CHUNK: Final = b"0\r\n\r\n"  # what h11 writes for EndOfMessage of a chunked body
