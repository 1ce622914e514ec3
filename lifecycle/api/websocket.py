"""WebSocket streaming, ``GET /v1/stream``: many concurrent generations on one socket.

The message protocol is in ``specs/websocket.md``. Each ``generate`` message runs through
the same ``Frontend`` path as ``POST /generate``, in a task of the socket's session task
group, inside its own cancel scope: ``cancel`` cancels that scope, and the call's close
aborts what the worker holds; the socket closing cancels the session group and so every
generation. Every generate id gets exactly one terminal message, ``done`` or ``error``.

Backpressure: all messages go through the transport's ``WebSocket.send``, which blocks
while the client's socket is full (up to ``send_timeout``, then the session ends
``client_stalled``). A blocked generation does not drain its output buffers, which are
bounded by ``max_new_tokens``; the next delta then carries everything since the last
one. So a slow reader slows only its own streams, and what the server holds for one
socket is bounded by ``max_streams`` x the output bound of each.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import anyio
import cbor2
import orjson

from lifecycle.api.auth import owner
from lifecycle.api.native import NativeAPI
from lifecycle.api.openai import OpenAIAPI
from lifecycle.core.call import GenerateCall, reject
from lifecycle.core.errors import RequestError, ServeError
from lifecycle.core.params import GenerateRequest, parse_generate
from lifecycle.core.results import chunks, is_multi
from lifecycle.core.states import Cause
from lifecycle.faces.openai_errors import OpenAIError
from transport import Request, Response, Router, WebSocket, WebSocketClosed, WebSocketResponse
from transport.websocket import handshake_problem

__all__ = [
    "CBOR_SUBPROTOCOL",
    "JSON_SUBPROTOCOL",
    "WS_PATH",
    "MessageCodec",
    "StreamConfig",
    "StreamSession",
    "WebSocketAPI",
]

log = logging.getLogger("lifecycle.ws")

WS_PATH = "/v1/stream"
JSON_SUBPROTOCOL = "lifecycle.json"
CBOR_SUBPROTOCOL = "lifecycle.cbor"
# Body fields that only make sense on HTTP: every WebSocket generation streams deltas.
_HTTP_ONLY_FIELDS = ("stream", "incremental_streaming_output")


@dataclass(frozen=True, slots=True)
class StreamConfig:
    max_streams: int = 64  # live generations per socket; beyond: an overloaded error


class MessageCodec:
    """JSON text messages, or CBOR binary messages (RFC 8949) when the client asked."""

    __slots__ = ("binary",)

    def __init__(self, binary: bool) -> None:
        self.binary = binary

    def encode(self, obj: Any) -> str | bytes:
        return cbor2.dumps(obj) if self.binary else orjson.dumps(obj).decode()

    def decode(self, message: str | bytes) -> Any:
        """Raises ValueError on a message that does not parse."""
        if isinstance(message, bytes) and self.binary:
            try:
                return cbor2.loads(message)
            except (cbor2.CBORDecodeError, RecursionError) as exc:
                raise ValueError(f"message is not valid CBOR: {exc}") from None
        try:
            return orjson.loads(message)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"message is not valid JSON: {exc}") from None


def choose_codec(request: Request) -> tuple[MessageCodec, str | None]:
    """The message format and the subprotocol to confirm (RFC 6455 section 4.2.2)."""
    offered = [p.strip() for p in (request.headers.get("sec-websocket-protocol") or "").split(",")]
    if CBOR_SUBPROTOCOL in offered:
        return MessageCodec(True), CBOR_SUBPROTOCOL
    if JSON_SUBPROTOCOL in offered:
        return MessageCodec(False), JSON_SUBPROTOCOL
    fmt = request.query().get("format", ["json"])[-1].lower()
    return MessageCodec(fmt == "cbor"), None


def _error(mid: Any, cause: Cause, message: str, status: int | None = None) -> dict[str, Any]:
    """An error message; ``status``: the HTTP status the same request would get, when not
    its cause's (a 404 for a model the server does not have)."""
    body = cause.body(message)
    if status is not None:
        body["error"]["code"] = status
    return {"type": "error", "id": mid, **body}


class WebSocketAPI:
    def __init__(
        self,
        native: NativeAPI,
        config: StreamConfig = StreamConfig(),
        openai: OpenAIAPI | None = None,  # enables `completions` and `chat` messages
    ) -> None:
        self.native = native
        self.config = config
        self.openai = openai

    def install(self, router: Router) -> None:
        router.add("GET", WS_PATH, self.upgrade)

    async def upgrade(self, request: Request) -> Response:
        problem = handshake_problem(request)
        if problem is not None:  # answered here, so the metrics see the 426/400
            raise problem
        codec, subprotocol = choose_codec(request)

        async def session(ws: WebSocket) -> None:
            await StreamSession(self, ws, codec).run()

        return WebSocketResponse(session, subprotocol)


class StreamSession:
    """One socket: reads messages, owns the task of every generation it started."""

    def __init__(self, api: WebSocketAPI, ws: WebSocket, codec: MessageCodec) -> None:
        self.api = api
        self.native = api.native
        self.openai = api.openai
        self.ws = ws
        self.codec = codec
        self.live: dict[Any, anyio.CancelScope] = {}
        self._tg: anyio.abc.TaskGroup | None = None

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            self._tg = tg
            try:
                while True:
                    await self._on_message(await self.ws.receive())
            except WebSocketClosed:
                pass
            finally:
                tg.cancel_scope.cancel()  # the socket is gone: end every generation on it

    async def send(self, obj: dict[str, Any]) -> None:
        await self.ws.send(self.codec.encode(obj))

    # -- incoming --------------------------------------------------------------------------
    async def _on_message(self, message: str | bytes) -> None:
        try:
            msg = self.codec.decode(message)
        except ValueError as exc:
            await self.send(_error(None, Cause.INVALID, str(exc)))
            return
        if not isinstance(msg, dict):
            await self.send(_error(None, Cause.INVALID, "a message must be an object"))
            return
        mid, kind = msg.get("id"), msg.get("type")
        if isinstance(mid, bool) or not isinstance(mid, (str, int)):
            await self.send(_error(None, Cause.INVALID, "id must be a string or an integer"))
        elif kind in ("generate", "completions", "chat"):
            await self._start(mid, msg.get("body"), kind)
        elif kind == "cancel":
            scope = self.live.get(mid)
            if scope is not None:  # an id that already ended: nothing to do (a race, not an error)
                scope.cancel()
        else:
            await self.send(
                _error(
                    mid,
                    Cause.INVALID,
                    f"type must be 'generate', 'completions', 'chat' or 'cancel', got {kind!r}",
                )
            )

    async def _start(self, mid: Any, body: Any, kind: str) -> None:
        if mid in self.live:
            await self.send(_error(mid, Cause.INVALID, f"id {mid!r} is already streaming"))
            return
        if len(self.live) >= self.api.config.max_streams:
            await self.send(
                _error(
                    mid,
                    Cause.OVERLOADED,
                    f"at most {self.api.config.max_streams} concurrent generations per socket",
                )  # fmt: skip
            )
            return
        if not isinstance(body, dict):
            await self.send(_error(mid, Cause.INVALID, "body must be an object"))
            return
        scope = self.live[mid] = anyio.CancelScope()
        assert self._tg is not None
        self._tg.start_soon(self._generation, mid, body, kind, scope)

    # -- one generation --------------------------------------------------------------------
    async def _generation(
        self, mid: Any, body: dict[str, Any], kind: str, scope: anyio.CancelScope
    ) -> None:
        try:
            final = await self._generate(mid, body, kind, scope)
            self._forget(mid, scope)  # before the terminal message: the id may be reused
            await self.send(final)
        except WebSocketClosed:
            assert self._tg is not None
            self._tg.cancel_scope.cancel()  # stalled or lost: the whole session ends
        finally:
            self._forget(mid, scope)

    def _forget(self, mid: Any, scope: anyio.CancelScope) -> None:
        # Only our own entry: once the terminal message is out, the id may be live again.
        if self.live.get(mid) is scope:
            del self.live[mid]

    async def _request(self, body: dict[str, Any], kind: str) -> GenerateRequest:
        """The native request for a ``generate`` (native body) or ``completions``/``chat``
        (OpenAI body) message; raises RequestError."""
        if kind == "generate":
            self._check_model(body.get("model"))
            body = {k: v for k, v in body.items() if k not in _HTTP_ONLY_FIELDS}
            return parse_generate(body, vocab_size=self.native.fe.model_config.vocab_size)
        if self.openai is None:
            raise RequestError(f"'{kind}' messages need the OpenAI API, which is not installed")
        body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        try:
            return await self.openai.native_request(kind, body)
        except OpenAIError as exc:
            raise RequestError(exc.message, exc.status) from None

    def _check_model(self, name: Any) -> None:
        """A ``generate`` message's ``model``, when it names one, must be the socket's
        (its ``?model=``) under a strict model name (several models served): another is
        the 404 the same request gets over HTTP, never another model's tokens."""
        api = self.openai
        if api is None or not api.strict_model or not isinstance(name, str):
            return
        if name not in api.model_names:
            raise RequestError(f"The model `{name}` does not exist.", 404)

    async def _generate(
        self, mid: Any, body: dict[str, Any], kind: str, scope: anyio.CancelScope
    ) -> dict[str, Any]:
        """Run one generation; returns its terminal message."""
        fe = self.native.fe
        try:
            req = await self._request(body, kind)
        except RequestError as exc:  # refused before its call: still traced and counted
            reject(fe, Cause.INVALID, exc.message, exc.status)
            return _error(mid, Cause.INVALID, exc.message, exc.status)

        def gone() -> tuple[Cause, str]:  # a cancel message, or the socket's end
            if scope.cancel_called:
                return Cause.ABORTED, "cancelled by the client"
            return self._gone()

        # owned by the key the socket opened with
        async with fe.call(req, gone, owner=owner(self.ws.request)) as call:
            with scope:
                try:
                    await call.start()
                except RequestError as exc:
                    return _error(mid, Cause.INVALID, exc.message)
                except ServeError as exc:
                    return _error(mid, exc.cause, exc.message)
                return await self._pump(mid, call)
            # Only a cancel message gets here (the session's own cancellation propagates);
            # leaving the scope ends the call as cancelled.
            return _error(mid, Cause.ABORTED, "cancelled by the client")

    async def _pump(self, mid: Any, call: GenerateCall) -> dict[str, Any]:
        async for frame in chunks(call, incremental=True):
            await self.send({"type": "delta", "id": mid, **frame})
        err = call.error()
        if err is not None:
            cause, message = err
            return _error(mid, cause, message)
        metas = [s.meta(call.e2e()) for s in call.samples()]
        return {"type": "done", "id": mid, "meta_info": metas if is_multi(call) else metas[0]}

    def _gone(self) -> tuple[Cause, str]:
        reason = self.ws.request.disconnect_reason
        if reason == "send_stall":
            return Cause.CLIENT_STALLED, "the client stopped reading"
        if reason == "shutdown":
            return Cause.SHUTTING_DOWN, "server shutdown"
        return Cause.CLIENT_GONE, "the WebSocket closed"
