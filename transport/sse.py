"""Server-Sent Events framing (WHATWG HTML, section 9.2 "Server-sent events"). Pure bytes."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PING", "SSEEvent", "frame_event"]

PING = b": ping\n\n"


@dataclass(frozen=True, slots=True)
class SSEEvent:
    """An event with a type (the ``event:`` field, section 9.2.6), e.g. Anthropic's
    ``message_start``; a plain payload is an event of the default type ``message``."""

    name: str  # one line: no CR or LF
    data: bytes | str


def frame_event(payload: bytes | str | SSEEvent) -> bytes:
    """Frame one event's data. Each line of a multi-line payload gets its own ``data:``
    field, since a bare newline would end the field (and CR / CRLF count as newlines)."""
    if isinstance(payload, SSEEvent):
        return b"event: " + payload.name.encode("utf-8") + b"\n" + frame_event(payload.data)
    data = payload.encode("utf-8") if isinstance(payload, str) else payload
    if b"\n" not in data and b"\r" not in data:
        return b"data: " + data + b"\n\n"
    lines = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
    return b"".join(b"data: " + line + b"\n" for line in lines) + b"\n"
