"""What the request core needs of the worker link (``lifecycle.link``), as protocols: the
core submits, aborts and probes through them and never imports the link, whose
``WorkerClient``, ``Supervisor`` and ``WorkerPool`` satisfy them. ``generate_probe``, the
one real generation of the warm-up and of ``/health_generate``, is written against them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import anyio

from lifecycle.core.buffers import OutputBuffer
from lifecycle.core.submission import Sink, Submission, WorkerFailure

__all__ = ["WorkerLink", "WorkerMember", "Workers", "generate_probe"]


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
