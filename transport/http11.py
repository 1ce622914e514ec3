"""One HTTP/1.1 connection: an h11 core driven by two tasks.

The reader task owns every socket read: it parses requests, feeds bodies into a bounded
queue, enforces the header/body/keep-alive deadlines, and keeps reading while a response
is produced so that EOF or a reset sets ``request.disconnected`` without any write. The
responder (the connection's own task) runs the handler and owns every write, each one
bounded by ``send_timeout``. Pipelined requests stay parsed-but-held in h11 (``PAUSED``)
until the response before them is complete.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import anyio
import anyio.abc
import h11

from . import wire
from .config import ServerConfig
from .errors import HTTPError
from .request import BodyQueue, Headers, Request
from .responses import Response, SSEResponse, StreamResponse, WebSocketResponse
from .streaming import discard, pump

__all__ = ["HTTPConnection", "ServerState", "watch_deadlines"]

log = logging.getLogger("transport")

App = Callable[[Request], Awaitable[Response]]
_STREAM_ERRORS = (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError)


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
    """A request the reader could not parse: answer with this status, then close."""

    status: int
    message: str


class _ClientGone(Exception):
    """A write failed or stalled; the connection is finished."""


class HTTPConnection:
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
        # Reader -> responder hand-off. h11 pauses after each request until the response
        # is done, so this never holds more than a request and a failure.
        self._inbox: deque[Request | _Failure] = deque()
        self._inbox_closed = False
        self._inbox_wake: anyio.Event | None = None
        self._phase = _Phase.HEAD
        self._deadline = time.monotonic() + config.header_timeout
        self._read_scope: anyio.CancelScope | None = None
        self._poked = False
        self._send_since: float | None = None
        self._body: BodyQueue | None = None
        self._reader_scope = anyio.CancelScope()
        self._reader_done = anyio.Event()
        # The running backend's own classes: anyio.Event() / anyio.CancelScope() look the
        # backend up on every call, and these two are made once per request.
        self._new_event = type(self._reader_done)
        self._new_scope = type(self._reader_scope)
        self._graceful = True

    # ------------------------------------------------------------------ driver
    async def run(self) -> None:
        with self.scope:
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._read_loop)
                    if isinstance(self.server, _Idle):  # no server watchdog: bring our own
                        tg.start_soon(watch_deadlines, [self], self.config)
                    try:
                        await self._respond_loop()
                    except _ClientGone:
                        self._graceful = False
                    finally:
                        tg.cancel_scope.cancel()
            finally:
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

    # ------------------------------------------------------------------ reader
    async def _read_loop(self) -> None:
        with self._reader_scope:
            try:
                await self._read_events()
            finally:
                self._inbox_closed = True
                self._wake_responder()
                self._reader_done.set()

    def _deliver(self, item: Request | _Failure) -> None:
        self._inbox.append(item)
        self._wake_responder()

    def _wake_responder(self) -> None:
        if self._inbox_wake is not None:
            self._inbox_wake.set()
            self._inbox_wake = None

    async def _next_item(self) -> Request | _Failure | None:
        while not self._inbox:
            if self._inbox_closed:
                return None
            self._inbox_wake = self._new_event()
            await self._inbox_wake.wait()
        return self._inbox.popleft()

    async def _read_events(self) -> None:
        conn = self.h11
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                self._on_protocol_error(exc)
                return
            if event is h11.NEED_DATA or event is h11.PAUSED:
                if not await self._fill(paused=event is h11.PAUSED):
                    return
            elif type(event) is h11.Request:
                if not await self._on_request(event):
                    return
            elif type(event) is h11.Data:
                assert self._body is not None
                if not self._body.push(event.data):
                    return  # 413: the handler sees it; the connection closes after
                await self._body.wait_for_space()
            elif type(event) is h11.EndOfMessage:
                assert self._body is not None
                self._body.finish()
                self._body = None
                self._set_phase(_Phase.WATCH, math.inf)
            else:  # ConnectionClosed
                self._on_gone()
                return

    async def _fill(self, paused: bool) -> bool:
        """Read once into h11; False when the connection is finished on the reading side."""
        limit_reached = paused and len(self.h11.trailing_data[0]) > self.config.max_header_bytes
        data = b""
        with self._new_scope() as scope:  # cancelled by a poke or by check_deadlines
            self._read_scope = scope
            try:
                if limit_reached:
                    # Enough pipelined bytes held; wait for the responder to resume us.
                    await anyio.sleep_forever()
                data = await self.stream.receive(65536)
            except (anyio.EndOfStream, *_STREAM_ERRORS):
                data = b""
            finally:
                self._read_scope = None
        poked, self._poked = self._poked, False
        if scope.cancelled_caught:
            return self._on_timeout() if not poked else True
        if not data:
            self._on_gone()
            return False
        if self._phase is _Phase.IDLE:
            self._set_phase(_Phase.HEAD, time.monotonic() + self.config.header_timeout)
        self.h11.receive_data(data)
        return True

    def _body_already_here(self) -> tuple[list[bytes], bool]:
        """The body events h11 can produce without more bytes: (chunks, complete)."""
        chunks: list[bytes] = []
        while True:
            event = self.h11.next_event()
            if type(event) is h11.Data:
                chunks.append(event.data)
            else:
                return chunks, type(event) is h11.EndOfMessage

    async def _on_request(self, event: h11.Request) -> bool:
        conn = self.h11
        try:  # most bodies arrive with their head: take them now, skip the body queue
            chunks, complete = self._body_already_here()
        except h11.RemoteProtocolError as exc:
            self._deliver(_Failure(exc.error_status_hint, str(exc)))
            return False
        pairs, head_size, declared = wire.scan_head(event)
        if head_size > self.config.max_header_bytes:
            # h11 only bounds an *incomplete* head; a complete one can arrive in one read.
            self._deliver(_Failure(431, "Request header fields too large"))
            return False
        size = sum(map(len, chunks)) if chunks else 0
        limit = self.config.max_body_bytes
        if size > limit or (declared is not None and declared > limit):
            self._deliver(_Failure(413, f"Request body exceeds {limit} bytes"))
            return False
        request = Request(
            event.method.decode("ascii"),
            event.target.decode("latin-1"),
            Headers(pairs),
            self.client,
            None,
            event.http_version.decode("ascii"),
        )
        if complete:
            request._cached = b"".join(chunks) if chunks else b""
            self._set_phase(_Phase.WATCH, math.inf)
        else:
            body = self._body = BodyQueue(limit)
            request._body = body
            request._cached = None
            for chunk in chunks:
                body.push(chunk)
            if conn.they_are_waiting_for_100_continue:
                request._on_first_pull = self._send_continue
            self._set_phase(_Phase.BODY, time.monotonic() + self.config.body_timeout)
        self.current = request
        self._deliver(request)
        return True

    def _on_protocol_error(self, exc: h11.RemoteProtocolError) -> None:
        if self._body is not None:  # malformed body: the handler reading it gets a 400
            self._body.fail(HTTPError(exc.error_status_hint, f"Malformed request body: {exc}"))
        elif self._phase is not _Phase.WATCH:
            self._deliver(_Failure(exc.error_status_hint, str(exc)))

    def _on_timeout(self) -> bool:
        phase = self._phase
        if phase is _Phase.BODY and self._body is not None:
            self._body.fail(HTTPError(408, "Request body timeout"))
        elif phase is _Phase.HEAD and self.h11.trailing_data[0]:
            self._deliver(_Failure(408, "Request header timeout"))
        return False  # an idle connection that timed out just closes

    def _on_gone(self) -> None:
        if self._body is not None:
            self._body.fail(HTTPError(400, "Client disconnected during the request body"))
        if self.current is not None:
            self.current.mark_disconnected("client_gone")
        self._graceful = False

    def _set_phase(self, phase: _Phase, deadline: float) -> None:
        self._phase = phase
        self._deadline = deadline

    def check_deadlines(self, now: float) -> None:
        """Enforce the read and send deadlines; called a few times per timeout period.

        Deadlines are plain numbers checked by a watchdog rather than a timer per read and
        per write: arming and cancelling two timers per request costs more than the rest
        of the transport's own work.
        """
        if self._read_scope is not None and now >= self._deadline and not self._poked:
            self._read_scope.cancel()
        if self._send_since is not None and now - self._send_since >= self.config.send_timeout:
            if self.current is not None:
                self.current.mark_disconnected("send_stall")
            self._graceful = False
            self.scope.cancel()

    # --------------------------------------------------------------- responder
    async def _respond_loop(self) -> None:
        while (item := await self._next_item()) is not None:
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
        conn = self.h11
        if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
            return False  # an unread body or Connection: close; either way we are done
        conn.start_next_cycle()
        self._set_phase(_Phase.IDLE, time.monotonic() + self.config.keepalive_timeout)
        if self._read_scope is not None and conn.trailing_data[0]:
            self._poked = True  # a pipelined request is already buffered: parse it now
            self._read_scope.cancel()
        return True

    async def _respond(self, request: Request) -> bool:
        try:
            response = await self.app(request)
            if not isinstance(response, Response):
                raise TypeError(f"handler returned {type(response).__name__}, not a Response")
        except HTTPError as exc:
            response = wire.error_response(exc)
        except Exception:
            log.exception("unhandled error in handler for %s %s", request.method, request.path)
            response = wire.error_response(HTTPError(500, "Internal Server Error"))
        if request.is_disconnected():
            self._graceful = False
            return False
        if isinstance(response, WebSocketResponse):
            return await self._upgrade(request, response)
        if isinstance(response, StreamResponse):
            return await self._send_stream(request, response)
        await self._send_whole(request, response)
        return True

    async def _send_whole(self, request: Request, response: Response) -> None:
        conn = self.h11
        body = response.body
        headers = wire.response_headers(response.headers, self.config, self.server.draining)
        bodiless = response.status < 200 or response.status in (204, 304)
        if not bodiless:
            headers.append((b"content-length", str(len(body)).encode()))
        try:
            data = conn.send(
                h11.Response(
                    status_code=response.status,
                    headers=headers,
                    reason=wire.reason(response.status),
                )
            )
            if body and not bodiless and request.method != "HEAD":
                data += conn.send(h11.Data(data=body))
            data += conn.send(h11.EndOfMessage())
        except h11.LocalProtocolError:
            log.exception("invalid response from handler for %s %s", request.method, request.path)
            self._graceful = False
            return
        await self._write(request, data)

    async def _send_stream(self, request: Request, response: StreamResponse) -> bool:
        conn = self.h11
        headers = wire.response_headers(response.headers, self.config, self.server.draining)
        reason = wire.reason(response.status)
        head = conn.send(h11.Response(status_code=response.status, headers=headers, reason=reason))
        try:
            await self._write(request, head)
        except _ClientGone:
            await discard(response.chunks)
            raise
        if request.method == "HEAD":
            await discard(response.chunks)
            ok = True
        else:
            sse = isinstance(response, SSEResponse)
            ping = self.config.sse_ping_interval if sse else math.inf

            async def write_data(data: bytes) -> None:
                await self._write(request, conn.send(h11.Data(data=data)))

            try:
                ok = await pump(request, response.chunks, write_data, sse, ping)
            except _ClientGone:
                ok = False
        if not ok:
            self._graceful = False  # an unterminated chunked body tells the client it is cut
            return False
        await self._write(request, conn.send(h11.EndOfMessage()))
        return True

    async def _upgrade(self, request: Request, response: WebSocketResponse) -> bool:
        from . import websocket

        problem = websocket.handshake_problem(request)
        if problem is not None:
            await self._send_whole(request, wire.error_response(problem))
            return True
        self._reader_scope.cancel()  # the WebSocket takes over the socket's read side
        await self._reader_done.wait()
        accept = websocket.accept_headers(request, response.subprotocol, self.config)
        await self._write(
            request,
            self.h11.send(
                h11.InformationalResponse(
                    status_code=101, headers=accept, reason=b"Switching Protocols"
                )
            ),
        )
        trailing = self.h11.trailing_data[0]
        await websocket.run_session(self.stream, request, response.session, self.config, trailing)
        return False

    async def _send_continue(self) -> None:
        if self.h11.they_are_waiting_for_100_continue and self.current is not None:
            data = self.h11.send(h11.InformationalResponse(status_code=100, headers=[]))
            await self._write(self.current, data)
            self._set_phase(_Phase.BODY, time.monotonic() + self.config.body_timeout)

    async def _send_error(self, status: int, message: str) -> None:
        if self.h11.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        response = wire.error_response(HTTPError(status, message))
        response.headers.append(("connection", "close"))
        request = Request("GET", "/", Headers([]), self.client)
        await self._send_whole(request, response)

    async def _write(self, request: Request, data: bytes) -> None:
        # A write that outlives send_timeout cancels the whole connection (check_deadlines).
        self._send_since = time.monotonic()
        try:
            await self.stream.send(data)
        except _STREAM_ERRORS:
            request.mark_disconnected("client_gone")
            raise _ClientGone from None
        finally:
            self._send_since = None


def watchdog_interval(config: ServerConfig) -> float:
    shortest = min(
        config.header_timeout, config.body_timeout, config.keepalive_timeout, config.send_timeout
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
