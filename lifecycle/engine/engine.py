"""``Engine``: the runtime in a Python process, without HTTP (docs/engine.md).

It starts and supervises the worker like ``lifecycle serve`` (same options, same
``Runtime``), runs the frontend in an event loop of its own (a daemon thread) and takes
requests from plain calls, from ``asyncio`` code, as streams and as offline batches. Its
requests are the HTTP API's: the same body checks, state machines, admission, bounded
handoffs, traces, metrics and result dicts; a caller that stops waiting (a cancelled
task, a ``break`` out of a stream) is a client disconnect, and its request is aborted.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from collections.abc import AsyncGenerator, Sequence
from concurrent.futures import Future
from typing import Any

import anyio
import anyio.abc

from lifecycle.chat.tool_prompt import render_chat
from lifecycle.core.states import Cause
from lifecycle.engine.batch import BatchSummary, done_lines, read_lines, run_lines
from lifecycle.engine.loop import EngineLoop
from lifecycle.engine.requests import (
    EngineError,
    Requests,
    StreamExit,
    generate_bodies,
    interleave,
    prompt_items,
)
from lifecycle.faces.openai import OpenAIFace
from lifecycle.faces.server_info import server_state
from lifecycle.option_args import engine_values
from lifecycle.runtime import Runtime, app_config, server_args
from modelfile.gguf_meta import ModelFileError

__all__ = ["Engine", "EngineError"]

log = logging.getLogger("lifecycle.engine")

Prompt = str | Sequence[str] | None
Ids = Sequence[int] | Sequence[Sequence[int]] | None
Sampling = dict[str, Any] | Sequence[dict[str, Any]] | None


class Engine:
    """``Engine(model=None, **options)``: the options of ``lifecycle serve`` (the
    listener's own excepted) as keywords, e.g. ``Engine(max_running=16, device="cpu")``,
    over those of a ``config`` file and of ``LIFECYCLE_*`` variables (``lifecycle/config.py``).
    Blocks until the worker is ready (``startup_timeout`` seconds at most)."""

    def __init__(
        self,
        model: str | None = None,
        *,
        config: str | os.PathLike[str] | None = None,
        startup_timeout: float = 600.0,
        **options: Any,
    ) -> None:
        from lifecycle.config import layered

        values = engine_values(model, {**layered(config, os.environ, server=False), **options})
        try:  # a Hub repo id is fetched here (modelfile.hub)
            self.config = app_config(values, debug_routes=True)
        except ModelFileError as exc:
            raise EngineError(Cause.NOT_READY, f"the model did not load: {exc}") from None
        if self.config.more_models:  # a list in a config file or LIFECYCLE_MODEL=a,b
            raise ValueError("Engine() serves one model: give model once")
        self._faults(values.get("faults"))
        self._loop: EngineLoop | None = EngineLoop(_shut_down)
        self._runtime_task: Future[Any] | None = None
        self.runtime: Runtime
        try:
            self._runtime_task, self.runtime = self._loop.start(self._run, startup_timeout)
        except BaseException as exc:
            self._loop.stop()
            self._loop = None
            if isinstance(exc, BaseExceptionGroup):  # the runtime's task group
                raise _first(exc) from None
            raise
        assert self.runtime.frontend is not None
        self.frontend = self.runtime.frontend
        self._requests = Requests(self.frontend)
        atexit.register(self.shutdown)

    # -- the lifecycle ---------------------------------------------------------------------
    async def _run(
        self, startup_timeout: float, *, task_status: anyio.abc.TaskStatus[Runtime]
    ) -> None:
        rt = Runtime(self.config)
        try:  # before the worker starts: a file it cannot run is one error
            await rt.check_model()
        except (OSError, ModelFileError) as exc:
            raise EngineError(Cause.NOT_READY, f"the model did not load: {exc}") from None
        async with rt.running() as tg:
            await rt.load(tg)
            await _wait_ready(rt, startup_timeout)
            task_status.started(rt)
            await anyio.sleep_forever()

    def shutdown(self) -> None:
        """End every live request (as a shutdown), stop the worker and the loop. Safe to
        call twice; the Engine takes no requests after it."""
        loop, self._loop = self._loop, None
        if loop is None:
            return
        atexit.unregister(self.shutdown)
        try:
            fe = self.frontend
            loop.call(_cut_all, fe)
            if self._runtime_task is not None:
                self._runtime_task.cancel()
                try:
                    self._runtime_task.exception(timeout=30)
                except BaseException:  # noqa: S110 - cancelled, as asked
                    pass
        finally:
            loop.stop()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    async def __aenter__(self) -> Engine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await anyio.to_thread.run_sync(self.shutdown)

    @property
    def _live(self) -> EngineLoop:
        if self._loop is None:
            raise _shut_down()
        return self._loop

    # -- generate --------------------------------------------------------------------------
    def generate(
        self,
        prompt: Prompt = None,
        sampling_params: Sampling = None,
        input_ids: Ids = None,
        *,
        stream: bool = False,
        progress: bool | None = None,
        **fields: Any,
    ) -> Any:
        """SGLang's ``/generate`` for one prompt (a dict) or a batch (a list in input
        order), ``stream=True``: an iterator of the same chunks as the HTTP stream.
        ``fields``: the body's request options (``wire.RequestOptions``' flags and counts,
        ``token_ids_logprob``), ``return_text_in_logprobs`` and ``rid``. A batch shows a
        progress bar on a terminal unless ``progress=False``."""
        bodies, batch = generate_bodies(prompt, input_ids, sampling_params, fields)
        if stream:
            left = StreamExit(self.config.send_timeout)
            return self._live.iterate(
                lambda: self._stream(bodies, batch, left), self.config.send_timeout, left.stall
            )
        bar = _progress_bar(len(bodies), progress) if batch else None
        try:
            per_body = self._live.call(self._requests.run_many, bodies, self._window(), bar)
        finally:
            if bar is not None:
                bar.close()
        return _answer(per_body, batch)

    async def async_generate(
        self,
        prompt: Prompt = None,
        sampling_params: Sampling = None,
        input_ids: Ids = None,
        *,
        stream: bool = False,
        **fields: Any,
    ) -> Any:
        """``generate`` for asyncio code; ``stream=True`` returns an async iterator.
        Cancelling the awaiting task aborts the request."""
        bodies, batch = generate_bodies(prompt, input_ids, sampling_params, fields)
        if stream:
            left = StreamExit(self.config.send_timeout)
            return self._live.aiterate(
                lambda: self._stream(bodies, batch, left), self.config.send_timeout, left.stall
            )
        per_body = await self._live.bridge(self._requests.run_many, bodies, self._window())
        return _answer(per_body, batch)

    def _stream(
        self, bodies: list[dict[str, Any]], batch: bool, left: StreamExit
    ) -> AsyncGenerator[dict[str, Any], None]:
        """A stream is one call: a batch goes as one body (``index`` in each chunk)."""
        body = bodies[0] if not batch else _batch_body(bodies)
        return self._requests.stream(body, self.config.incremental_streaming_output, left)

    def _window(self) -> int:
        """Requests in flight for a batch: enough to keep every worker credit busy with
        more queued behind, within admission's bound."""
        credits = sum(
            int(m.client.capacity.get("max_pending", 64)) if m.client is not None else 64
            for m in self.runtime.supervisor.members  # every worker of a --dp pool
        )
        return max(1, min(self.config.max_queued, 2 * credits))

    # -- embeddings ------------------------------------------------------------------------
    def encode(
        self,
        prompt: str | Sequence[str] | None = None,
        input_ids: Ids = None,
        *,
        pooling: str = "last",
        normalize: bool = True,
        progress: bool | None = None,
    ) -> Any:
        """SGLang's ``/encode``: the model's final hidden state pooled over each input
        (``last`` token or ``mean``), L2-normalised unless ``normalize=False``; one input
        gives ``{"embedding": [...], "meta_info": {...}}``, a list a list in input order."""
        inputs, batch = prompt_items(prompt, input_ids)
        bar = _progress_bar(len(inputs), progress) if batch and len(inputs) > 1 else None
        try:
            out = self._live.call(
                self._requests.encode_many, inputs, pooling, normalize, self._window(), bar
            )
        finally:
            if bar is not None:
                bar.close()
        return out if batch else out[0]

    async def async_encode(
        self,
        prompt: str | Sequence[str] | None = None,
        input_ids: Ids = None,
        *,
        pooling: str = "last",
        normalize: bool = True,
    ) -> Any:
        inputs, batch = prompt_items(prompt, input_ids)
        out = await self._live.bridge(
            self._requests.encode_many, inputs, pooling, normalize, self._window()
        )
        return out if batch else out[0]

    # -- chat ------------------------------------------------------------------------------
    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: Sampling = None,
        **kw: Any,
    ) -> Any:
        """``generate`` on the chat template's rendering of ``messages`` (a
        conversation, or a list of them for a batch)."""
        return self.generate(None, sampling_params, self._chat_ids(messages), **kw)

    async def async_chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: Sampling = None,
        **kw: Any,
    ) -> Any:
        ids = await anyio.to_thread.run_sync(self._chat_ids, messages)
        return await self.async_generate(None, sampling_params, ids, **kw)

    def _chat_ids(self, messages: Any) -> list[int] | list[list[int]]:
        template = self.runtime.chat
        if template is None:
            raise EngineError(Cause.INVALID, "this model has no chat template")
        batch = bool(messages) and isinstance(messages[0], list)
        convs = list(messages) if batch else [messages]
        try:
            texts = [render_chat(template, list(c)) for c in convs]
        except (ValueError, TypeError) as exc:
            raise EngineError(Cause.INVALID, str(exc)) from None
        codec = self.frontend.codec
        ids = self._live.call(codec.encode, texts, False)
        return ids if batch else ids[0]

    # -- files of requests -----------------------------------------------------------------
    def run_batch(
        self,
        input_path: str | os.PathLike[str],
        output_path: str | os.PathLike[str],
        *,
        progress: bool | None = None,
    ) -> BatchSummary:
        """``lifecycle batch``: every line of ``input_path`` (OpenAI batch-file or native
        requests) answered in ``output_path``, skipping lines a cut run already answered
        (``lifecycle/engine/batch.py``)."""
        from pathlib import Path

        output = Path(output_path)
        done = done_lines(output)
        summary = BatchSummary(skipped=len(done))
        total = sum(1 for raw in open(input_path, "rb") if raw.strip())
        bar = _progress_bar(max(0, total - len(done)), progress)
        lines = read_lines(Path(input_path), done)
        try:
            self._live.call(
                run_lines, self._requests, self._openai(), lines, output, self._window(),
                summary, bar,
            )  # fmt: skip
        finally:
            if bar is not None:
                bar.close()
        return summary

    def _openai(self) -> OpenAIFace:
        rt = self.runtime
        model_id = rt.served_model_id()
        return OpenAIFace(
            self.frontend, rt.chat, model_id=model_id, model_path=rt.model_path,
            tool_call_parser=self.config.tool_call_parser,
        )  # fmt: skip

    # -- looking inside --------------------------------------------------------------------
    def server_info(self) -> dict[str, Any]:
        """What ``/server_info`` says (``live_requests``, ``internal_states`` with the
        worker's KV blocks, ...)."""
        return self._live.call(
            server_state, self.frontend, server_args(self.config, self.runtime.model_path)
        )

    def trace(self, rid: str) -> dict[str, Any] | None:
        """The state trace of a live or recently finished request (``meta_info.id`` or
        its client rid), as ``/debug/requests/{rid}`` gives it."""
        tracer = self.runtime.tracer
        return None if tracer is None else self._live.call(_lookup, tracer, rid)

    def metrics(self) -> str:
        """The Prometheus text of ``/metrics``."""
        assert self.runtime.metrics is not None
        body, _ = self._live.call(self.runtime.metrics.render)
        return body.decode()

    @staticmethod
    def _faults(path: str | None) -> None:
        """A fault plan for chaos runs: this process, and the worker through the
        environment (it reads the file at each start)."""
        if path:
            from wire import faults

            faults.install(faults.load_plan(path))
            os.environ[faults.ENV_VAR] = os.path.abspath(path)


def _shut_down() -> EngineError:
    return EngineError(Cause.SHUTTING_DOWN, "the Engine is shut down")


def _first(group: BaseExceptionGroup) -> BaseException:
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


async def _wait_ready(rt: Runtime, timeout: float) -> None:
    """Until the worker is ready; its first failure before that is the Engine's."""
    sup = rt.supervisor
    with anyio.fail_after(timeout):
        while not sup.ready:
            if (sup.restarts or sup.status == "failed") and sup.last_error:
                raise EngineError(Cause.NOT_READY, f"the worker did not start: {sup.last_error}")
            await anyio.sleep(0.05)


async def _cut_all(fe: Any) -> None:
    fe.begin_drain()
    fe.calls.cut_all(Cause.SHUTTING_DOWN, "the engine is shutting down")


async def _lookup(tracer: Any, rid: str) -> dict[str, Any] | None:
    return tracer.lookup(rid)


def _answer(per_body: list[list[dict[str, Any]]], batch: bool) -> Any:
    results = interleave(per_body)
    return results if batch or len(results) > 1 else results[0]


def _batch_body(bodies: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-prompt bodies (batches of one) as one batch body, for a batch stream."""
    return {key: [v for b in bodies for v in b[key]] for key in bodies[0]}


def _progress_bar(total: int, progress: bool | None) -> Any:
    if progress is False or (progress is None and not sys.stderr.isatty()):
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="req", desc="generate")
