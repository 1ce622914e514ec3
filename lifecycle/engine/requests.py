"""The Engine's requests: Python arguments into ``/generate`` bodies, and the coroutines
that run them on the ``Runtime`` in the Engine's event loop, under the same state
machines, admission, dispatcher and ownership rules as an HTTP request."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar

import anyio

from lifecycle.core.errors import RequestError, ServeError
from lifecycle.core.frontend import Frontend
from lifecycle.core.params import BODY_OPTIONS, GenerateRequest, parse_generate
from lifecycle.core.results import chunks, unary_results
from lifecycle.core.states import Cause

__all__ = [
    "EngineError",
    "Requests",
    "StreamExit",
    "caller_left",
    "generate_bodies",
    "interleave",
    "prompt_items",
    "windowed",
]

T = TypeVar("T")

log = logging.getLogger("lifecycle.engine")

# Per-prompt fields of a /generate body (scalars broadcast, lists are per prompt): the
# request options' flags and counts, and whether logprobs carry their token's text.
_PER_PROMPT = (*BODY_OPTIONS, "return_text_in_logprobs")
_RETRY = frozenset({Cause.OVERLOADED, Cause.NOT_READY})  # an in-process caller waits
_RETRY_FOR_S = 120.0
_EMBED_CHUNK = 16  # inputs per embedding call of a large encode


class EngineError(Exception):
    """A request that ended in error: ``cause`` is the state machine's error cause
    (``invalid``, ``too_long``, ``worker_lost``, ...), ``status`` the HTTP status the
    same error has on the server, ``message`` the same text."""

    def __init__(self, cause: Cause, message: str) -> None:
        super().__init__(f"{cause.value}: {message}")
        self.cause = cause.value
        self.status = cause.status
        self.retryable = cause.retryable
        self.message = message


def caller_left() -> tuple[Cause, str]:
    """The exit cause of an Engine call whose caller stopped waiting (the task was
    cancelled, the iterator closed): the Engine's client disconnect."""
    return Cause.CLIENT_GONE, "the caller stopped waiting"


class StreamExit:
    """The exit cause of an Engine stream: the caller left (``caller_left``), or, once
    ``stall`` was called, stopped taking chunks for ``after`` seconds while keeping the
    iterator (the HTTP send timeout's twin: ``client_stalled``)."""

    __slots__ = ("after", "stalled")

    def __init__(self, after: float) -> None:
        self.after = after
        self.stalled = False

    def stall(self) -> EngineError:
        self.stalled = True
        return EngineError(Cause.CLIENT_STALLED, self._message())

    def _message(self) -> str:
        return f"the caller took no chunk for {self.after:g} s"

    def __call__(self) -> tuple[Cause, str]:
        return (Cause.CLIENT_STALLED, self._message()) if self.stalled else caller_left()


def prompt_items(prompt: Any, input_ids: Any) -> tuple[list[Any], bool]:
    """The prompts (texts or id lists) of exactly one of ``prompt`` and ``input_ids``, and
    whether they were a batch (a list of texts, a list of id lists)."""
    if (prompt is None) == (input_ids is None):
        raise TypeError("give exactly one of prompt and input_ids")
    if prompt is not None:
        return ([prompt], False) if isinstance(prompt, str) else (list(prompt), True)
    batch = bool(input_ids) and isinstance(input_ids[0], list | tuple)
    return ([list(x) for x in input_ids], True) if batch else ([list(input_ids)], False)


def generate_bodies(
    prompt: str | Sequence[str] | None,
    input_ids: Sequence[int] | Sequence[Sequence[int]] | None,
    sampling_params: dict[str, Any] | Sequence[dict[str, Any]] | None,
    fields: dict[str, Any],
) -> tuple[list[dict[str, Any]], bool]:
    """One ``/generate`` body per prompt, and whether the input was a batch."""
    items, batch = prompt_items(prompt, input_ids)
    key = "text" if prompt is not None else "input_ids"
    n = len(items)
    sps = _per_prompt("sampling_params", sampling_params, n, batch)
    rid = fields.get("rid")
    if isinstance(rid, list) and len(rid) != n:
        raise ValueError(f"{len(rid)} rids for {n} prompts")
    bodies = []
    for i, item in enumerate(items):
        body: dict[str, Any] = {key: item}
        if sps[i] is not None:
            body["sampling_params"] = sps[i]
        for name in _PER_PROMPT:
            if fields.get(name) is not None:
                body[name] = _per_prompt(name, fields[name], n, batch)[i]
        if fields.get("token_ids_logprob") is not None:
            tl = fields["token_ids_logprob"]
            nested = batch and bool(tl) and isinstance(tl[0], list)
            body["token_ids_logprob"] = tl[i] if nested else tl
        if rid is None:  # meta_info.id is then the rid: the trace is found by it
            body["rid"] = uuid.uuid4().hex
        else:
            body["rid"] = (f"{rid}_{i}" if batch else rid) if isinstance(rid, str) else rid[i]
        # A batch's prompt goes as a batch of one: ids and n copies as in the batch.
        bodies.append({k: [v] for k, v in body.items()} if batch else body)
    return bodies, batch


def _per_prompt(name: str, value: Any, n: int, batch: bool) -> list[Any]:
    if batch and isinstance(value, list | tuple):
        if len(value) != n:
            raise ValueError(f"{name}: {len(value)} values for {n} prompts")
        return list(value)
    return [value] * n


async def windowed(jobs: Iterable[T], window: int, run: Callable[[T], Awaitable[None]]) -> None:
    """``run`` each job, at most ``window`` at a time (a job is taken from ``jobs`` only
    when a slot is free, so a long iterable is never all in flight). The first
    EngineError cancels the rest (their calls end as their caller left) and is raised."""
    slots = anyio.Semaphore(max(1, window))
    failed: list[EngineError] = []

    async def one(job: T, scope: anyio.CancelScope) -> None:
        try:
            await run(job)
        except EngineError as exc:
            failed.append(exc)
            scope.cancel()
        finally:
            slots.release()

    async with anyio.create_task_group() as tg:
        for job in jobs:
            await slots.acquire()
            tg.start_soon(one, job, tg.cancel_scope)
    if failed:
        raise failed[0]


class Requests:
    """The coroutines the Engine runs in its loop, over one ``Frontend``."""

    def __init__(self, frontend: Frontend) -> None:
        self.fe = frontend

    def parse(self, body: dict[str, Any]) -> GenerateRequest:
        try:
            return parse_generate(dict(body), vocab_size=self.fe.model_config.vocab_size)
        except RequestError as exc:
            raise EngineError(exc.cause, exc.message) from None

    async def run(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        """One body to its end: its results in SGLang's order."""
        req = self.parse(body)
        deadline = anyio.current_time() + _RETRY_FOR_S
        while True:
            try:
                return await self._run(req)
            except EngineError as exc:
                if Cause(exc.cause) not in _RETRY or anyio.current_time() > deadline:
                    raise
            await anyio.sleep(0.05)

    async def _run(self, req: GenerateRequest) -> list[dict[str, Any]]:
        try:
            async with self.fe.call(req, caller_left) as call:
                await call.start()
                await call.result()
                return unary_results(call)
        except (RequestError, ServeError) as exc:
            raise EngineError(exc.cause, exc.message) from None

    async def run_many(
        self, bodies: list[dict[str, Any]], window: int, progress: Any = None
    ) -> list[list[dict[str, Any]]]:
        """Every body, at most ``window`` at a time (admission at the worker's pace, never
        all at once); the results in input order. The first error cancels the rest."""
        for body in bodies:
            self.parse(body)  # every body is checked before any runs
        out: list[list[dict[str, Any]]] = [[] for _ in bodies]

        async def one(i: int) -> None:
            out[i] = await self.run(bodies[i])
            if progress is not None:
                progress.update(1)

        await windowed(range(len(bodies)), window, one)
        return out

    async def encode_many(
        self,
        inputs: list[Any],
        pooling: str,
        normalize: bool,
        window: int,
        progress: Any = None,
    ) -> list[dict[str, Any]]:
        """Every input's embedding (SGLang's ``/encode`` items, input order), in calls of
        ``_EMBED_CHUNK`` inputs, ``window`` inputs in flight at most."""
        from lifecycle.core.embed import embed

        parts = [inputs[i : i + _EMBED_CHUNK] for i in range(0, len(inputs), _EMBED_CHUNK)]
        out: list[list[dict[str, Any]]] = [[] for _ in parts]

        async def one(k: int) -> None:
            try:
                emb = await embed(self.fe, parts[k], pooling=pooling, normalize=normalize,
                                  exit_cause=caller_left)  # fmt: skip
            except (RequestError, ServeError) as exc:
                raise EngineError(exc.cause, exc.message) from None
            out[k] = emb.encode_results()
            if progress is not None:
                progress.update(len(parts[k]))

        await windowed(range(len(parts)), window // _EMBED_CHUNK, one)
        return [item for part in out for item in part]

    async def stream(
        self,
        body: dict[str, Any],
        incremental: bool,
        exit_cause: Callable[[], tuple[Cause, str]] = caller_left,
    ) -> AsyncGenerator[dict[str, Any], None]:
        """One body's stream chunks; an error after some chunks raises EngineError."""
        req = self.parse(body)
        try:
            async with self.fe.call(req, exit_cause) as call:
                await call.start()
                async for chunk in chunks(call, incremental):
                    yield chunk
                err = call.error()
                if err is not None:
                    raise EngineError(*err)
        except (RequestError, ServeError) as exc:
            raise EngineError(exc.cause, exc.message) from None


def interleave(per_body: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per-prompt results as one batch answer, in SGLang's order: with ``n > 1`` the n
    copies of the batch, ``[p0, p1, ..., p0, p1, ...]`` (``GenerateCall.samples``)."""
    n = max((len(r) for r in per_body), default=0)
    return [r[j] for j in range(n) for r in per_body if j < len(r)]
