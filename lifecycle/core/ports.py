"""What the request core and the API need of the worker link (``lifecycle.link``), as
protocols: they submit, abort, probe, read the workers' state and administer them through
these and never import the link, whose ``WorkerClient``, ``Supervisor``, ``WorkerPool``,
``RayWorkers`` and ``ModelSet`` satisfy them. ``generate_probe``, the one real generation
of the warm-up and of ``/health_generate``, is written against them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import anyio

from lifecycle.core.buffers import OutputBuffer
from lifecycle.core.submission import Sink, Submission, WorkerFailure

__all__ = [
    "FlushesEveryWorker",
    "LoadedModel",
    "ModelLoads",
    "ObservedLink",
    "ObservedWorker",
    "RayReplicas",
    "WorkerLink",
    "WorkerMember",
    "Workers",
    "generate_probe",
]


class WorkerLink(Protocol):
    """One worker's client: submissions on credits, aborts, what its HELLO said."""

    capacity: dict[str, Any]
    model: dict[str, Any]  # HELLO's model card

    def submit(
        self,
        prompt: list[int],
        sampling: dict[str, Any],
        options: dict[str, Any],
        sinks: list[Sink],
        on_dispatch: Callable[[], None] | None = None,
        on_release: Callable[[], None] | None = None,
    ) -> Submission: ...

    def abort(self, sub: Submission, *, forget: bool = False, message: str = "aborted") -> None: ...

    def abort_sample(self, sub: Submission, index: int, message: str) -> None: ...


class WorkerMember(Protocol):
    """One supervised worker: its client while it has one."""

    @property
    def client(self) -> Any: ...  # a WorkerLink, or None between restarts


class Workers(Protocol):
    """The workers behind the frontend: one supervisor, or a pool of them (``--dp``)."""

    @property
    def members(self) -> Sequence[WorkerMember]: ...

    def pick(self, prompt: Sequence[int] | None = None) -> Any: ...  # WorkerLink | None


# -- what the API's info and admin routes ask (lifecycle.api) -------------------------------
@runtime_checkable
class ObservedLink(WorkerLink, Protocol):
    """One worker's client as ``/server_info``, ``/get_load`` and ``/flush_cache`` read it."""

    @property
    def in_flight(self) -> int: ...  # rids the worker holds, tombstones included

    @property
    def queued(self) -> int: ...  # submitted here, not yet sent

    async def stats(self, timeout: float = 5.0) -> dict[str, Any]: ...  # its STATS

    async def flush(self, timeout: float = 30.0) -> tuple[bool, str]: ...


class ObservedWorker(Protocol):
    """One supervised worker as the health and info routes read it."""

    @property
    def ready(self) -> bool: ...

    @property
    def status(self) -> str: ...

    @property
    def last_error(self) -> str | None: ...

    @property
    def worker_pid(self) -> int | None: ...

    @property
    def client(self) -> ObservedLink | None: ...

    def info(self) -> dict[str, Any]: ...


@runtime_checkable
class FlushesEveryWorker(Protocol):
    """Several workers (``--dp``) that flush together, and whose router forgets them."""

    async def flush(self, timeout: float = 30.0) -> list[tuple[int, bool, str]]: ...


@runtime_checkable
class RayReplicas(Protocol):
    """Workers placed as Ray replicas (``--ray``): where each runs, and their number."""

    def replicas(self) -> list[dict[str, Any]]: ...

    def scaling(self) -> dict[str, Any]: ...

    def scale(self, count: int) -> None: ...  # ValueError for a count out of bounds


class LoadedModel(Protocol):
    """One model of the set, after a load or an unload."""

    @property
    def name(self) -> str: ...

    @property
    def state(self) -> str: ...


class ModelLoads(Protocol):
    """The server's model set (``--models-max``, ``--sleep-idle-seconds``)."""

    async def load(self, name: str) -> LoadedModel: ...  # ServeError when it cannot

    async def unload(self, name: str) -> LoadedModel: ...  # ValueError when it stays


class _ProbeSink:
    """The probe's one sample: an ``OutputBuffer`` (its bound is the probe's length)
    that wakes the probe when the sample ends."""

    __slots__ = ("buffer", "ended")

    def __init__(self, limit: int) -> None:
        self.buffer = OutputBuffer(limit)
        self.ended = anyio.Event()

    def append(self, ids: list[int], extra: dict[str, Any] | None = None) -> None:
        self.buffer.append(ids, extra)

    def finish(self, reason: Any) -> None:
        self.buffer.finish(reason)
        self.ended.set()


async def generate_probe(client: WorkerLink, max_new_tokens: int = 1) -> tuple[bool, str]:
    """One real generation; passes only on its own output. Admission is the caller's
    (``Frontend.probe``); the warm-up runs before any request is admitted."""
    sink = _ProbeSink(max_new_tokens)
    sampling = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}
    sub = client.submit([0], sampling, {}, [sink])
    try:
        await sink.ended.wait()
    finally:
        if not sink.buffer.ended:
            client.abort(sub, forget=True)
    chunk = sink.buffer.take_nowait()
    assert chunk is not None  # the sample ended: its end is there to take
    got, end = len(chunk.ids), chunk.end
    if isinstance(end, WorkerFailure):
        return False, f"{end.cause.value}: {end.message}"
    if got != max_new_tokens:
        return False, f"expected {max_new_tokens} tokens, got {got} ({end})"
    return True, "ok"
