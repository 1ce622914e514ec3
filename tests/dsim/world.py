"""One simulated server: the real app on in-memory connections, with an in-process
scripted worker on an in-memory worker link.

What is real: ``transport.Server`` and its connection handling, the router and every API
face (``lifecycle.app._routes``), ``Frontend``, ``GenerateCall``, ``Supervisor`` (its
watchdog, audit and restarts) and ``WorkerClient``, the wire codec and ``FrameStream``.
What is simulated: the sockets (``tests.dsim.net``), the listener, and the worker, which
is ``lifecycle.testing.scripted_worker.ScriptedWorker`` run in-process
(``SimWorker``, a scripted fake that also keeps the books the invariants read).

The world also keeps the evidence: every record's transitions in virtual time (a
transition observer), every ``/abort_request`` with the records it found live, and the
worker's tokens and finishes per wire rid, numbered on one event counter so that "the
worker had finished before the abort" is an exact question.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
from collections import defaultdict
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

import anyio
import anyio.abc
import orjson

import wire
from lifecycle.app import App, _routes
from lifecycle.core.frontend import Frontend, FrontendConfig
from lifecycle.core.fsm import RawEntry, RequestRecord, set_observer
from lifecycle.core.live_calls import LiveCalls
from lifecycle.core.states import TERMINAL, Cause
from lifecycle.link.supervisor import Supervisor, SupervisorConfig
from lifecycle.link.wire_stream import FrameStream
from lifecycle.link.worker_client import WorkerClient
from lifecycle.runtime import AppConfig, Runtime
from lifecycle.testing.scripted_worker import ScriptConfig, ScriptedWorker
from lifecycle.tracing.metrics import Metrics
from tests.dsim.net import PipeEnd, SimListener, pipe
from transport import Server, ServerConfig

__all__ = ["AbortSeen", "RecordLog", "SimWorker", "World", "WorldConfig", "model"]


@functools.cache
def model() -> Any:
    """The bundled model's tokenizer, chat template and config (no weights), loaded once."""
    from modelfile.check import check_model

    return check_model(None)


_shared_metrics: list[Metrics] = []


def _metrics(fe: Frontend) -> Metrics:
    """One ``Metrics`` per process, pointed at each new frontend: building its
    prometheus registry costs a tenth of a scenario, and nothing in it steers a run."""
    if not _shared_metrics:
        _shared_metrics.append(Metrics(fe))
        return _shared_metrics[0]
    metrics = _shared_metrics[0]
    metrics.fe = fe
    fe.events.subscribe(metrics)
    return metrics


@dataclass(frozen=True, slots=True)
class WorldConfig:
    max_pending: int = 4  # worker credits: small, so requests queue in the frontend too
    max_running: int = 2
    kv_blocks: int = 64
    step_delay: float = 0.002  # virtual seconds per worker step
    prefill_chunk: int = 0
    prefill_delay: float = 0.0
    send_timeout: float = 1.0
    drain_timeout: float = 2.0
    hung_timeout: float = 3.0
    audit_interval: float = 1.0
    max_body_bytes: int = 16 * 1024
    link: tuple[str, str, int] | None = None  # (direction, action, nth frame) on the worker link


class SimWorker(ScriptedWorker):
    """The scripted worker in-process, counting what it generated per wire rid."""

    def __init__(self, config: ScriptConfig, world: World, life: int) -> None:
        super().__init__(config)
        self.world, self.life = world, life

    def step(self) -> wire.Step | None:
        frame = super().step()
        if frame is not None:
            w = self.world
            for e in frame.entries:
                key = (self.life, e.rid)
                made = len(wire.ids_to_list(e.new_ids))
                w.generated[key] += made
                if made:
                    w.generated_until[key] = anyio.current_time()
                if e.finish is not None:
                    w.finished_at[key] = w.tick()
        return frame


class SimSupervisor(Supervisor):
    """The real supervisor; one life is an in-process worker on an in-memory link."""

    def __init__(self, config: SupervisorConfig, world: World) -> None:
        super().__init__(config)
        self.world = world
        self.lives = 0
        self.life_of: dict[int, int] = {}  # id(WorkerClient) -> life
        self._kill_scope: anyio.CancelScope | None = None
        self._link: tuple[PipeEnd, PipeEnd] | None = None

    def kill_worker(self) -> bool:
        """The worker process dies now: its link resets, its state is gone."""
        if self._kill_scope is None or self._link is None:
            return False
        self._kill_scope.cancel()
        self._link[1].reset()
        return True

    async def _one_life(self, fresh: bool) -> None:
        w = self.world
        self.lives += 1
        life = self.lives
        self.status = "starting" if fresh else "restarting"
        fe_end, w_end = pipe(f"worker{life}")
        w.link_faults(fe_end, w_end)
        self._link = (fe_end, w_end)
        worker = SimWorker(w.script, w, life)
        w.workers.append(worker)
        with anyio.CancelScope() as self._life_scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._worker_life, worker, w_end)
                try:
                    with anyio.fail_after(self.config.hello_timeout):
                        client = await WorkerClient.handshake(
                            FrameStream(fe_end), self.config.max_queued
                        )
                    self.life_of[id(client)] = life
                    w.clients.append(client)
                    await self._serve(client)
                finally:
                    self.client = None
                    tg.cancel_scope.cancel()

    async def _worker_life(self, worker: SimWorker, end: PipeEnd) -> None:
        with anyio.CancelScope() as self._kill_scope:
            frames = FrameStream(end, side="worker")
            try:
                await worker.serve_connection(frames)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass
            finally:
                worker.reset()
                end.reset()


class _OrderedSet(dict[Any, None]):
    """A set that iterates in insertion order: the server's connection set, so that the
    drain visits connections in an order that replays (a set of objects iterates in
    order of their addresses, which differ from one process to the next)."""

    def add(self, item: Any) -> None:
        self[item] = None

    def discard(self, item: Any) -> None:
        self.pop(item, None)


class SimServer(Server):
    """The real server; its listener hands out in-memory connections."""

    def __init__(self, app: Any, config: ServerConfig) -> None:
        super().__init__(app, config)
        self.listener = SimListener()
        self._connections = _OrderedSet()  # type: ignore[assignment]

    async def _open_listener(self) -> Any:
        self.bound = [("sim", 0)]
        return self.listener


@dataclass(slots=True)
class AbortSeen:
    """One ``/abort_request`` as the frontend took it: when, and what it found live."""

    seq: int
    rid: str | None
    abort_all: bool
    live: list[tuple[RequestRecord, int | None, tuple[int, ...]]]  # rec, life, wire rids


@dataclass(slots=True)
class RecordLog:
    """One record as the observer saw it."""

    rec: RequestRecord
    label: str  # its client rid, else its place in the scenario (record ids are global)
    edges: list[tuple[float, str, str]] = field(default_factory=list)
    terminals: int = 0
    life: int | None = None
    wire_rids: tuple[int, ...] = ()


class _Observer:
    def __init__(self, world: World) -> None:
        self.world = world

    def transition(self, rec: RequestRecord, entry: RawEntry) -> None:
        w = self.world
        log = w.records.get(rec.id)
        if log is None:
            label = rec.client_rid or w.call_labels.get(id(w.frontend.calls.of(rec.id)))
            log = w.records[rec.id] = RecordLog(rec, label or f"#{len(w.records)}")
        detail = entry[4]
        shown = (
            detail.value if isinstance(detail, Cause) else detail if isinstance(detail, str) else ""
        )
        log.edges.append((w.now(), entry[2].value, shown))
        if entry[2] in TERMINAL:
            log.terminals += 1
        life, wire_rids = w.where(rec)
        if life is not None:  # the latest worker life that held it, kept past its close
            log.life, log.wire_rids = life, wire_rids

    def released(self, rec: RequestRecord) -> None:
        pass


class _LoggedLiveCalls(LiveCalls[Any]):
    """The real live calls, noting what each ``/abort_request`` found live."""

    world: World

    def abort(
        self, client_rid: str | None = None, *, abort_all: bool = False, owner: object = None
    ) -> int:
        w = self.world
        if abort_all:
            recs = [r for c in self.calls() for r in (run.rec for run in c.runs)]
        else:
            one = self._registry.by_client_rid(client_rid) if client_rid else None
            recs = [one] if one is not None else []
        live = [(r, *w.where(r)) for r in recs if not r.terminal]
        w.aborts.append(AbortSeen(w.tick(), client_rid, abort_all, live))
        return super().abort(client_rid, abort_all=abort_all, owner=owner)


class World:
    """Build inside a running SimLoop; ``run`` serves until cancelled."""

    def __init__(self, config: WorldConfig) -> None:
        self.config = c = config
        checked = model()
        self.script = ScriptConfig(
            step_delay=c.step_delay,
            burst=1,
            prefill_chunk=c.prefill_chunk,
            prefill_delay=c.prefill_delay,
            max_running=c.max_running,
            max_pending=c.max_pending,
            kv_blocks=c.kv_blocks,
            vocab_size=checked.config.vocab_size,
            context_length=512,
            eos_id=-1,  # never a prompt id: samples end by length, as the script says
        )
        self._seq = itertools.count(1)
        self.generated: dict[tuple[int, int], int] = defaultdict(int)
        # (life, wire rid) -> the virtual time of its last generated token
        self.generated_until: dict[tuple[int, int], float] = {}
        self.finished_at: dict[tuple[int, int], int] = {}
        self.records: dict[int, RecordLog] = {}
        self.scenario_records: dict[int, RecordLog] = {}  # records made by the scenario's clients
        self.aborts: list[AbortSeen] = []
        self.workers: list[SimWorker] = []
        self.clients: list[WorkerClient] = []
        self.link_fired: list[str] = []
        self.link_on = True
        sup_config = SupervisorConfig(
            worker="sim:0",  # "remote": stop() closes the link, never asks for an exit
            hung_timeout=c.hung_timeout,
            audit_interval=c.audit_interval,
            watchdog_interval=0.25,
            backoff=(0.05, 0.1, 0.2),
            hello_timeout=5.0,
            warmup=False,  # ready at HELLO: a warm-up generation per scenario costs ~10%
            max_queued=64 + 8,
        )
        self.supervisor = SimSupervisor(sup_config, self)
        app_config = AppConfig(
            served_model_name="sim",
            drain_timeout=c.drain_timeout,
            send_timeout=c.send_timeout,
            hung_timeout=c.hung_timeout,
            max_queued=64,
        )
        fe = Frontend(self.supervisor, checked.tokenizer, checked.config, FrontendConfig(64))
        fe.codec.inline_chars = 1 << 30  # never a thread: the schedule must replay
        calls = _LoggedLiveCalls(fe.registry)
        calls.world = self
        fe.calls = calls
        self.frontend = fe
        self.call_labels: dict[int, str] = {}  # id(call) -> its request's "user" (no rid)
        fe.events.subscribe(self)  # its opened hook
        metrics = _metrics(fe)
        # What _routes reads of a loaded Runtime, without one (it would start a worker).
        loaded = SimpleNamespace(config=app_config, frontend=fe, metrics=metrics,
                                 chat=checked.chat, model_path="")  # fmt: skip
        router, api, auth, _slot = _routes(cast(Runtime, loaded), None)
        server_config = ServerConfig(
            send_timeout=c.send_timeout,
            max_body_bytes=c.max_body_bytes,
            shutdown_timeout=1.0,
            keepalive_timeout=2.0,
            header_timeout=2.0,
            body_timeout=2.0,
        )
        self.server = SimServer(router, server_config)
        self.app = App(app_config, self.server, self.supervisor, fe, api, metrics, auth)

    # -- evidence ------------------------------------------------------------------------
    def tick(self) -> int:
        return next(self._seq)

    @staticmethod
    def now() -> float:
        return anyio.current_time()

    def where(self, rec: RequestRecord) -> tuple[int | None, tuple[int, ...]]:
        """Which worker life and wire rids hold ``rec`` (none before its submission)."""
        sub = rec.submission
        call = self.frontend.calls.of(rec.id)
        client = getattr(call, "client", None)
        if sub is None or client is None:
            return None, ()
        rid, n = getattr(sub, "rid", None), getattr(sub, "n", 1)
        if rid is None:
            return None, ()
        return self.supervisor.life_of.get(id(client)), tuple(range(rid, rid + n))

    def opened(self, call: Any) -> None:
        """Name a call of a face without rids (/v1/responses, /v1/embeddings) after the
        ``user`` field of the HTTP request whose handler opened it."""
        end = self.server.listener.serving.get(asyncio.current_task())
        conn = next((c for c in self.server._connections if c.stream is end), None)
        request = conn.channel.current if conn is not None else None
        body = getattr(request, "_cached", None)
        if body:
            user = orjson.loads(body).get("user")
            if isinstance(user, str):
                self.call_labels[id(call)] = user

    def link_faults(self, fe_end: PipeEnd, w_end: PipeEnd) -> None:
        """A frame lost or duplicated on the worker link (``WorldConfig.link``)."""
        if self.config.link is None:
            return
        direction, action, nth = self.config.link
        end = fe_end if direction == "to_worker" else w_end
        count = itertools.count(1)

        def on_send(data: bytes) -> list[bytes]:
            if not self.link_on:
                return [data]
            buf = wire.FrameBuffer()
            out: list[bytes] = []
            for payload in buf.feed(data):
                frame = wire.frame_bytes(payload)
                if next(count) == nth:
                    kind = type(wire.decode_frame(payload)).__name__
                    self.link_fired.append(f"{action} {kind} {direction}")
                    if action == "lose":
                        continue
                    out.append(frame)
                out.append(frame)
            return out

        end.on_send = on_send

    def config_link_off(self) -> None:
        self.link_on = False

    # -- running -------------------------------------------------------------------------
    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        previous = set_observer(_Observer(self))
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.supervisor.run)
                await tg.start(self.server.serve)
                await self.supervisor.wait_ready()
                task_status.started()
                await anyio.sleep_forever()
        finally:
            set_observer(previous)

    def connect(self, name: str, capacity_out: int = 1 << 20) -> PipeEnd:
        """A new client connection; refused (reset at once) once the listener closed."""
        client, server = pipe(name, capacity_out=capacity_out)
        if not self.server.listener.connect(server):
            client.reset()
        return client

    def live_books(self) -> dict[str, int]:
        """What is still held anywhere, 0 everywhere when the world is quiet."""
        fe, sup = self.frontend, self.supervisor
        client = sup.client
        worker = self.workers[-1] if self.workers else None
        return {
            "registry": len(fe.registry),
            "live_calls": len(fe.calls),
            "tombstones": fe.registry.tombstones,
            "in_flight": client.in_flight if client is not None else 0,
            "queued": client.queued if client is not None else 0,
            "worker_running": len(worker.running) if worker is not None else 0,
            "worker_waiting": len(worker.waiting) if worker is not None else 0,
            "kv_used": (worker.config.kv_blocks - worker.free_blocks) if worker is not None else 0,
            "admission": fe.admission.depth,
        }
