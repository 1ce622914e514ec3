"""Listeners, the connection limit, and graceful drain: the part that owns every task."""

from __future__ import annotations

import importlib.util
import logging
import os
import resource
import signal
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.abc
from anyio.abc import SocketAttribute
from anyio.streams.tls import TLSListener

from . import http_util
from .aio import wrap_listener
from .config import ServerConfig
from .errors import error_body
from .http11 import HTTPConnection, watch_deadlines
from .request import Request
from .respond import SHUTTING_DOWN
from .responses import Response

__all__ = ["Server", "run", "serve"]

log = logging.getLogger("transport")

Handler = Callable[[Request], Awaitable[Response]]
DEFAULT_CONFIG = ServerConfig()  # frozen, so one shared default is safe
_DEFAULT_RETRY_AFTER = 1  # seconds; an app's begin_drain(retry_after=) replaces it
_REJECT_READ_SECONDS = 0.5  # read the refused client's request head before answering 503


class _QuietTLSListener(TLSListener):
    @staticmethod
    async def handle_handshake_error(exc: BaseException, stream: anyio.abc.AnyByteStream) -> None:
        # Scanners and impatient clients fail handshakes all day; that is not our error.
        log.debug("TLS handshake failed: %r", exc)
        await anyio.aclose_forcefully(stream)
        if not isinstance(exc, Exception):
            raise exc


class Server:
    """An HTTP/1.1 + WebSocket server whose tasks live in the caller's task tree.

    ``await server.serve(task_status=...)`` binds, reports the bound addresses through
    ``task_status.started`` and serves until ``await server.shutdown()`` (graceful: a
    drain, as below, in-flight responses finish up to ``shutdown_timeout``, then the rest
    is cancelled and the listener closes) or until the enclosing scope is cancelled
    (immediate: no linger on any close). ``begin_drain()`` first
    lets an app finish its own work while the listener still answers: every request the
    app has not seen yet gets 503 with Retry-After (on a new connection, or on a
    keep-alive one, which waits ``drain_idle_timeout`` for it), and every answer from then
    on closes its connection unless another request is already waiting behind it.
    """

    def __init__(self, app: Handler, config: ServerConfig = DEFAULT_CONFIG) -> None:
        self.app = app
        self.config = config
        self.bound: list[tuple[str, int]] | str = []
        self.draining = False
        self._connections: set[HTTPConnection] = set()
        self._serving = False
        self._listener_closed = False
        self._stop = anyio.Event()
        self._all_closed = anyio.Event()
        self._stopped = anyio.Event()
        self._shutdown_timeout = config.shutdown_timeout
        self.retry_after = _DEFAULT_RETRY_AFTER  # seconds, on every drain/overload 503 here

    @property
    def connection_count(self) -> int:
        return len(self._connections)

    async def serve(
        self, *, task_status: anyio.abc.TaskStatus[Any] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        _fit_open_file_limit(self.config.max_connections)
        listener = await self._open_listener()
        self._serving = True
        try:
            async with anyio.create_task_group() as connections:
                watchdog, accepting = anyio.CancelScope(), anyio.CancelScope()
                connections.start_soon(self._watch, watchdog)
                connections.start_soon(self._accept, listener, connections, accepting)
                task_status.started(self.bound)
                await self._stop.wait()
                # Still accepting meanwhile: a client that connects now gets its 503, not
                # a wait in the backlog and then a reset when the listener closes.
                await self._drain()
                accepting.cancel()
                watchdog.cancel()
        finally:
            await self._close(listener)
            self._stopped.set()

    def begin_drain(self, retry_after: int | None = None) -> None:
        """Refuse new work (503 + Retry-After + ``Connection: close``): new connections,
        and requests the app has not seen (the next one on an idle keep-alive connection,
        pipelined ones, one still uploading). In-flight responses go on, and their
        connections close when they end. ``retry_after``: the app's one Retry-After for
        its own drain 503s, so a client sees one value."""
        self.draining = True
        if retry_after is not None:
            self.retry_after = retry_after
        for conn in list(self._connections):
            conn.begin_drain()

    async def shutdown(self, timeout: float | None = None) -> None:
        """Drain as ``begin_drain`` does, let in-flight responses finish for ``timeout``
        seconds (default ``shutdown_timeout``), cancel what is left, close the listener
        (it refuses new connections with 503 until then), and return once serve() has
        ended."""
        self.draining = True
        if timeout is not None:
            self._shutdown_timeout = timeout
        self._stop.set()
        if self._serving:
            await self._stopped.wait()

    async def _watch(self, scope: anyio.CancelScope) -> None:
        with scope:
            await watch_deadlines(self._connections, self.config, self)

    async def _accept(
        self,
        listener: anyio.abc.Listener[Any],
        connections: anyio.abc.TaskGroup,
        scope: anyio.CancelScope,
    ) -> None:
        try:
            with scope:
                await listener.serve(self._handle, task_group=connections)
        finally:  # at once: a connect from now on is refused, not left in the backlog
            await self._close(listener)  # to be reset when the listener closes

    async def _close(self, listener: anyio.abc.Listener[Any]) -> None:
        """Close the listener, once (the accept loop's end, or serve()'s)."""
        if not self._listener_closed:
            self._listener_closed = True
            with anyio.CancelScope(shield=True):
                await listener.aclose()
                if self.config.uds is not None:
                    _unlink(self.config.uds)

    async def _drain(self) -> None:
        """Idle connections close after ``drain_idle_timeout`` (or on their answer to a
        request that came meanwhile); responses in flight get the first half of the
        shutdown timeout to end, and WebSocket sessions to send what they still have
        (a cut generation's error); then each WebSocket closes 1001 (``go_away``), and
        what is left at the end of the second half is aborted."""
        self.draining = True
        for conn in list(self._connections):
            conn.begin_drain()
        half = self._shutdown_timeout / 2
        for step in (lambda conn: conn.go_away(), lambda conn: conn.abort("shutdown")):
            if self._connections:
                with anyio.move_on_after(half):
                    await self._all_closed.wait()
            for conn in list(self._connections):
                step(conn)

    async def _open_listener(self) -> anyio.abc.Listener[Any]:
        cfg = self.config
        listener: anyio.abc.Listener[Any]
        if cfg.uds is not None:
            _unlink(cfg.uds)
            unix = await anyio.create_unix_listener(cfg.uds, backlog=cfg.backlog)
            self.bound = cfg.uds
            listener = unix
        else:
            tcp = await anyio.create_tcp_listener(
                local_host=cfg.host, local_port=cfg.port, backlog=cfg.backlog,
                reuse_port=cfg.reuse_port,
            )  # fmt: skip
            self.bound = [
                tuple(sub.extra(SocketAttribute.local_address))[:2]  # type: ignore[misc]
                for sub in tcp.listeners
            ]
            listener = tcp
        listener = wrap_listener(listener)
        if cfg.ssl_certfile is not None:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(cfg.ssl_certfile, cfg.ssl_keyfile)
            context.set_alpn_protocols(["http/1.1"])
            listener = _QuietTLSListener(
                listener, context, standard_compatible=False, handshake_timeout=cfg.header_timeout
            )
        return listener

    async def _handle(self, stream: anyio.abc.ByteStream) -> None:
        if self.draining:
            await _reject(stream, _SHUTTING_DOWN_BODY, self.retry_after)
            return
        if len(self._connections) >= self.config.max_connections:
            await _reject(stream, _OVERLOADED_BODY, _DEFAULT_RETRY_AFTER)
            return
        conn = HTTPConnection(stream, self.app, self.config, _client(stream), self)
        self._connections.add(conn)
        try:
            await conn.run()
        except Exception:
            log.exception("connection from %s failed", conn.client)
        finally:
            self._connections.discard(conn)
            if self.draining and not self._connections:
                self._all_closed.set()


def _fit_open_file_limit(max_connections: int) -> None:
    """Raise the soft RLIMIT_NOFILE (within the hard one) so the connection limit, not
    accept() failing with EMFILE, is what refuses clients."""
    want = max_connections + 256  # listeners, the worker socket, logs, files
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < want:
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        if target > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def _client(stream: anyio.abc.ByteStream) -> tuple[str, int] | None:
    address = stream.extra(SocketAttribute.remote_address, None)
    if isinstance(address, tuple) and len(address) >= 2:
        return (str(address[0]), int(address[1]))
    return None


_OVERLOADED_BODY = error_body("Server overloaded: too many connections")
_SHUTTING_DOWN_BODY = error_body(SHUTTING_DOWN)


async def _reject(stream: anyio.abc.ByteStream, body: bytes, retry_after: int) -> None:
    """Answer 503 and close without parsing: the cheapest way to say "not now"."""
    head = (
        b"HTTP/1.1 503 Service Unavailable\r\ndate: "
        + http_util.http_date()
        + b"\r\ncontent-type: application/json\r\nretry-after: "
        + str(retry_after).encode()
        + b"\r\nconnection: close\r\n"
        + b"content-length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
    )
    answered = False
    try:
        with anyio.move_on_after(_REJECT_READ_SECONDS):
            await stream.receive(65536)
        with anyio.fail_after(_REJECT_READ_SECONDS):
            await stream.send(head + body)
        answered = True
    except (
        anyio.EndOfStream,
        anyio.BrokenResourceError,
        anyio.ClosedResourceError,
        OSError,
        TimeoutError,
    ):
        pass
    finally:
        graceful = answered and not http_util.cancelled()
        with anyio.CancelScope(shield=True):
            await http_util.close_stream(stream, graceful=graceful)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


async def serve(
    app: Handler,
    config: ServerConfig = DEFAULT_CONFIG,
    *,
    task_status: anyio.abc.TaskStatus[Any] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` until cancelled; ``task_status.started`` receives the bound addresses."""
    await Server(app, config).serve(task_status=task_status)


def run(app: Handler, config: ServerConfig = DEFAULT_CONFIG) -> None:
    """Blocking entry point: serve ``app`` until SIGINT or SIGTERM, on asyncio (uvloop
    when it is installed). The first signal drains, as ``Server.shutdown`` does: new work
    gets 503 + Retry-After, what is in flight has ``config.shutdown_timeout`` to finish,
    and run() returns once every connection is closed. A second signal stops at once."""
    uvloop = importlib.util.find_spec("uvloop") is not None
    try:
        anyio.run(
            _serve_until_signalled, app, config,
            backend="asyncio", backend_options={"use_uvloop": uvloop},
        )  # fmt: skip
    except KeyboardInterrupt:  # Ctrl-C before the signal handlers were in place, or after
        pass


async def _serve_until_signalled(app: Handler, config: ServerConfig) -> None:
    server = Server(app, config)
    async with anyio.create_task_group() as tg:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            bound = await tg.start(server.serve)
            log.info("listening on %s", bound)
            stopping = False
            async for signum in signals:
                name = signal.Signals(signum).name
                if stopping:
                    log.warning("%s again: stopping now", name)
                    break
                stopping = True
                log.info("%s: draining, up to %.1fs", name, config.shutdown_timeout)
                tg.start_soon(_shut_down, server, tg.cancel_scope)
        tg.cancel_scope.cancel()


async def _shut_down(server: Server, scope: anyio.CancelScope) -> None:
    await server.shutdown()
    scope.cancel()
