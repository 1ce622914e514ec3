"""One HTTP/1.1 connection: a sans-IO core (the fast path, else h11) driven by one task.

The connection's task reads each request head, runs the handler and writes the
response, so a plain request costs no task switch. A second task, the reader, starts
the first time it is needed: a request body still arriving (it feeds the bounded body
queue), or a handler looking at ``request.disconnected`` (streams do), which needs
someone reading while the handler runs so that EOF or a reset sets it without any
write. From then on the reader owns every read for the rest of the connection and the
connection's task parses what it delivers: stopping and restarting it per request
would cost a cancellation each time, more than the hand-off it saves.

Small complete requests take the fast path (``fastpath``); anything else, or a response
the fast path will not write, is handed to h11 with the request's own bytes. Pipelined
requests stay buffered until the response before them is complete.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import anyio
import anyio.abc
import h11

from . import fastpath, wire
from .config import ServerConfig
from .errors import HTTPError
from .request import BodyQueue, Headers, Request
from .respond import ClientGone, ResponseWriter
from .responses import Response
from .streaming import StreamGate

__all__ = ["HTTPConnection", "ServerState", "watch_deadlines"]

log = logging.getLogger("transport")

App = Callable[[Request], Awaitable[Response]]
_STREAM_ERRORS = (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError)
_FAST_BODY_BYTES = 65536  # larger bodies stream through h11 and the bounded body queue


class ServerState(Protocol):
    draining: bool


class _Idle:
    draining = False


class _Phase(enum.Enum):
    IDLE = "idle"  # keep-alive: waiting for the first byte of the next request
    HEAD = "head"  # reading a request head
    BODY = "body"  # reading a request body
    WATCH = "watch"  # request complete, response in progress: read only to see EOF


@dataclass(frozen=True, slots=True)
class _Failure:
    """A request that could not be parsed: answer with this status, then close."""

    status: int
    message: str


class HTTPConnection(ResponseWriter):
    """One accepted connection, from the first request to the close.

    ``run()`` serves it to the end; a server calls ``close_idle()`` and ``abort()`` during
    shutdown and ``check_deadlines()`` from its watchdog. Without a server (a test, or an
    app handing over its own streams) the connection watches its own deadlines.
    """

    def __init__(
        self,
        stream: anyio.abc.ByteStream,
        app: App,
        config: ServerConfig,
        client: tuple[str, int] | None = None,
        server: ServerState | None = None,
    ) -> None:
        self.stream = stream
        self.app = app
        self.config = config
        self.client = client
        self.server: ServerState = server or _Idle()
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=config.max_header_bytes)
        self.idle = True  # no request in flight: shutdown may close this connection at once
        self.scope = anyio.CancelScope()
        self.current: Request | None = None
        # Bytes go to ``_buf`` while h11 is idle and has seen nothing (the fast path), and
        # to h11 while it holds state (``_live``) until it is idle and empty again.
        self._buf = b""
        self._live = False
        self._raw = b""  # the current fast request's bytes: h11 replays them if needed
        self._close_after = False  # the current fast request asked for Connection: close
        self._fast_body = min(config.max_body_bytes, _FAST_BODY_BYTES)
        self._eof = False
        self._failure: _Failure | None = None
        self._phase = _Phase.HEAD
        self._deadline = time.monotonic() + config.header_timeout
        self._read_scope: anyio.CancelScope | None = None
        self._send_since: float | None = None
        self._stream_gate: StreamGate | None = None  # a streamed body being written
        self._body: BodyQueue | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        # The reader task: started by the first request that needs it, then it reads for
        # the rest of the connection and this task waits on ``_arrived`` instead.
        self._watching = False
        self._upgraded = False
        self._reading_over = False
        self._reader_scope = anyio.CancelScope()
        self._reader_done: anyio.Event | None = None
        self._arrived: anyio.Event | None = None
        self._room: anyio.Event | None = None
        # The running backend's own classes: anyio.Event() / anyio.CancelScope() look the
        # backend up on every call.
        self._new_event = type(anyio.Event())
        self._new_scope = type(self.scope)
        self._graceful = True

    # ------------------------------------------------------------------ driver
    async def run(self) -> None:
        with self.scope:
            try:
                async with anyio.create_task_group() as tg:
                    self._tg = tg
                    if isinstance(self.server, _Idle):  # no server watchdog: bring our own
                        tg.start_soon(watch_deadlines, [self], self.config)
                    try:
                        await self._serve()
                    except ClientGone:
                        self._graceful = False
                    finally:
                        tg.cancel_scope.cancel()
            finally:
                self._tg = None
                with anyio.CancelScope(shield=True):
                    await wire.close_stream(self.stream, graceful=self._graceful)

    def close_idle(self) -> None:
        """Close now if no request is in flight (shutdown): FIN, not a reset."""
        if self.idle:
            self.scope.cancel()

    def abort(self, reason: str) -> None:
        """Cancel this connection now (shutdown deadline): the in-flight request learns why."""
        if self.current is not None:
            self.current.mark_disconnected(reason)
        self._graceful = False
        self.scope.cancel()

    async def _serve(self) -> None:
        while (item := await self._next_request()) is not None:
            self.idle = False
            if isinstance(item, _Failure):
                await self._send_error(item.status, item.message)
                return
            keep_alive = await self._respond(item)
            self.current = None
            if not keep_alive or self.server.draining or not self._next_cycle():
                return
            self.idle = True

    def _next_cycle(self) -> bool:
        if self._eof:
            return False
        self._make_room()
        if self._live:
            conn = self.h11
            if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                return False  # an unread body or Connection: close; either way we are done
            conn.start_next_cycle()
            if not conn.trailing_data[0]:
                self._live = False  # h11 is as good as new: back to the fast path
        elif self._close_after:
            return False
        self._raw = b""
        if self._buf or self.h11.trailing_data[0]:  # a pipelined request: its head is due
            self._set_phase(_Phase.HEAD, time.monotonic() + self.config.header_timeout)
        else:
            self._set_phase(_Phase.IDLE, time.monotonic() + self.config.keepalive_timeout)
        return True

    # ---------------------------------------------------------- reading heads
    async def _next_request(self) -> Request | _Failure | None:
        """Read and parse the next request head: fast path first, else h11."""
        while True:
            if not self._live:
                found = fastpath.parse_request(
                    self._buf, self.config.max_header_bytes, self._fast_body
                )
                if type(found) is fastpath.FastRequest:
                    return self._fast_request(found)
                if found is None:
                    self._go_live()
                    continue
                if found is fastpath.NEED_BODY and self._phase is not _Phase.BODY:
                    self._set_body_deadline()  # the head is in: the body has its own time
                if not await self._fill(by_reader=False):
                    return self._failure
                continue
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError as exc:
                return _Failure(exc.error_status_hint, str(exc))
            if event is h11.NEED_DATA or event is h11.PAUSED:
                if not await self._fill(by_reader=False):
                    return self._failure
            elif type(event) is h11.Request:
                return self._on_request(event)
            else:  # ConnectionClosed; a body event cannot come before its request
                return None

    def _fast_request(self, found: fastpath.FastRequest) -> Request:
        size = found.size
        self._raw, self._buf = self._buf[:size], self._buf[size:]
        self._close_after = found.close
        request = Request(found.method, found.target, Headers(found.headers), self.client)
        request._cached = found.body
        self._set_phase(_Phase.WATCH, math.inf)
        return self._begin(request)

    def _begin(self, request: Request) -> Request:
        request._on_watch = self._want_watch
        self.current = request
        return request

    def _go_live(self) -> None:
        """Hand every byte held so far to h11, which keeps the connection's state from here."""
        self._live = True
        data, self._raw, self._buf = self._raw + self._buf, b"", b""
        if data:
            self.h11.receive_data(data)

    def _replay(self) -> None:
        """Let h11 catch up on the current fast request, to answer it through h11."""
        replaying = bool(self._raw)
        self._go_live()
        for _ in range(4) if replaying else ():  # Request, Data, EndOfMessage
            if type(self.h11.next_event()) is h11.EndOfMessage:
                return
        if replaying:
            raise RuntimeError("h11 did not parse a request the fast path accepted")

    def _body_already_here(self) -> tuple[list[bytes], bool]:
        """The body events h11 can produce without more bytes: (chunks, complete)."""
        chunks: list[bytes] = []
        while True:
            event = self.h11.next_event()
            if type(event) is h11.Data:
                chunks.append(event.data)
            else:
                return chunks, type(event) is h11.EndOfMessage

    def _on_request(self, event: h11.Request) -> Request | _Failure:
        try:  # most bodies arrive with their head: take them now, skip the body queue
            chunks, complete = self._body_already_here()
        except h11.RemoteProtocolError as exc:
            return _Failure(exc.error_status_hint, str(exc))
        pairs, head_size, declared = wire.scan_head(event)
        if head_size > self.config.max_header_bytes:
            # h11 only bounds an *incomplete* head; a complete one can arrive in one read.
            return _Failure(431, "Request header fields too large")
        size = sum(map(len, chunks)) if chunks else 0
        limit = self.config.max_body_bytes
        if size > limit or (declared is not None and declared > limit):
            return _Failure(413, f"Request body exceeds {limit} bytes")
        request = Request(
            event.method.decode("ascii"),
            event.target.decode("latin-1"),
            Headers(pairs),
            self.client,
            None,
            event.http_version.decode("ascii"),
        )
        self._begin(request)
        if complete:
            request._cached = b"".join(chunks) if chunks else b""
            self._set_phase(_Phase.WATCH, math.inf)
            return request
        body = self._body = BodyQueue(limit)
        request._body = body
        request._cached = None
        for chunk in chunks:
            body.push(chunk)
        if self.h11.they_are_waiting_for_100_continue:
            request._on_first_pull = self._send_continue
        self._set_phase(_Phase.BODY, time.monotonic() + self.config.body_timeout)
        self._want_watch(request)  # the watcher streams the rest of the body in
        return request

    async def _fill(self, by_reader: bool) -> bool:
        """Read once into the buffer or h11; False when the reading side is finished."""
        if self._eof or self._reading_over:
            return False
        if self._watching and not by_reader:  # the reader task reads: wait for what it gets
            self._make_room()
            self._arrived = arrived = self._new_event()
            await arrived.wait()
            return not self._reading_over
        data = b""
        with self._new_scope() as scope:  # cancelled by check_deadlines
            self._read_scope = scope
            try:
                data = await self.stream.receive(65536)
            except (anyio.EndOfStream, *_STREAM_ERRORS):
                data = b""
            finally:
                self._read_scope = None
        if scope.cancelled_caught:
            return self._on_timeout()
        if not data:
            self._on_gone()
            return False
        if self._phase is _Phase.IDLE:
            self._set_phase(_Phase.HEAD, time.monotonic() + self.config.header_timeout)
        if self._live:
            self.h11.receive_data(data)
        else:
            self._buf += data
        return True

    def _held(self) -> int:
        return len(self.h11.trailing_data[0]) if self._live else len(self._buf)

    def _on_timeout(self) -> bool:
        phase = self._phase
        if phase is _Phase.BODY and self._body is not None:
            self._body.fail(HTTPError(408, "Request body timeout"))
        elif phase is _Phase.BODY and not self._live:  # a fast request's body never came
            self._failure = _Failure(408, "Request body timeout")
        elif phase is _Phase.HEAD and (self._buf or self.h11.trailing_data[0]):
            self._failure = _Failure(408, "Request header timeout")
        return False  # an idle connection that timed out just closes

    def _on_gone(self) -> None:
        self._eof = True
        if self._body is not None:
            self._body.fail(HTTPError(400, "Client disconnected during the request body"))
        if self.current is not None:
            self.current.mark_disconnected("client_gone")
        self._graceful = False

    def _set_body_deadline(self) -> None:
        self._set_phase(_Phase.BODY, time.monotonic() + self.config.body_timeout)

    def _set_phase(self, phase: _Phase, deadline: float) -> None:
        self._phase = phase
        self._deadline = deadline

    def check_deadlines(self, now: float) -> None:
        """Enforce the read and send deadlines; called a few times per timeout period.

        Deadlines are plain numbers checked by a watchdog rather than a timer per read and
        per write: arming and cancelling two timers per request costs more than the rest
        of the transport's own work.
        """
        if self._read_scope is not None and now >= self._deadline:
            self._read_scope.cancel()
        if self._send_since is not None and now - self._send_since >= self.config.send_timeout:
            if self.current is not None:
                self.current.mark_disconnected("send_stall")
            self._graceful = False
            self.scope.cancel()
        gate = self._stream_gate
        if gate is not None and self._tg is not None and gate.ping_due(now):
            self._tg.start_soon(gate.ping)

    # ----------------------------------------------------------------- reader
    def _want_watch(self, request: Request) -> None:
        """Start the reader task (sync: ``request.disconnected`` calls it on first use)."""
        if request is not self.current or self._watching or self._upgraded or self._tg is None:
            return
        if self._eof or self._reading_over:
            return
        self._watching = True
        self._reader_done = self._new_event()
        self._tg.start_soon(self._reader)

    async def _reader(self) -> None:
        """Read for the rest of the connection: bodies into their queue, EOF into
        ``request.disconnected``, heads into the buffer the connection task parses."""
        try:
            with self._reader_scope:
                while True:
                    if self._held() > self.config.max_header_bytes:
                        # Enough pipelined bytes held until the current response is done.
                        self._room = room = self._new_event()
                        await room.wait()
                    if not await self._fill(by_reader=True):
                        return
                    self._wake_main()
                    if self._body is not None and not await self._take_body_events():
                        return
        finally:
            self._reading_over = True
            self._wake_main()
            assert self._reader_done is not None
            self._reader_done.set()

    def _wake_main(self) -> None:
        if self._arrived is not None:
            self._arrived.set()
            self._arrived = None

    def _make_room(self) -> None:
        if self._room is not None:
            self._room.set()
            self._room = None

    async def _stop_watching(self) -> None:
        """Stop the reader for good (a WebSocket takes the socket over)."""
        self._reader_scope.cancel()
        assert self._reader_done is not None
        await self._reader_done.wait()

    async def _take_body_events(self) -> bool:
        """Move what h11 has parsed into the body queue; False when reading should stop."""
        while True:
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError as exc:
                if self._body is not None:  # malformed body: the handler reading it gets a 400
                    self._body.fail(
                        HTTPError(exc.error_status_hint, f"Malformed request body: {exc}")
                    )
                return False
            body = self._body
            if type(event) is h11.Data and body is not None:
                if not body.push(event.data):
                    return False  # 413: the handler sees it; the connection closes after
                await body.wait_for_space()
            elif type(event) is h11.EndOfMessage and body is not None:
                body.finish()
                self._body = None
                self._set_phase(_Phase.WATCH, math.inf)
            elif type(event) is h11.ConnectionClosed:
                self._on_gone()
                return False
            else:  # NEED_DATA or PAUSED
                return True


def watchdog_interval(config: ServerConfig) -> float:
    shortest = min(
        config.header_timeout,
        config.body_timeout,
        config.keepalive_timeout,
        config.send_timeout,
        config.sse_ping_interval,  # a ping is due within a quarter interval of its time
    )
    return min(1.0, max(0.005, shortest / 4))


async def watch_deadlines(connections: Iterable[HTTPConnection], config: ServerConfig) -> None:
    """Check every connection's deadlines, forever: a timeout fires within a quarter of
    the shortest configured timeout (at most a second) of its due time."""
    interval = watchdog_interval(config)
    while True:
        await anyio.sleep(interval)
        now = time.monotonic()
        for conn in list(connections):
            conn.check_deadlines(now)
