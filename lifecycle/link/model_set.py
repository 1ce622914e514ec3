"""Models loaded on demand and unloaded when idle (issue 55, point 3): ``--models-max N``
models loaded at once, ``--sleep-idle-seconds S``, and the admin routes ``POST
/models/load`` and ``POST /models/unload``.

A ``ModelSet`` holds each model's state: ``loaded``, ``loading``, ``unloading`` or
``unloaded``. A request for a model that is not loaded is admitted, then waits (its
trace's ``model_wait_ms``) while the model loads: the least recently used loaded model
is unloaded first when ``models_max`` are loaded, never while a request of it holds a
worker (it is ``unloading`` meanwhile: its own new requests wait for it to load again,
so a busy model cannot starve the others). One load or unload runs at a time. Unloading
stops the model's workers (``Supervisor.unload``: their processes end, their memory
given back); the tokenizer and the routes stay. A load that fails ends the requests that
waited for it with an error naming the model and the cause, and leaves it unloaded (the
next request tries again). A model served by remote workers (``--worker``) is not this
server's to stop: it stays loaded and is not counted.

Without ``--models-max`` and ``--sleep-idle-seconds`` there is no ``ModelSet``: every
model loads at start and stays, as before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
import anyio.abc

from lifecycle.core.errors import ServeError
from lifecycle.core.states import Cause
from lifecycle.link.supervisor import LoadFailed

__all__ = ["ModelSet", "ModelSlot", "State"]

log = logging.getLogger("lifecycle.link.model_set")

State = Literal["loaded", "loading", "unloading", "unloaded"]


@dataclass(eq=False)
class _Load:
    """One load of a model: the requests that wait for it, and how it ended."""

    done: anyio.Event = field(default_factory=anyio.Event)
    error: str | None = None


@dataclass(eq=False)
class ModelSlot:
    """One model of the set: its name, its workers (a ``Supervisor`` or ``WorkerPool``,
    built unloaded unless it loads at start), its frontend once there is one (its live
    calls say whether it is busy), its state and when a request last came or went."""

    name: str
    workers: Any
    remote: bool = False  # served by --worker addresses: never unloaded
    state: State = "loading"
    frontend: Any = None
    last_used: float = field(default_factory=time.monotonic)
    loading: _Load | None = None
    # Calls of this model waiting for its load: live, yet holding no worker.
    waiting: int = 0

    def holds_workers(self) -> bool:
        """Whether a live call of this model holds a worker (has its client)."""
        fe = self.frontend
        return fe is not None and any(c.client is not None for c in fe.calls.calls())

    def idle(self) -> bool:
        return self.frontend is None or len(self.frontend.calls) == 0

    def resident(self) -> bool:
        """Whether its workers hold memory, or will without waiting for the set's lock
        (loading at start); a load a request started waits for the lock first."""
        return self.state in ("loaded", "unloading") or (
            self.state == "loading" and self.loading is None
        )


class _Loader:
    """What a model's ``Frontend`` asks: must a call wait, and the wait."""

    __slots__ = ("models", "slot")

    def __init__(self, models: ModelSet, slot: ModelSlot) -> None:
        self.models, self.slot = models, slot

    def must_load(self) -> bool:
        return self.slot.state != "loaded"

    def asleep(self) -> bool:
        return self.slot.state != "loaded" and not self.slot.resident()

    def state(self) -> str:
        return self.slot.state

    async def load(self) -> None:
        await self.models.ensure(self.slot)

    # Frontend events: a call opened or closed is a use of the model.
    def opened(self, call: Any) -> None:
        self.slot.last_used = time.monotonic()

    def closed(self, call: Any) -> None:
        self.slot.last_used = time.monotonic()
        self.models.notify()  # an unloading model may have drained


class ModelSet:
    """The models of one server and which of them are loaded (module docstring)."""

    def __init__(
        self,
        slots: Sequence[ModelSlot],
        models_max: int | None = None,
        sleep_idle_seconds: float | None = None,
    ) -> None:
        self.slots = tuple(slots)
        self.models_max = models_max
        self.sleep_idle_seconds = sleep_idle_seconds
        self._by_name = {s.name: s for s in self.slots}
        self._lock = anyio.Lock()  # one load or unload at a time
        self._changed = anyio.Event()
        self._tg: anyio.abc.TaskGroup | None = None

    @staticmethod
    def loads_at_start(index: int, models_max: int | None, remote: bool) -> bool:
        """Whether the model at ``index`` loads at start: all of them without a bound,
        else the first ``models_max`` (a remote one always: it is there already)."""
        return remote or models_max is None or index < models_max

    def loader(self, slot: ModelSlot) -> _Loader:
        return _Loader(self, slot)

    def attach(self, slot: ModelSlot, frontend: Any, loader: _Loader) -> None:
        """``frontend`` is ``slot``'s: its calls say whether the model is busy."""
        slot.frontend = frontend
        frontend.events.subscribe(loader)

    def get(self, name: str) -> ModelSlot | None:
        return self._by_name.get(name)

    def notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def _wait_change(self, timeout: float = 1.0) -> None:
        """Until the next change (a state, a call closed), at most ``timeout`` s."""
        changed = self._changed
        with anyio.move_on_after(timeout):
            await changed.wait()

    # -- running ---------------------------------------------------------------------------
    async def run(self) -> None:
        """The models loaded at start become ``loaded`` once ready; the idle ones are
        unloaded after ``sleep_idle_seconds``. Loads started by requests run here too."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            for slot in self.slots:
                if slot.state == "loading":
                    tg.start_soon(self._started, slot)
            if self.sleep_idle_seconds is not None:
                tg.start_soon(self._sleep_idle, self.sleep_idle_seconds)
            await anyio.sleep_forever()

    async def _started(self, slot: ModelSlot) -> None:
        await slot.workers.wait_ready()
        slot.state, slot.last_used = "loaded", time.monotonic()
        self.notify()

    async def _sleep_idle(self, seconds: float) -> None:
        while True:
            await anyio.sleep(min(seconds / 4, 1.0))
            now = time.monotonic()
            for slot in self.slots:
                if self._sleepy(slot, now, seconds):
                    async with self._lock:
                        if self._sleepy(slot, time.monotonic(), seconds):
                            log.info("unloading model %s: idle for %.0f s", slot.name, seconds)
                            await self._unload(slot)

    @staticmethod
    def _sleepy(slot: ModelSlot, now: float, seconds: float) -> bool:
        return (
            slot.state == "loaded"
            and not slot.remote
            and slot.idle()
            and now - slot.last_used >= seconds
        )

    # -- a request's wait, and the admin routes ----------------------------------------------
    async def ensure(self, slot: ModelSlot) -> None:
        """Until ``slot``'s model is loaded, starting its load when nothing does; a
        ``ServeError`` (not_ready, 503) naming the model and the cause when it fails."""
        slot.waiting += 1
        try:
            while slot.state != "loaded":
                if slot.state == "unloaded":
                    self._start_load(slot)
                load = slot.loading
                if slot.state == "loading" and load is not None:
                    await load.done.wait()
                    if load.error is not None:
                        raise ServeError(
                            Cause.NOT_READY,
                            f"The model `{slot.name}` could not be loaded: {load.error}",
                        )
                else:  # unloading, or loading at start: until it changes
                    await self._wait_change()
        finally:
            slot.waiting -= 1
        slot.last_used = time.monotonic()

    def _start_load(self, slot: ModelSlot) -> None:
        assert self._tg is not None, "ModelSet.run is not running"
        slot.state, slot.loading = "loading", _Load()
        self.notify()
        self._tg.start_soon(self._load, slot, slot.loading)

    async def _load(self, slot: ModelSlot, load: _Load) -> None:
        try:
            async with self._lock:
                await self._make_room(slot)
                log.info("loading model %s", slot.name)
                start = time.monotonic()
                await slot.workers.load()
                slot.state, slot.last_used = "loaded", time.monotonic()
                log.info("loaded model %s in %.1f s", slot.name, slot.last_used - start)
        except LoadFailed as exc:
            load.error = str(exc)
            slot.state = "unloaded"
            log.error("model %s could not be loaded: %s", slot.name, exc)
        except BaseException:
            load.error = "the server is shutting down"
            slot.state = "unloaded"
            raise
        finally:
            load.done.set()
            self.notify()

    async def _make_room(self, slot: ModelSlot) -> None:
        """Under the lock: unload the least recently used loaded models (idle ones
        first) until one more fits under ``models_max``."""
        while self.models_max is not None:
            resident = [s for s in self.slots if s is not slot and not s.remote and s.resident()]
            if len(resident) < self.models_max:
                return
            loaded = [s for s in resident if s.state == "loaded"]
            if not loaded:  # the others still load at start: until one is loaded
                await self._wait_change()
                continue
            victim = min(loaded, key=lambda s: (not s.idle(), s.last_used))
            log.info("unloading model %s to load %s (--models-max %d)",
                     victim.name, slot.name, self.models_max)  # fmt: skip
            await self._unload(victim)

    async def _unload(self, slot: ModelSlot) -> None:
        """Under the lock: ``slot`` unloading (its new calls wait) until no call of it
        holds a worker, then its workers stopped."""
        slot.state = "unloading"
        self.notify()
        while slot.holds_workers():
            await self._wait_change()
        await slot.workers.unload()
        slot.state = "unloaded"
        self.notify()

    async def load(self, name: str) -> ModelSlot:
        """The admin route's load: ``ensure`` by name (KeyError: no such model)."""
        slot = self._by_name[name]
        await self.ensure(slot)
        return slot

    async def unload(self, name: str) -> ModelSlot:
        """The admin route's unload: once no request of it holds a worker (its new
        ones wait, and load it again after). A remote model: ValueError."""
        slot = self._by_name[name]
        if slot.remote:
            raise ValueError(f"the model `{name}` is served by remote workers: not unloaded here")
        async with self._lock:
            if slot.state == "loaded":
                log.info("unloading model %s (asked)", slot.name)
                await self._unload(slot)
        return slot

    def states(self) -> dict[str, State]:
        return {s.name: s.state for s in self.slots}
