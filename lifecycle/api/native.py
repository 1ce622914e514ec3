"""The SGLang-native HTTP API (reference/sglang.md §1.1, §4, §5): handlers on the transport.

Shapes follow SGLang: unary errors are ``{"error": {"message": ...}}`` with the status;
once stream headers are out an error is an event ``{"error": {message, type, code,
retryable}}`` followed by ``[DONE]``; a stream never ends early without one. Streams are
cumulative by default (``text``/``output_ids`` so far, as bench_serving expects) and
incremental with ``--incremental-streaming-output`` or ``"incremental_streaming_output":
true`` in the request body.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import orjson

from lifecycle.api.auth import Caller
from lifecycle.api.calls import error_response, http_call, run_unary
from lifecycle.core.call import GenerateCall, reject
from lifecycle.core.errors import RequestError, ServeError
from lifecycle.core.frontend import Frontend
from lifecycle.core.params import parse_generate
from lifecycle.core.ports import FlushesEveryWorker, ObservedLink, ObservedWorker
from lifecycle.core.results import chunks, indexed, is_multi, unary_results
from lifecycle.core.states import DRAIN, Cause
from lifecycle.faces.server_info import server_state
from transport import HTTPError, JSONResponse, Request, Response, Router, SSEResponse
from transport.aio import at_pass_end
from transport.sse import frame_event
from transport.streaming import StreamGate, current_gate
from wire.faults import active_plan, fault_point

__all__ = ["NativeAPI"]

log = logging.getLogger("lifecycle.api")

HEALTH_PROBE_TIMEOUT = 20.0
CLIENT_WRITE = "frontend.client_write"  # the fault point before each streamed event


def _serve_error(exc: ServeError) -> Response:
    return error_response(exc.cause.status, exc.message, exc.cause.retry_after)


async def _error_events(message: str, cause: Cause) -> AsyncIterator[bytes]:
    yield orjson.dumps(cause.body(message))
    yield b"[DONE]"


async def _client_write_fault(fault: Any) -> None:
    """Fault point ``frontend.client_write``: drop and corrupt both cut the connection
    (the transport ends a response whose producer fails without a clean end)."""
    if await fault.apply_async() is not None:
        raise anyio.BrokenResourceError(fault.message)


def _client_write_planned() -> bool:
    """Whether the fault plan has rules at ``frontend.client_write``: the owner's writes
    pass that point, a push's do not, so a push declines."""
    plan = active_plan()
    return plan is not None and plan.has(CLIENT_WRITE)


def _push(call: GenerateCall, gate: StreamGate, incremental: bool) -> Callable[[], bool]:
    """The stream's chunks written from the worker link's wake-up (``GenerateCall.
    set_push``), while the socket takes them at once: the same frames, JSON and SSE
    events the owner would write, without a task switch a token. It declines (the
    owner is woken) when the socket would wait, a write is in progress, or a sample's
    buffer holds its end; output it polled and does not write, it hands back."""
    multi = is_multi(call)

    def push() -> bool:
        if not gate.ready_now() or call.end_pending() or _client_write_planned():
            return False
        changed = call.poll()
        if call.done or any(s.finish is not None or s.failure is not None for _, s in changed):
            call.hand_back(changed)
            return False
        events = [frame_event(orjson.dumps(indexed(frame, index, multi)))
                  for index, _, frame in call.render(changed, incremental)]  # fmt: skip
        if events and not gate.write_nowait(b"".join(events)):
            raise RuntimeError("the gate refused a write it said it would take")
        return True

    return push


class NativeAPI:
    def __init__(self, frontend: Frontend, server_args: dict[str, Any]) -> None:
        self.fe = frontend
        self.server_args = server_args
        # The reasoning and tool-call formats in effect (the options', else the chat
        # template's; set by the OpenAI API that reads them), for /model_info.
        self.parsers: tuple[str | None, str | None] = (None, None)

    def install(self, router: Router) -> None:
        router.add(["POST", "PUT"], "/generate", self.generate)
        router.add("GET", "/health", self.health)
        router.add("GET", "/health_generate", self.health_generate)
        for path in ("/model_info", "/get_model_info"):
            router.add("GET", path, self.model_info)
        for path in ("/server_info", "/get_server_info"):
            router.add("GET", path, self.server_info)
        router.add("POST", "/abort_request", self.abort_request)
        router.add(["GET", "POST"], "/flush_cache", self.flush_cache)
        router.add("GET", "/get_load", self.get_load)
        for prefix in ("", "/v1"):
            router.add("POST", prefix + "/tokenize", self.tokenize)
            router.add("POST", prefix + "/detokenize", self.detokenize)

    # -- /generate -------------------------------------------------------------------------
    async def generate(self, request: Request) -> Response:
        body = await request.json()
        stream = isinstance(body, dict) and body.get("stream") is True
        # Ours, not SGLang's: taken out before SGLang's validation sees the body.
        per_request = body.pop("incremental_streaming_output", None) if stream else None
        try:
            req = parse_generate(body, vocab_size=self.fe.model_config.vocab_size)
        except RequestError as exc:
            if stream:  # a 200 stream: the router cannot see it was refused, so say it here
                reject(self.fe, exc.cause, exc.message)
                return SSEResponse(_error_events(exc.message, Cause.INVALID))
            return error_response(exc.status, exc.message)
        incremental = self.fe.config.incremental_streaming_output or per_request is True
        async with http_call(self.fe, req, request) as call:
            try:
                await call.start()
            except RequestError as exc:
                if req.stream:
                    return SSEResponse(_error_events(exc.message, Cause.INVALID))
                return error_response(exc.status, exc.message)
            except ServeError as exc:
                return _serve_error(exc)
            if req.stream:
                return await request.respond(SSEResponse(self._events(call, incremental)))
            return await self._unary(call, request)

    async def _unary(self, call: GenerateCall, request: Request) -> Response:
        if not await run_unary(call, request):
            return Response(b"", 499)  # nobody reads it; the scope closes the call
        err = call.error()
        if err is not None:
            cause, message = err
            return error_response(cause.status, message, cause.retry_after)
        if (f := fault_point(CLIENT_WRITE, call.runs[0].rec.id)) is not None:
            await _client_write_fault(f)
        results = unary_results(call)
        return JSONResponse(results if is_multi(call) else results[0])

    async def _events(self, call: GenerateCall, incremental: bool) -> AsyncIterator[bytes]:
        """The stream's events; owns nothing (the handler's call scope does). While the
        socket takes bytes at once, chunks are written from the worker link's wake-up
        itself (``_push``), without waking this task."""
        gate = current_gate()
        if gate is not None and call.timeout is None:
            call.set_push(_push(call, gate, incremental), at_pass_end())
        try:
            async for frame in chunks(call, incremental):
                if (f := fault_point(CLIENT_WRITE, call.runs[0].rec.id)) is not None:
                    await _client_write_fault(f)
                yield orjson.dumps(frame)
        finally:
            call.set_push(None)
        err = call.error()
        if err is not None:
            cause, message = err
            yield orjson.dumps(cause.body(message))
        yield b"[DONE]"

    # -- health ------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        if self.fe.draining:
            return error_response(DRAIN.health_status, "shutting down", DRAIN.refused.retry_after)
        sup = self.fe.supervisor
        if not sup.ready and not self.fe.model_asleep():  # asleep: its requests load it
            why = f": {sup.last_error}" if sup.last_error else ""
            return error_response(503, f"not ready ({sup.status}){why}", 5)
        return Response(b"")

    async def health_generate(self, request: Request) -> Response:
        """A real one-token generation on every ready worker (``--dp``: each of them, at
        once); 200 only when each gave its token."""
        sup = self.fe.supervisor
        try:
            self.fe.ready_client()  # ready at all, not draining
        except ServeError as exc:
            return _serve_error(exc)
        failed: list[str] = []

        async def one(i: int, member: ObservedWorker) -> None:
            try:
                ok, detail = await self.fe.probe(HEALTH_PROBE_TIMEOUT, member.client)
            except ServeError as exc:
                ok, detail = False, exc.message
            if not ok:
                failed.append(f"worker {i}: {detail}" if len(sup.members) > 1 else detail)

        async with anyio.create_task_group() as tg:
            for i, member in enumerate(sup.members):
                if member.ready and member.client is not None:
                    tg.start_soon(one, i, member)
        if failed:
            detail = "; ".join(sorted(failed))
            log.error("health probe failed: %s", detail)
            return error_response(503, f"health probe failed: {detail}", 5)
        return Response(b"")

    # -- info --------------------------------------------------------------------------------
    async def model_info(self, request: Request) -> Response:
        cfg = self.fe.model_config
        path = self.server_args.get("model_path")
        return JSONResponse(
            {
                "model_path": path,
                "tokenizer_path": path,
                "served_model_name": self.server_args.get("served_model_name") or cfg.name,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.fe.weight_version,
                "model_type": getattr(cfg, "arch", None),
                "architectures": [getattr(cfg, "arch", "llama")],
                "max_model_len": cfg.context_length,
                "vocab_size": cfg.vocab_size,
                "reasoning_parser": self.parsers[0],
                "tool_call_parser": self.parsers[1],
            }
        )

    async def server_info(self, request: Request) -> Response:
        return JSONResponse(await server_state(self.fe, self.server_args))

    # -- control -----------------------------------------------------------------------------
    async def abort_request(self, request: Request) -> Response:
        body = await request.json()
        if not isinstance(body, dict):
            return error_response(400, "body must be a JSON object")
        rid, abort_all = body.get("rid"), body.get("abort_all") is True
        caller = request.user  # a user key (open admin routes) aborts only its own
        mine = caller.key if isinstance(caller, Caller) and not caller.admin else None
        if abort_all:
            self.fe.calls.abort(abort_all=True, owner=mine)
        elif isinstance(rid, str) and rid:  # SGLang ignores an empty rid without abort_all
            self.fe.calls.abort(rid, owner=mine)
        return Response(b"")

    async def flush_cache(self, request: Request) -> Response:
        """Every ready worker flushes (``--dp``: each of them; the router forgets their
        prefixes); 400 with the messages when one refused, as SGLang's."""
        sup = self.fe.supervisor
        try:
            client = self.fe.ready_client()
            assert isinstance(client, ObservedLink)  # the link's, behind the core's protocol
            if isinstance(sup, FlushesEveryWorker):
                replies = await sup.flush()
            else:
                replies = [(0, *await client.flush())]
        except ServeError as exc:
            return _serve_error(exc)
        except (TimeoutError, ConnectionError) as exc:
            return error_response(503, f"flush failed: {exc}")
        several = len(sup.members) > 1
        lines = [f"worker {i}: {m}" if several else m for i, _, m in replies]
        if not all(ok for _, ok, _ in replies):
            return error_response(400, "\n".join(lines))
        return Response(("Cache flushed.\n" + "".join(f"{m}\n" for m in lines)).encode())

    async def get_load(self, request: Request) -> Response:
        """SGLang's ``/get_load``: one entry per worker (``dp_rank``, its index); with
        several models, the ``ModelRouter`` lists every model's, each naming its model."""
        return JSONResponse(
            [await _worker_load(i, m) for i, m in enumerate(self.fe.supervisor.members)]
        )

    async def tokenize(self, request: Request) -> Response:
        body = await request.json()
        prompt = body.get("prompt") if isinstance(body, dict) else None
        add_special = body.get("add_special_tokens", True) if isinstance(body, dict) else True
        single = isinstance(prompt, str)
        if not (single or (isinstance(prompt, list) and all(isinstance(p, str) for p in prompt))):
            raise HTTPError(
                400, {"error": {"message": "prompt must be a string or a list of strings"}}
            )
        if not isinstance(add_special, bool):
            raise HTTPError(400, {"error": {"message": "add_special_tokens must be a boolean"}})
        texts: list[str] = [prompt] if isinstance(prompt, str) else list(prompt or [])
        ids = await self.fe.codec.encode(texts, add_special)
        ctx = self.fe.model_config.context_length
        if single:
            return JSONResponse({"tokens": ids[0], "count": len(ids[0]), "max_model_len": ctx})
        return JSONResponse({"tokens": ids, "count": [len(t) for t in ids], "max_model_len": ctx})

    async def detokenize(self, request: Request) -> Response:
        """``{"text": str}`` for a list of ids, ``{"text": [str, ...]}`` for a list of
        lists (SGLang's shape)."""
        body = await request.json()
        tokens = body.get("tokens") if isinstance(body, dict) else None
        vocab = self.fe.model_config.vocab_size

        def ids(v: Any) -> bool:
            return isinstance(v, list) and all(type(t) is int and 0 <= t < vocab for t in v)

        batch = isinstance(tokens, list) and bool(tokens) and isinstance(tokens[0], list)
        if not (all(ids(t) for t in tokens) if batch else ids(tokens)):  # type: ignore[union-attr]
            message = f"tokens must be a list of integers in [0, {vocab}), or a list of such lists"
            raise HTTPError(400, {"error": {"message": message}})
        skip = body.get("skip_special_tokens", True) is not False
        if batch:
            return JSONResponse({"text": [self.fe.codec.decode(t, skip) for t in tokens]})  # type: ignore[union-attr]
        return JSONResponse({"text": self.fe.codec.decode(tokens, skip)})  # type: ignore[arg-type]


async def _worker_load(rank: int, sup: ObservedWorker) -> dict[str, Any]:
    """One worker's load as SGLang's ``/get_load`` entry: requests held (running and
    waiting at the worker, plus queued here for it), waiting ones, KV tokens in use."""
    client = sup.client
    out: dict[str, Any] = {"dp_rank": rank, "num_reqs": 0, "num_waiting_reqs": 0,
                           "num_tokens": 0, "num_pending_tokens": 0, "ts_tic": time.time()}  # fmt: skip
    if client is None or not sup.ready:
        return out
    try:
        load = await client.stats(timeout=2.0)
    except (TimeoutError, ConnectionError):
        return out
    block = int(client.capacity.get("block_size", 0))
    used = int(load.get("kv_blocks_total", 0)) - int(load.get("kv_blocks_free", 0))
    waiting = int(load.get("waiting", 0)) + client.queued
    out.update(num_reqs=int(load.get("running", 0)) + waiting, num_waiting_reqs=waiting,
               num_tokens=used * block, ts_tic=time.time())  # fmt: skip
    return out
