"""The writing half of an HTTP/1.1 connection: handler call, responses, upgrades.

Split from ``http11`` (the reading half and the driver) only to keep modules short;
``HTTPConnection`` combines the two. Every write is bounded by ``send_timeout`` through
the connection's watchdog deadline.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import anyio.abc
import h11

from . import fastpath, wire
from .config import ServerConfig
from .errors import HTTPError
from .request import Headers, Request
from .responses import Response, SSEResponse, StreamResponse, WebSocketResponse
from .streaming import StreamGate, discard, pump

if TYPE_CHECKING:
    from .http11 import ServerState

__all__ = ["ClientGone", "ResponseWriter"]

log = logging.getLogger("transport")

_STREAM_ERRORS = (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError)


class ClientGone(Exception):
    """A write failed or stalled; the connection is finished."""


class ResponseWriter:
    """Runs the handler for a request and writes what it returns."""

    stream: anyio.abc.ByteStream
    app: Callable[[Request], Awaitable[Response]]
    config: ServerConfig
    client: tuple[str, int] | None
    server: ServerState
    h11: h11.Connection
    current: Request | None
    _live: bool
    _close_after: bool
    _watching: bool
    _upgraded: bool
    _graceful: bool
    _send_since: float | None
    _stream_gate: StreamGate | None

    def _replay(self) -> None: ...
    def _go_live(self) -> None: ...
    async def _stop_watching(self) -> None: ...
    def _set_body_deadline(self) -> None: ...

    async def _respond(self, request: Request) -> bool:
        """Run the handler and write its response; False when the connection must close."""
        sent: list[bool] = []

        async def responder(req: Request, response: Response) -> bool:
            ok = await self._send_response(req, response)
            sent.append(ok)
            return ok

        request._responder = responder
        try:
            response = await self.app(request)
            if not isinstance(response, Response):
                raise TypeError(f"handler returned {type(response).__name__}, not a Response")
        except HTTPError as exc:
            response = wire.error_response(exc)
        except ClientGone:
            raise
        except Exception:
            log.exception("unhandled error in handler for %s %s", request.method, request.path)
            response = wire.error_response(HTTPError(500, "Internal Server Error"))
        finally:
            request._responder = None
        if request.responded is not None:  # the handler sent it (or began to) itself
            return bool(sent and sent[0])
        return await self._send_response(request, response)

    async def _send_response(self, request: Request, response: Response) -> bool:
        if request.is_disconnected():
            self._graceful = False
            return False
        try:
            if isinstance(response, WebSocketResponse):
                return await self._upgrade(request, response)
            if isinstance(response, StreamResponse):
                return await self._send_stream(request, response)
            await self._send_whole(request, response)
        except ClientGone:
            self._graceful = False
            return False
        return True

    async def _send_whole(self, request: Request, response: Response) -> None:
        if not self._live:  # a fast request: answer without h11 when the response allows
            closing = self._close_after or self.server.draining
            data = fastpath.encode_response(
                response.status,
                wire.reason(response.status),
                wire.preamble(self.config.server_header),
                response.headers,
                response.body,
                request.method == "HEAD",
                closing,
            )
            if data is not None:
                self._close_after = closing
                await self._write(request, data)
                return
            self._replay()
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
        reason = wire.reason(response.status)
        head = None
        if not self._live and request.method != "HEAD":  # a fast request: h11 not needed
            closing = self._close_after or self.server.draining
            preamble = wire.preamble(self.config.server_header)
            head = fastpath.encode_stream_head(
                response.status, reason, preamble, response.headers, closing
            )
            if head is not None:
                self._close_after = closing
        fast = head is not None
        if head is None:
            self._replay()
            headers = wire.response_headers(response.headers, self.config, self.server.draining)
            head = conn.send(
                h11.Response(status_code=response.status, headers=headers, reason=reason)
            )
        try:
            await self._write(request, head)
        except ClientGone:
            await discard(response.chunks)
            raise
        if request.method == "HEAD":
            await discard(response.chunks)
            ok = True
        else:
            sse = isinstance(response, SSEResponse)
            chunked = fast or _is_chunked(head)

            async def write_data(data: bytes) -> None:
                # h11 keeps no state for a chunk of a chunked body: frame it here (what
                # its ChunkedWriter writes) and save its event machinery per chunk.
                if not data:  # an empty chunk would end the body
                    return
                if chunked:
                    await self._write(request, b"%x\r\n%b\r\n" % (len(data), data))
                else:
                    await self._write(request, conn.send(h11.Data(data=data)))

            gate = StreamGate(write_data, self.config.sse_ping_interval if sse else math.inf)
            self._stream_gate = gate  # the watchdog starts its pings (check_deadlines)
            try:
                ok = await pump(request, response.chunks, gate, sse)
            except ClientGone:
                ok = False
            finally:
                self._stream_gate = None
        if not ok:
            self._graceful = False  # an unterminated chunked body tells the client it is cut
            return False
        await self._write(request, fastpath.LAST_CHUNK if fast else conn.send(h11.EndOfMessage()))
        return True

    async def _upgrade(self, request: Request, response: WebSocketResponse) -> bool:
        from . import websocket

        self._replay()
        problem = websocket.handshake_problem(request)
        if problem is not None:
            await self._send_whole(request, wire.error_response(problem))
            return True
        self._upgraded = True  # the WebSocket takes over the socket's read side
        if self._watching:
            await self._stop_watching()
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
            self._set_body_deadline()

    async def _send_error(self, status: int, message: str) -> None:
        if not self._live:
            self._go_live()  # a partial head h11 has not seen: h11 writes the error
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
            raise ClientGone from None
        finally:
            self._send_since = None


def _is_chunked(head: bytes) -> bool:
    """Whether h11 framed the body of the response ``head`` as chunked."""
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"transfer-encoding":
            return value.strip().lower() == b"chunked"
    return False
