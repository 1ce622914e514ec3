"""The writing half of an HTTP/1.1 connection: the handler call, responses, upgrades.

``ResponseWriter`` runs the handler (or lets it send its own response from inside, with
``Request.respond``) and writes what it returns: a whole body, a chunked stream, SSE, or
the 101 that hands the socket to a WebSocket. A response the fast path can frame skips
h11; anything else is written by h11, after it has replayed the request. Every write
goes through ``Channel.write``, bounded by ``send_timeout`` through the connection's
watchdog.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import h11

from . import fastpath, http_util
from .channel import App, Channel, ClientGone
from .errors import HTTPError
from .request import Headers, Request
from .responses import Response, SSEResponse, StreamResponse, WebSocketResponse
from .streaming import StreamGate, discard, pump

if TYPE_CHECKING:
    from .websocket import WebSocket

__all__ = ["ResponseWriter"]

log = logging.getLogger("transport")

SHUTTING_DOWN = "Server shutting down; retry elsewhere"  # every drain 503's message


class ResponseWriter:
    """Writes one connection's responses.

    ``hand_over`` stops the connection's reading for good, before a WebSocket takes the
    socket; ``stream_gate`` is the streamed body being written, if any, whose pings the
    watchdog starts.
    """

    def __init__(
        self, channel: Channel, app: App, hand_over: Callable[[], Awaitable[None]]
    ) -> None:
        self.ch = channel
        self.config = channel.config
        self.app = app
        self._hand_over = hand_over
        self.stream_gate: StreamGate | None = None
        self.answering: Request | None = None  # the request whose response has begun
        self.websocket: WebSocket | None = None  # the session this socket runs

    async def respond(self, request: Request) -> bool:
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
            response = http_util.error_response(exc)
        except ClientGone:
            raise
        except Exception:
            log.exception("unhandled error in handler for %s %s", request.method, request.path)
            response = http_util.error_response(HTTPError(500, "Internal Server Error"))
        finally:
            request._responder = None
        if request.responded is not None:  # the handler sent it (or began to) itself
            return bool(sent and sent[0])
        return await self._send_response(request, response)

    async def send_error(self, status: int, message: str) -> None:
        """Answer a request that could not be parsed; the connection closes after."""
        ch = self.ch
        if not ch.live:
            ch.go_live()  # a partial head h11 has not seen: h11 writes the error
        if ch.h11.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        response = http_util.error_response(HTTPError(status, message))
        response.headers.append(("connection", "close"))
        request = Request("GET", "/", Headers([]), ch.client)
        self.answering = ch.current
        await self._send_whole(request, response)

    async def refuse_draining(self, request: Request, retry_after: int) -> bool:
        """Draining: answer a request the app has not seen 503 + Retry-After (RFC 9110
        section 15.6.4), once its body is in: a client writes its whole body before it
        reads, so an answer while it still uploads, then a close, reaches it as a broken
        pipe. ``Connection: close`` unless another request is already here (each pipelined
        one gets its own answer, the last says close). False when the connection must
        close."""
        ch = self.ch
        if not (ch.live and ch.h11.they_are_waiting_for_100_continue):  # else: no body
            try:
                async for _ in request.stream():
                    pass
            except HTTPError:  # timed out, too large, malformed: the 503 then says close
                pass
        headers = [("retry-after", str(retry_after))]
        response = http_util.error_response(HTTPError(503, SHUTTING_DOWN, headers))
        return await self._send_response(request, response)

    async def refuse_unanswered(self, retry_after: int) -> bool:
        """Answer 503 + Retry-After + Connection: close to a request that got no byte of
        a response (shutdown cut it: its handler still running, its body or head still
        arriving), so the client learns it was not served and may retry, instead of a
        reset. True when it was answered."""
        ch = self.ch
        request = ch.current
        if request is None:  # a head or a fast request's body still arriving
            if not ch.has_pending():
                return False
            request = Request("GET", "/", Headers([]), ch.client)
            if not ch.live:
                ch.go_live()
        elif self.answering is request:
            return False
        elif not ch.live:
            ch.replay()
        # h11 lets a server answer before a request is whole (IDLE), as for a 408.
        if ch.h11.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return False
        headers = [("retry-after", str(retry_after)), ("connection", "close")]
        response = http_util.error_response(HTTPError(503, SHUTTING_DOWN, headers))
        self.answering = request
        data = self._h11_whole(request, response)
        if data is None:
            return False
        await ch.write(request, data)
        return True

    def _opened(self, ws: WebSocket) -> None:
        self.websocket = ws

    async def _send_response(self, request: Request, response: Response) -> bool:
        self.answering = request
        if request.is_disconnected():
            self.ch.graceful = False
            return False
        try:
            if isinstance(response, WebSocketResponse):
                return await self._upgrade(request, response)
            if isinstance(response, StreamResponse):
                return await self._send_stream(request, response)
            await self._send_whole(request, response)
        except ClientGone:
            self.ch.graceful = False
            return False
        return True

    # ------------------------------------------------------------ whole bodies
    async def _send_whole(self, request: Request, response: Response) -> None:
        ch = self.ch
        if not ch.live:  # a fast request: answer without h11 when the response allows
            data = self._fast_whole(request, response)
            if data is not None:
                await ch.write(request, data)
                return
            ch.replay()
        data = self._h11_whole(request, response)
        if data is not None:
            await ch.write(request, data)

    def _fast_whole(self, request: Request, response: Response) -> bytes | None:
        """The whole response as the fast path frames it; None where only h11 can."""
        ch = self.ch
        closing = ch.close_after or self._draining_close()
        data = fastpath.encode_response(
            response.status,
            http_util.reason(response.status),
            http_util.preamble(self.config.server_header),
            _headers(request, response),
            response.body,
            request.method == "HEAD",
            closing,
        )
        if data is not None:
            ch.close_after = closing
        return data

    def _h11_whole(self, request: Request, response: Response) -> bytes | None:
        """The whole response as h11 frames it; None (and a reset) if h11 refuses it."""
        ch = self.ch
        conn = ch.h11
        body = response.body
        headers = http_util.response_headers(
            _headers(request, response), self.config, self._closing()
        )
        bodiless = response.status < 200 or response.status in (204, 304)
        if not bodiless:
            headers.append((b"content-length", str(len(body)).encode()))
        try:
            data = conn.send(
                h11.Response(
                    status_code=response.status,
                    headers=headers,
                    reason=http_util.reason(response.status),
                )
            )
            if body and not bodiless and request.method != "HEAD":
                data += conn.send(h11.Data(data=body))
            data += conn.send(h11.EndOfMessage())
        except h11.LocalProtocolError:
            log.exception("invalid response from handler for %s %s", request.method, request.path)
            ch.graceful = False
            return None
        return data

    def _closing(self) -> bool:
        """Whether an h11 response must say ``Connection: close``: when draining, or when
        the request's body is not all in (it timed out, failed, or was left unread), since
        the connection then cannot carry another request (RFC 9112 section 9.6)."""
        return self._draining_close() or self.ch.h11.their_state is h11.SEND_BODY

    def _draining_close(self) -> bool:
        """Draining: close after this response, unless the client has already pipelined
        another request, which is then answered too (the app refuses what it will not
        serve) rather than dropped unanswered; the last answer says close."""
        return self.ch.server.draining and not self.ch.has_pending()

    # ----------------------------------------------------------------- streams
    async def _send_stream(self, request: Request, response: StreamResponse) -> bool:
        ch = self.ch
        head, fast = self._stream_head(request, response)
        try:
            await ch.write(request, head)
        except ClientGone:
            await discard(response.chunks)
            raise
        if request.method == "HEAD":
            await discard(response.chunks)
            ok = True
        else:
            ok = await self._stream_body(request, response, fast or _is_chunked(head))
        if not ok:
            ch.graceful = False  # an unterminated chunked body tells the client it is cut
            return False
        await ch.write(request, fastpath.LAST_CHUNK if fast else ch.h11.send(h11.EndOfMessage()))
        return True

    def _stream_head(self, request: Request, response: StreamResponse) -> tuple[bytes, bool]:
        """The stream's response head, and whether the fast path framed it (h11 not needed)."""
        ch = self.ch
        reason = http_util.reason(response.status)
        if not ch.live and request.method != "HEAD":
            closing = ch.close_after or self._draining_close()
            preamble = http_util.preamble(self.config.server_header)
            head = fastpath.encode_stream_head(
                response.status, reason, preamble, _headers(request, response), closing
            )
            if head is not None:
                ch.close_after = closing
                return head, True
        ch.replay()
        headers = http_util.response_headers(
            _headers(request, response), self.config, self._closing()
        )
        head = ch.h11.send(
            h11.Response(status_code=response.status, headers=headers, reason=reason)
        )
        return head, False

    async def _stream_body(self, request: Request, response: StreamResponse, chunked: bool) -> bool:
        """Write the stream's items as they come; False when it ended early."""
        ch = self.ch
        conn = ch.h11
        sse = isinstance(response, SSEResponse)

        async def write_data(data: bytes) -> None:
            # h11 keeps no state for a chunk of a chunked body: frame it here (what
            # its ChunkedWriter writes) and save its event machinery per chunk.
            if not data:  # an empty chunk would end the body
                return
            if chunked:
                await ch.write(request, b"%x\r\n%b\r\n" % (len(data), data))
            else:
                await ch.write(request, conn.send(h11.Data(data=data)))

        def try_write_data(data: bytes) -> bool:
            # chunked only: h11's own framing changes its state, so it goes through write
            if not data:
                return True
            return chunked and ch.try_write(request, b"%x\r\n%b\r\n" % (len(data), data))

        gate = StreamGate(
            write_data, self.config.sse_ping_interval if sse else math.inf, try_write_data,
            (lambda: ch.can_write_now()) if chunked else None,
        )  # fmt: skip
        self.stream_gate = gate  # the watchdog starts its pings (check_deadlines)
        try:
            return await pump(request, response.chunks, gate, sse)
        except ClientGone:
            return False
        finally:
            self.stream_gate = None

    # ---------------------------------------------------------------- upgrades
    async def _upgrade(self, request: Request, response: WebSocketResponse) -> bool:
        from . import websocket

        ch = self.ch
        ch.replay()
        problem = websocket.handshake_problem(request)
        if problem is not None:
            await self._send_whole(request, http_util.error_response(problem))
            return True
        await self._hand_over()  # the WebSocket takes over the socket's read side
        accept = websocket.accept_headers(request, response.subprotocol, self.config)
        accept += [
            (k.encode("latin-1"), v.encode("latin-1")) for k, v in request.response_headers or ()
        ]
        await ch.write(
            request,
            ch.h11.send(
                h11.InformationalResponse(
                    status_code=101, headers=accept, reason=b"Switching Protocols"
                )
            ),
        )
        trailing = ch.h11.trailing_data[0]
        await websocket.run_session(
            ch.stream, request, response.session, self.config, trailing, self._opened
        )
        return False


def _headers(request: Request, response: Response) -> list[tuple[str, str]]:
    """The response's headers plus the request's extra ``response_headers`` (a new list:
    a response object may be shared by several requests)."""
    extra = request.response_headers
    return response.headers if not extra else [*response.headers, *extra]


def _is_chunked(head: bytes) -> bool:
    """Whether h11 framed the body of the response ``head`` as chunked."""
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"transfer-encoding":
            return value.strip().lower() == b"chunked"
    return False
