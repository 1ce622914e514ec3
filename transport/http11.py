"""One HTTP/1.1 connection: a sans-IO core (the fast path, else h11) driven by one task.

``HTTPConnection`` owns the connection's task group and its lifetime: it reads each
request (``reader.RequestReader``), runs the handler and writes the response
(``respond.ResponseWriter``) from its own task, so a plain request costs no task switch,
and decides after each response whether the connection goes on. Both halves share one
``channel.Channel``: the socket, h11's state and the fast path's buffer. The deadlines of
every read and write are plain numbers that a watchdog checks (``watch_deadlines``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable

import anyio
import anyio.abc

from . import http_util
from .channel import App, Channel, ClientGone, ServerState
from .config import ServerConfig
from .reader import Failure, RequestReader
from .respond import ResponseWriter

__all__ = ["HTTPConnection", "watch_deadlines"]

_REFUSE_SECONDS = 0.5  # at shutdown, for the 503 to a request that got no answer


class _Idle:
    draining = False
    retry_after = 1


class HTTPConnection:
    """One accepted connection, from the first request to the close.

    ``run()`` serves it to the end; a server calls ``begin_drain()`` and ``abort()``
    during shutdown and ``check_deadlines()`` from its watchdog. Without a server (a
    test, or an app handing over its own streams) the connection watches its own
    deadlines.
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
        self.config = config
        self.client = client
        self.server: ServerState = server or _Idle()
        self.channel = Channel(stream, config, client, self.server)
        self.reader = RequestReader(self.channel)
        self.writer = ResponseWriter(self.channel, app, self.reader.hand_over)
        self.idle = True  # no request in flight: shutdown may close this connection at once
        self.scope = anyio.CancelScope()
        self._tg: anyio.abc.TaskGroup | None = None
        self._refuse_unanswered = False  # shutdown: answer the request in flight 503 first

    async def run(self) -> None:
        with self.scope:
            try:
                async with anyio.create_task_group() as tg:
                    self._tg = self.reader.tasks = tg
                    if isinstance(self.server, _Idle):  # no server watchdog: bring our own
                        tg.start_soon(watch_deadlines, [self], self.config)
                    try:
                        await self._serve()
                    except ClientGone:
                        self.channel.graceful = False
                    finally:
                        tg.cancel_scope.cancel()
            finally:
                self._tg = self.reader.tasks = None
                if not self.scope.cancel_called and http_util.cancelled():
                    # The scope around the server was cancelled: stop at once, no linger.
                    self.channel.graceful = self._refuse_unanswered = False
                with anyio.CancelScope(shield=True):
                    if self._refuse_unanswered:
                        await self._refuse()
                    await http_util.close_stream(self.stream, graceful=self.channel.graceful)

    async def _refuse(self) -> None:
        with anyio.move_on_after(_REFUSE_SECONDS):
            try:
                if await self.writer.refuse_unanswered(self.server.retry_after):
                    self.channel.graceful = True  # FIN after the 503, so the client reads it
            except ClientGone:
                pass

    def begin_drain(self) -> None:
        """The server is draining. An idle connection stays open ``drain_idle_timeout``
        at most, then closes with a FIN: closing at once would lose a request already on
        its way, which instead gets 503 + ``Connection: close``. A request partly received
        (a slow upload, a pipelined one) is read and answered 503; the request in flight
        runs on, and its answer closes the connection unless another one is waiting."""
        self.reader.begin_drain()

    def go_away(self) -> None:
        """Shutdown: a WebSocket on this connection ends its session and closes 1001."""
        if self.writer.websocket is not None:
            self.writer.websocket.go_away()

    def abort(self, reason: str) -> None:
        """Cancel this connection now (shutdown deadline): the in-flight request learns why."""
        channel = self.channel
        if channel.current is not None:
            channel.current.mark_disconnected(reason)
        # Idle with nothing received: a FIN; a reset would only tell a client reading
        # nothing that it was cut.
        channel.graceful = self.idle and not channel.has_pending()
        self._refuse_unanswered = reason == "shutdown"
        self.scope.cancel()

    async def _serve(self) -> None:
        reader, writer = self.reader, self.writer
        while (item := await reader.next_request()) is not None:
            self.idle = False
            if isinstance(item, Failure):
                await writer.send_error(item.status, item.message)
                return
            if self.server.draining:  # new work the app has not seen: refused, not dropped
                keep_alive = await writer.refuse_draining(item, self.server.retry_after)
            else:
                keep_alive = await writer.respond(item)
            self.channel.current = None
            # A drain's answer says Connection: close unless another request is already
            # here, and next_cycle ends the connection after one that said it. One whose
            # head went out before the drain did not: the connection waits, briefly, for
            # a request the client may have sent meanwhile, and refuses it.
            if not keep_alive or not reader.next_cycle():
                return
            self.idle = True

    def check_deadlines(self, now: float) -> None:
        """Enforce the read and send deadlines; called a few times per timeout period.

        Deadlines are plain numbers checked by a watchdog rather than a timer per read and
        per write: arming and cancelling two timers per request costs more than the rest
        of the transport's own work.
        """
        self.reader.check_deadline(now)
        channel = self.channel
        if channel.send_stalled(now):
            if channel.current is not None:
                channel.current.mark_disconnected("send_stall")
            # A client that reads nothing cannot be sent an error event: a reset makes
            # its next read fail rather than end like a slow stream (docs/transport.md).
            channel.abort_on_close()
            self.scope.cancel()
        gate = self.writer.stream_gate
        if gate is not None and self._tg is not None and gate.ping_due(now):
            self._tg.start_soon(gate.ping)


def watchdog_interval(config: ServerConfig, draining: bool = False) -> float:
    shortest = min(
        config.header_timeout,
        config.body_timeout,
        config.keepalive_timeout,
        config.drain_idle_timeout if draining else math.inf,
        config.send_timeout,
        config.sse_ping_interval,  # a ping is due within a quarter interval of its time
    )
    return min(1.0, max(0.005, shortest / 4))


async def watch_deadlines(
    connections: Iterable[HTTPConnection],
    config: ServerConfig,
    server: ServerState | None = None,
) -> None:
    """Check every connection's deadlines, forever: a timeout fires within a quarter of
    the shortest configured timeout (at most a second) of its due time; while ``server``
    drains, ``drain_idle_timeout`` counts too."""
    interval = watchdog_interval(config)
    draining = watchdog_interval(config, draining=True)
    while True:
        await anyio.sleep(draining if server is not None and server.draining else interval)
        now = time.monotonic()
        for conn in list(connections):
            conn.check_deadlines(now)
