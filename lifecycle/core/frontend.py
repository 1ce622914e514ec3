"""The request path's process-wide parts, between the API handlers and the worker.

``Frontend`` holds the registry of live requests, the live calls that own them
(``LiveCalls``), the admission queue, the tokenizer, the supervised worker, the drain
and the books (received, finished, failed by cause). Each generate call is a
``GenerateCall`` (``lifecycle.core.call``) made by ``Frontend.call``; the Frontend is
its ``CallHost``. Knows nothing of HTTP.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import anyio

from lifecycle.core.buffers import ADMISSION_BOUND, AdmissionQueue
from lifecycle.core.call import ExitCause, GenerateCall, owner_left
from lifecycle.core.detok import TextCodec, TokenizerLike
from lifecycle.core.errors import ServeError
from lifecycle.core.events import Events
from lifecycle.core.fsm import RequestRecord
from lifecycle.core.live_calls import LiveCalls
from lifecycle.core.params import GenerateRequest
from lifecycle.core.ports import WorkerLink, Workers, generate_probe
from lifecycle.core.reasoning import ReasoningFormat
from lifecycle.core.registry import Registry
from lifecycle.core.states import DRAIN, Cause

__all__ = ["Frontend", "FrontendConfig", "ModelLoader"]

log = logging.getLogger("lifecycle.core.frontend")


@dataclass(frozen=True, slots=True)
class FrontendConfig:
    max_queued: int = ADMISSION_BOUND  # admitted, not yet dispatched; beyond: 503 + Retry-After
    incremental_streaming_output: bool = False
    output_margin: int = 8  # OutputBuffer limit = max_new_tokens + margin
    request_timeout: float | None = None  # a call's deadline, from its start (None: none)
    weight_version: str = "default"  # meta_info.weight_version (SGLang's; --weight-version)
    # meta_info.reasoning_tokens counts this format's reasoning (None: always 0)
    reasoning: ReasoningFormat | None = None


W = TypeVar("W", bound=Workers)  # the runtime's Supervisor or WorkerPool


class ModelLoader(Protocol):
    """Loads a model on demand (``lifecycle.link.model_set``: several models, some unloaded):
    whether its worker must be loaded before a call can run on it, and the wait for
    that load (a ``ServeError`` naming the model and the cause when it fails)."""

    def must_load(self) -> bool: ...

    def asleep(self) -> bool: ...

    def state(self) -> str: ...

    async def load(self) -> None: ...


class Frontend(Generic[W]):
    def __init__(
        self,
        supervisor: W,
        tokenizer: TokenizerLike,
        model_config: Any,
        config: FrontendConfig = FrontendConfig(),
        loader: ModelLoader | None = None,
    ) -> None:
        self.config = config
        self.supervisor: W = supervisor
        self.loader = loader  # None: the model is loaded at start and stays
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.registry = Registry()
        self.calls: LiveCalls[GenerateCall] = LiveCalls(self.registry)
        self.admission = AdmissionQueue(config.max_queued)
        self.codec = TextCodec(tokenizer)
        self._closed_tokens = 0  # output tokens of the records of every closed call
        self.draining = False
        # The one feed the tracer, metrics, access log and export subscribe to
        # (opened / transition / released / closed; lifecycle.core.events).
        self.events = Events(self.registry)  # its records tell it, and only it

    def call(
        self, req: GenerateRequest, exit_cause: ExitCause | None = None, *, owner: object = None
    ) -> GenerateCall:
        """A new call for ``req``; enter it with ``async with`` before starting it.
        ``exit_cause``: why it ends when its owner leaves early; ``owner``: who made it
        (an API key's digest; ``LiveCalls.abort`` on that owner's behalf reaches it). Its
        deadline: the request's ``X-Request-Timeout`` header (``lifecycle.core.origin``), else
        ``request_timeout``. It closes itself once its last sample ended."""
        call = GenerateCall(self, req, exit_cause or owner_left, self.config.request_timeout)
        self.calls.own(call, owner)
        self.events.opened(call)
        return call

    # -- what a call asks (CallHost) ---------------------------------------------------------
    @property
    def weight_version(self) -> str:
        return self.config.weight_version

    @property
    def reasoning(self) -> ReasoningFormat | None:
        return self.config.reasoning

    def worker_index(self, client: WorkerLink) -> int | None:
        """The index of ``client``'s worker (``--dp``); None for a client a restart
        replaced."""
        members = self.supervisor.members
        return next((i for i, m in enumerate(members) if m.client is client), None)

    def dp_rank(self, client: WorkerLink) -> int | None:
        """``meta_info.dp_rank``: the worker's index, only when there are several."""
        return self.worker_index(client) if len(self.supervisor.members) > 1 else None

    @property
    def output_margin(self) -> int:
        return self.config.output_margin

    def ready_client(self, prompt: Sequence[int] | None = None) -> WorkerLink:
        """A ready worker's client; with several (``WorkerPool``), the one the router
        picks for ``prompt``."""
        if self.draining:
            raise ServeError(DRAIN.refused, "The server is shutting down; retry elsewhere.")
        client = self.supervisor.pick(prompt)
        if client is None:
            raise ServeError(Cause.NOT_READY, "The server is not ready yet; retry later.")
        return client

    def must_load(self) -> bool:
        """Whether a new call waits for this model to load (it is unloaded or loading
        on demand) before it takes a worker."""
        return self.loader is not None and self.loader.must_load()

    def model_state(self) -> str:
        """``/v1/models``' state: loaded, loading, unloading or unloaded (without a
        loader: loaded once a worker is ready, loading before)."""
        if self.loader is not None:
            return self.loader.state()
        return "loaded" if getattr(self.supervisor, "ready", True) else "loading"

    def model_asleep(self) -> bool:
        """Whether the model is not loaded because it loads on demand (unloaded, or a
        load a request started): the server is healthy, its requests wait."""
        return self.loader is not None and self.loader.asleep()

    async def load_model(self) -> None:
        """Until the model is loaded (``ServeError`` when its load failed)."""
        if self.loader is not None:
            await self.loader.load()

    def opened(self, rec: RequestRecord, call: GenerateCall) -> None:
        """A new record of ``call``: registered (DuplicateRid, counted received), live."""
        self.registry.add(rec)
        self.calls.track(rec.id, call)

    def worker_released(self, rec_id: int) -> None:
        self.registry.worker_released(rec_id)

    @property
    def output_tokens(self) -> int:
        """Output tokens received from the workers so far, all samples, whether their
        request ended or not (``/metrics``' ``lifecycle_generation_tokens`` and the
        ``serving:`` log line). Each record counts its own as STEP entries arrive
        (``RequestRecord.tokens``, one add an entry); this sums the live records' counts
        and those of the records that left, at most once a scrape or a log line."""
        return self._closed_tokens + sum(rec.tokens for rec in self.registry)

    def closed(self, call: GenerateCall) -> None:
        """``call`` closed, every record terminal: they leave the registry (a tombstone
        stays while the worker holds one, counted there) and the live calls."""
        for run in call.runs:
            rec = run.rec
            if rec in self.registry:  # its tokens move from the live sum to the closed one
                self._closed_tokens += rec.tokens
            self.registry.remove(rec)
            self.calls.untrack(rec.id)
        self.events.closed(call)

    # -- health and drain ------------------------------------------------------------------
    async def probe(self, timeout: float, client: WorkerLink | None = None) -> tuple[bool, str]:
        """One real generation through admission (``/health_generate``), on ``client``
        (one worker of several), else on a ready worker."""
        client = client or self.ready_client()
        if not self.admission.try_admit():
            raise ServeError(Cause.OVERLOADED, "The server is overloaded; retry later.")
        try:
            with anyio.move_on_after(timeout):
                return await generate_probe(client)
            return False, "timed out"
        finally:
            self.admission.release()

    def begin_drain(self) -> None:
        """From now on every new call is refused (503 + Retry-After); live ones go on."""
        self.draining = True
