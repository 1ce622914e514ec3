"""The reading half of an HTTP/1.1 connection: request heads and bodies, and the reader task.

The connection's task reads each request head itself, so a plain request costs no task
switch. A second task, the reader, starts the first time it is needed: a request body
still arriving (it feeds the bounded body queue), or a handler looking at
``request.disconnected`` (streams do), which needs someone reading while the handler
runs so that EOF or a reset sets it without any write. From then on the reader owns
every read for the rest of the connection and the connection's task parses what it
delivers: stopping and restarting it per request would cost a cancellation each time,
more than the hand-off it saves.

Small complete requests take the fast path (``fastpath``); anything else goes to h11
with the request's own bytes. Pipelined requests stay buffered until the response
before them is complete. Each read is bounded by the deadline of the phase it is in,
which the connection's watchdog enforces (``check_deadline``).
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass

import anyio
import anyio.abc
import h11

from . import fastpath, http_util
from .channel import STREAM_ERRORS, Channel
from .errors import HTTPError
from .request import BodyQueue, Headers, Request

__all__ = ["Failure", "RequestReader"]

_FAST_BODY_BYTES = 65536  # larger bodies stream through h11 and the bounded body queue


class _Phase(enum.Enum):
    IDLE = "idle"  # keep-alive: waiting for the first byte of the next request
    HEAD = "head"  # reading a request head
    BODY = "body"  # reading a request body
    WATCH = "watch"  # request complete, response in progress: read only to see EOF


@dataclass(frozen=True, slots=True)
class Failure:
    """A request that could not be parsed: answer with this status, then close."""

    status: int
    message: str


class RequestReader:
    """Reads one connection's requests; ``tasks`` is where the reader task starts."""

    def __init__(self, channel: Channel) -> None:
        self.ch = channel
        config = channel.config
        self.config = config
        self.tasks: anyio.abc.TaskGroup | None = None  # set while the connection runs
        self._fast_body = min(config.max_body_bytes, _FAST_BODY_BYTES)
        self._fast_path = config.fast_path
        if not config.fast_path:
            channel.go_live()  # h11 from the first byte, and it never hands back
        self._eof = False
        self._failure: Failure | None = None
        self._phase = _Phase.HEAD
        self._deadline = time.monotonic() + config.header_timeout
        self._read_scope: anyio.CancelScope | None = None
        self._body: BodyQueue | None = None
        # The reader task: started by the first request that needs it, then it reads for
        # the rest of the connection and the connection's task waits on ``_arrived``.
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
        self._new_scope = type(self._reader_scope)

    @property
    def watching(self) -> bool:
        """Whether the reader task has started (it then reads to the connection's end)."""
        return self._watching

    # ---------------------------------------------------------- reading heads
    async def next_request(self) -> Request | Failure | None:
        """Read and parse the next request head: fast path first, else h11."""
        ch = self.ch
        while True:
            if not ch.live:
                found = fastpath.parse_request(
                    ch.buf, self.config.max_header_bytes, self._fast_body
                )
                if type(found) is fastpath.FastRequest:
                    return self._fast_request(found)
                if found is None:
                    ch.go_live()
                    continue
                if found is fastpath.NEED_BODY and self._phase is not _Phase.BODY:
                    self._set_body_deadline()  # the head is in: the body has its own time
                if not await self._fill(by_reader=False):
                    return self._failure
                continue
            try:
                event = ch.h11.next_event()
            except h11.RemoteProtocolError as exc:
                return Failure(exc.error_status_hint, str(exc))
            if event is h11.NEED_DATA or event is h11.PAUSED:
                if not await self._fill(by_reader=False):
                    return self._failure
            elif type(event) is h11.Request:
                return self._on_request(event)
            else:  # ConnectionClosed; a body event cannot come before its request
                return None

    def next_cycle(self) -> bool:
        """Get ready for the next request on this connection; False when there is none."""
        ch = self.ch
        if self._eof:
            return False
        self._make_room()
        if ch.live:
            conn = ch.h11
            if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                return False  # an unread body or Connection: close; either way we are done
            conn.start_next_cycle()
            if not conn.trailing_data[0] and self._fast_path:
                ch.live = False  # h11 is as good as new: back to the fast path
        elif ch.close_after:
            return False
        ch.raw = b""
        if ch.has_pending():  # a pipelined request: its head is due
            self._set_phase(_Phase.HEAD, time.monotonic() + self.config.header_timeout)
        else:
            self._set_phase(_Phase.IDLE, time.monotonic() + self._idle_timeout())
        return True

    def _idle_timeout(self) -> float:
        config = self.config
        if self.ch.server.draining:
            return min(config.keepalive_timeout, config.drain_idle_timeout)
        return config.keepalive_timeout

    def begin_drain(self) -> None:
        """The server began draining: a connection waiting for a request of which no
        byte has come waits ``drain_idle_timeout`` more at most (its watchdog ends it)."""
        if self._phase is _Phase.IDLE or (self._phase is _Phase.HEAD and not self.ch.has_pending()):
            due = time.monotonic() + self.config.drain_idle_timeout
            self._deadline = min(self._deadline, due)

    def _fast_request(self, found: fastpath.FastRequest) -> Request:
        ch = self.ch
        size = found.size
        ch.raw, ch.buf = ch.buf[:size], ch.buf[size:]
        ch.close_after = found.close
        request = Request(found.method, found.target, Headers(found.headers), ch.client)
        request._cached = found.body
        self._set_phase(_Phase.WATCH, math.inf)
        return self._begin(request)

    def _begin(self, request: Request) -> Request:
        request._on_watch = self._want_watch
        self.ch.current = request
        return request

    def _body_already_here(self) -> tuple[list[bytes], bool]:
        """The body events h11 can produce without more bytes: (chunks, complete)."""
        chunks: list[bytes] = []
        while True:
            event = self.ch.h11.next_event()
            if type(event) is h11.Data:
                chunks.append(event.data)
            else:
                return chunks, type(event) is h11.EndOfMessage

    def _on_request(self, event: h11.Request) -> Request | Failure:
        pairs, head_size, declared, coded = http_util.scan_head(event)
        if head_size > self.config.max_header_bytes:
            # h11 only bounds an *incomplete* head; a complete one can arrive in one read.
            return Failure(431, "Request header fields too large")
        if not event.http_version.startswith(b"1."):  # h11 parses any d.d (RFC 9110 15.6.6)
            return Failure(505, f"HTTP/{event.http_version.decode()} is not supported")
        target = http_util.origin_form(event.method, event.target)
        if target is None:
            return Failure(400, "Invalid request target (origin or absolute form expected)")
        problem = http_util.framing_problem(event, declared, coded)
        if problem is not None:  # 400 and close, before a byte of the body is read
            return Failure(400, f"Ambiguous request framing: {problem}")
        try:  # most bodies arrive with their head: take them now, skip the body queue
            chunks, complete = self._body_already_here()
        except h11.RemoteProtocolError as exc:
            return Failure(exc.error_status_hint, str(exc))
        size = sum(map(len, chunks)) if chunks else 0
        limit = self.config.max_body_bytes
        if size > limit or (declared is not None and declared > limit):
            return Failure(413, f"Request body exceeds {limit} bytes")
        request = Request(
            event.method.decode("ascii"),
            target.decode("latin-1"),
            Headers(pairs),
            self.ch.client,
            None,
            event.http_version.decode("ascii"),
        )
        self._begin(request)
        if complete:
            request._cached = b"".join(chunks) if chunks else b""
            self._set_phase(_Phase.WATCH, math.inf)
        else:
            self._stream_body(request, chunks, limit)
        return request

    def _stream_body(self, request: Request, chunks: list[bytes], limit: int) -> None:
        """Give ``request`` a body queue holding ``chunks``; the reader task fills the rest."""
        body = self._body = BodyQueue(limit)
        request._body = body
        request._cached = None
        for chunk in chunks:
            body.push(chunk)
        if self.ch.h11.they_are_waiting_for_100_continue:
            request._on_first_pull = self._send_continue
        self._set_phase(_Phase.BODY, time.monotonic() + self.config.body_timeout)
        # The reader may be waiting for room, having read this request's head and body
        # while they looked like bytes pipelined behind the last response: they are the
        # current request's now, and it must go on reading them into the queue.
        self._make_room()
        self._want_watch(request)  # the watcher streams the rest of the body in

    async def _send_continue(self) -> None:
        """Write 100 Continue once the handler starts reading the body (RFC 9110 10.1.1)."""
        ch = self.ch
        if ch.h11.they_are_waiting_for_100_continue and ch.current is not None:
            data = ch.h11.send(h11.InformationalResponse(status_code=100, headers=[]))
            await ch.write(ch.current, data)
            self._set_body_deadline()

    # ---------------------------------------------------------- reading bytes
    async def _fill(self, by_reader: bool) -> bool:
        """Read once into the buffer or h11; False when the reading side is finished."""
        if self._eof or self._reading_over:
            return False
        if self._watching and not by_reader:  # the reader task reads: wait for what it gets
            self._make_room()
            self._arrived = arrived = self._new_event()
            await arrived.wait()
            return not self._reading_over
        ch = self.ch
        data = b""
        with self._new_scope() as scope:  # cancelled by check_deadline
            self._read_scope = scope
            try:
                data = await ch.stream.receive(65536)
            except (anyio.EndOfStream, *STREAM_ERRORS):
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
        if ch.live:
            ch.h11.receive_data(data)
        else:
            ch.buf += data
        return True

    def _on_timeout(self) -> bool:
        phase = self._phase
        if phase is _Phase.BODY and self._body is not None:
            self._body.fail(HTTPError(408, "Request body timeout"))
        elif phase is _Phase.BODY and not self.ch.live:  # a fast request's body never came
            self._failure = Failure(408, "Request body timeout")
        elif phase is _Phase.HEAD and self.ch.has_pending():
            self._failure = Failure(408, "Request header timeout")
        return False  # an idle connection that timed out just closes

    def _on_gone(self) -> None:
        self._eof = True
        if self._body is not None:
            self._body.fail(HTTPError(400, "Client disconnected during the request body"))
        if self.ch.current is not None:
            self.ch.current.mark_disconnected("client_gone")
        self.ch.graceful = False

    def _set_body_deadline(self) -> None:
        self._set_phase(_Phase.BODY, time.monotonic() + self.config.body_timeout)

    def _set_phase(self, phase: _Phase, deadline: float) -> None:
        self._phase = phase
        self._deadline = deadline

    def check_deadline(self, now: float) -> None:
        """End the read in progress if its phase's deadline has passed (the watchdog)."""
        if self._read_scope is not None and now >= self._deadline:
            self._read_scope.cancel()

    # ----------------------------------------------------------------- reader
    def _want_watch(self, request: Request) -> None:
        """Start the reader task (sync: ``request.disconnected`` calls it on first use)."""
        if request is not self.ch.current or self._watching or self._upgraded:
            return
        if self.tasks is None or self._eof or self._reading_over:
            return
        self._watching = True
        self._reader_done = self._new_event()
        self.tasks.start_soon(self._reader)

    async def _reader(self) -> None:
        """Read for the rest of the connection: bodies into their queue, EOF into
        ``request.disconnected``, heads into the buffer the connection task parses."""
        try:
            with self._reader_scope:
                while True:
                    if self._body is None and self.ch.held() > self.config.max_header_bytes:
                        # Enough pipelined bytes held until the current response is done
                        # (a body being read is the current request's: never held back).
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

    async def hand_over(self) -> None:
        """Stop reading for good: a WebSocket takes the socket's read side over."""
        self._upgraded = True
        if self._watching:
            self._reader_scope.cancel()
            assert self._reader_done is not None
            await self._reader_done.wait()

    async def _take_body_events(self) -> bool:
        """Move what h11 has parsed into the body queue; False when reading should stop."""
        while True:
            try:
                event = self.ch.h11.next_event()
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
