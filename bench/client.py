"""The load generator's HTTP client: anyio TCP streams, keep-alive, one request at a time
per connection.

Cheap on purpose (the server under test shares the machine's two cores): one send per
request, 64 KiB receives, the sans-IO parsers of ``http1`` and no per-token task.
Timestamps are taken once per receive, so chunks that arrive together share one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import anyio
from anyio.abc import SocketStream

from bench.apis import RequestSpec, ResponseReader, build_body
from bench.http1 import (
    BodyChunk,
    IncompleteResponse,
    ResponseEnd,
    ResponseHead,
    ResponseParser,
    SSEDecoder,
    encode_request,
)
from bench.metrics import RequestOutput
from bench.workload import Prompt

__all__ = ["ConnectionPool", "Target", "send_request"]

_RECV = 65536


@dataclass(frozen=True, slots=True)
class Target:
    """Where the server listens (plain HTTP on TCP). ``keep_alive`` False sends every
    request on a connection of its own with ``Connection: close`` (llama-server: under
    load its HTTP layer closed 7-19 of 64-96 pooled keep-alive connections before the
    response head, 2026-12-04; one connection per request, none failed)."""

    host: str
    port: int
    keep_alive: bool = True

    @classmethod
    def from_url(cls, url: str) -> Target:
        parts = urlsplit(url if "//" in url else f"http://{url}")
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"expected http://HOST:PORT, got {url!r}")
        return cls(parts.hostname, parts.port or 80)

    @property
    def authority(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(slots=True)
class ConnectionPool:
    """Idle keep-alive connections; a request takes one or opens a new one."""

    target: Target
    idle: list[SocketStream] = field(default_factory=list)
    opened: int = 0

    async def acquire(self) -> tuple[SocketStream, bool]:
        """A connection, and whether it was reused (a reused one may have gone stale)."""
        if self.idle:
            return self.idle.pop(), True
        self.opened += 1
        return await anyio.connect_tcp(self.target.host, self.target.port), False

    def release(self, stream: SocketStream) -> None:
        self.idle.append(stream)

    async def aclose(self) -> None:
        while self.idle:
            await self.idle.pop().aclose()


async def _exchange(
    stream: SocketStream, payload: bytes, reader: ResponseReader
) -> tuple[RequestOutput, bool]:
    """Send one request and read its response; (output, connection reusable)."""
    try:
        await stream.send(payload)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
        raise IncompleteResponse(f"send failed: {exc!r}") from exc
    parser = ResponseParser()
    sse = SSEDecoder()
    body = bytearray()
    streaming = False
    while not parser.done:
        try:
            data = await stream.receive(_RECV)
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            events = parser.eof()
        else:
            events = parser.feed(data)
        t = time.perf_counter()
        # Body bytes of one read go to the SSE decoder at once: chunk boundaries carry no
        # meaning and one call per read is far cheaper than one per chunk.
        fresh = b"".join([ev.data for ev in events if isinstance(ev, BodyChunk)])
        head = next((ev for ev in events if isinstance(ev, ResponseHead)), None)
        if head is not None:
            ctype = head.headers.get("content-type", "")
            streaming = head.status == 200 and "text/event-stream" in ctype
        if streaming:
            for item in sse.feed(fresh):
                reader.on_event(item, t)
        else:
            body += fresh
        if events and isinstance(events[-1], ResponseEnd):
            return _conclude(parser, reader, streaming, bytes(body), t)
    raise AssertionError("unreachable: the loop returns at ResponseEnd")


def _conclude(
    parser: ResponseParser, reader: ResponseReader, streaming: bool, body: bytes, t: float
) -> tuple[RequestOutput, bool]:
    head = parser.head
    assert head is not None
    reusable = head.keep_alive
    reader.out.status = head.status
    if head.status != 200:
        return reader.fail(head.status, f"HTTP {head.status}: {body[:200]!r}"), reusable
    if streaming:
        return reader.finish_stream(), reusable
    if reader.spec.stream:
        reader.out.latency = t - reader.start
        return reader.fail(200, "asked for a stream, got a plain body"), reusable
    reader.on_body(body, t)
    return reader.out, reusable


async def send_request(
    pool: ConnectionPool, spec: RequestSpec, prompt: Prompt, timeout: float
) -> RequestOutput:
    """Run one request to completion; every failure comes back as a failed output."""
    payload = encode_request(
        "POST",
        spec.path,
        pool.target.authority,
        build_body(spec, prompt.prompt, prompt.output_len),
        "text/event-stream" if spec.stream else "application/json",
        close=not pool.target.keep_alive,
    )
    for attempt in (0, 1):
        reader = ResponseReader(spec, prompt.prompt_len, time.perf_counter())
        stream: SocketStream | None = None
        reusable = False
        try:
            with anyio.fail_after(timeout):
                stream, reused = await pool.acquire()
                try:
                    out, reusable = await _exchange(stream, payload, reader)
                except IncompleteResponse as exc:
                    # A pooled connection the server closed while idle fails before any
                    # byte arrives: retry once on a fresh one (RFC 9112 §9.3.1).
                    if (
                        reused
                        and attempt == 0
                        and reader.out.latency == 0
                        and not reader.out.status
                    ):
                        continue
                    out = reader.fail(reader.out.status, f"truncated response: {exc}")
        except TimeoutError:
            out = reader.fail(reader.out.status, f"no complete response within {timeout:g}s")
        except OSError as exc:
            out = reader.fail(0, f"connection error: {exc!r}")
        finally:
            if stream is not None:
                if reusable and pool.target.keep_alive:
                    pool.release(stream)
                else:
                    with anyio.CancelScope(shield=True):
                        await stream.aclose()
        if not out.success and reader.out.latency == 0:
            out.latency = time.perf_counter() - reader.start
        return out
    raise AssertionError("unreachable")
