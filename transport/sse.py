"""Server-Sent Events framing (WHATWG HTML, section 9.2 "Server-sent events"). Pure bytes."""

from __future__ import annotations

__all__ = ["PING", "frame_event"]

PING = b": ping\n\n"


def frame_event(payload: bytes | str) -> bytes:
    """Frame one event's data. Each line of a multi-line payload gets its own ``data:``
    field, since a bare newline would end the field (and CR / CRLF count as newlines)."""
    data = payload.encode("utf-8") if isinstance(payload, str) else payload
    if b"\n" not in data and b"\r" not in data:
        return b"data: " + data + b"\n\n"
    lines = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
    return b"".join(b"data: " + line + b"\n" for line in lines) + b"\n"
