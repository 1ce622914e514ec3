"""A sans-IO HTTP/1.1 response parser and Server-Sent-Events decoder for the load generator.

Both take bytes and return events; the driver in ``serving.py`` owns the socket and the
clock. Only what a load generator needs: one response per request on a keep-alive
connection, bodies delimited by Content-Length, chunked coding (RFC 9112 §7.1) or
connection close (RFC 9112 §6.3), and no trailers kept. A body cut short raises
``IncompleteResponse``, so a truncated stream can never read as a complete one.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto

__all__ = [
    "BodyChunk",
    "IncompleteResponse",
    "ResponseEnd",
    "ResponseHead",
    "ResponseParser",
    "SSEDecoder",
    "encode_request",
]

_MAX_HEAD = 64 * 1024


class IncompleteResponse(Exception):
    """The connection ended, or sent bytes that are not HTTP, before the response did."""


@dataclass(frozen=True, slots=True)
class ResponseHead:
    status: int
    headers: dict[str, str]  # lower-case names; a repeated header keeps its last value
    keep_alive: bool


@dataclass(frozen=True, slots=True)
class BodyChunk:
    data: bytes


@dataclass(frozen=True, slots=True)
class ResponseEnd:
    pass


Event = ResponseHead | BodyChunk | ResponseEnd


def encode_request(method: str, path: str, host: str, body: bytes, accept: str,
                   close: bool = False) -> bytes:  # fmt: skip
    """One request with a JSON body, as a single buffer (one send per request);
    ``close`` asks the server to close the connection after it (RFC 9112 section 9.6)."""
    connection = "Connection: close\r\n" if close else ""
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: lifecycle-bench\r\n"
        f"Accept: {accept}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{connection}\r\n"
    )
    return head.encode("ascii") + body


class _State(Enum):
    HEAD = auto()
    LENGTH = auto()  # Content-Length body
    CHUNK_SIZE = auto()
    CHUNK_DATA = auto()
    CHUNK_CRLF = auto()  # the CRLF that closes a chunk's data
    TRAILER = auto()
    CLOSE = auto()  # body delimited by the connection closing
    DONE = auto()


_DATA_STATES = (_State.LENGTH, _State.CHUNK_DATA, _State.CLOSE)
_LINE_STATES = (_State.CHUNK_SIZE, _State.CHUNK_CRLF, _State.TRAILER)


class ResponseParser:
    """Feed it what the socket gives; it returns the events those bytes complete."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._state = _State.HEAD
        self._remaining = 0
        self.head: ResponseHead | None = None

    @property
    def done(self) -> bool:
        return self._state is _State.DONE

    def feed(self, data: bytes) -> list[Event]:
        self._buf += data
        out: list[Event] = []
        while self._step(out):
            pass
        return out

    def eof(self) -> list[Event]:
        """The peer closed the connection: end a close-delimited body, else complain."""
        if self._state is _State.CLOSE:
            self._state = _State.DONE
            return [ResponseEnd()]
        if self._state is _State.DONE:
            return []
        raise IncompleteResponse(f"connection closed in state {self._state.name}")

    def _step(self, out: list[Event]) -> bool:
        """Advance one unit of framing; False when more bytes are needed."""
        state = self._state
        if state is _State.HEAD:
            return self._parse_head(out)
        if state in _DATA_STATES:
            return self._take_data(out)
        if state in _LINE_STATES:
            return self._parse_chunk_line(out)
        return False

    def _parse_head(self, out: list[Event]) -> bool:
        end = self._buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buf) > _MAX_HEAD:
                raise IncompleteResponse("response head too large")
            return False
        lines = bytes(self._buf[:end]).decode("latin-1").split("\r\n")
        del self._buf[: end + 4]
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise IncompleteResponse(f"bad status line {lines[0]!r}")
        status = int(parts[1])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if 100 <= status < 200:
            return True  # interim response (RFC 9110 §15.2): the real head follows
        conn = headers.get("connection", "").lower()
        keep_alive = parts[0] == "HTTP/1.1" and "close" not in conn
        self.head = ResponseHead(status, headers, keep_alive)
        out.append(self.head)
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self._state = _State.CHUNK_SIZE
        elif "content-length" in headers:
            self._remaining = int(headers["content-length"])
            self._state = _State.LENGTH
            if self._remaining == 0:
                self._finish(out)
        elif status in (204, 304):
            self._finish(out)
        else:
            self._state = _State.CLOSE
            self.head = ResponseHead(status, headers, keep_alive=False)
        return True

    def _take_data(self, out: list[Event]) -> bool:
        if not self._buf:
            return False
        if self._state is _State.CLOSE:
            out.append(BodyChunk(bytes(self._buf)))
            self._buf.clear()
            return False
        n = min(self._remaining, len(self._buf))
        out.append(BodyChunk(bytes(self._buf[:n])))
        del self._buf[:n]
        self._remaining -= n
        if self._remaining == 0:
            if self._state is _State.LENGTH:
                self._finish(out)
            else:
                self._state = _State.CHUNK_CRLF
        return True

    def _parse_chunk_line(self, out: list[Event]) -> bool:
        end = self._buf.find(b"\r\n")
        if end < 0:
            if len(self._buf) > _MAX_HEAD:
                raise IncompleteResponse("chunk line too long")
            return False
        line = bytes(self._buf[:end])
        del self._buf[: end + 2]
        if self._state is _State.CHUNK_CRLF:
            if line:
                raise IncompleteResponse("chunk data longer than its size")
            self._state = _State.CHUNK_SIZE
        elif self._state is _State.CHUNK_SIZE:
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError as exc:
                raise IncompleteResponse(f"bad chunk size {line!r}") from exc
            self._remaining = size
            self._state = _State.CHUNK_DATA if size else _State.TRAILER
        elif not line:  # the blank line after the (ignored) trailer fields
            self._finish(out)
        return True

    def _finish(self, out: list[Event]) -> None:
        self._state = _State.DONE
        out.append(ResponseEnd())


class SSEDecoder:
    """Server-Sent Events (WHATWG HTML §9.2.6): returns the ``data`` of each event.

    Lines end in LF or CRLF; several ``data:`` lines join with LF; comments and other
    fields (``event:``, ``id:``, ``retry:``) are ignored."""

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        buf = self._buf + chunk
        events: list[str] = []
        start = 0
        while True:
            nl = buf.find(b"\n", start)
            if nl < 0:
                break
            line = buf[start:nl]
            start = nl + 1
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            elif line.startswith(b"data:"):
                value = line[5:]
                if value.startswith(b" "):
                    value = value[1:]
                self._data.append(value.decode("utf-8"))
        self._buf = buf[start:]
        return events

    @property
    def pending(self) -> bool:
        """Bytes or data lines not yet closed by a blank line."""
        return bool(self._buf.strip()) or bool(self._data)
