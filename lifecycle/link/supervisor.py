"""Supervision: start the worker, wait for HELLO, warm up, report ready, restart on loss.

One ``Supervisor`` owns one worker connection at a time. Readiness is a fact of this
process (SGLang §5.3, §6.5.3): it turns true only after the worker's HELLO *and* one real
generation have come back through the same path clients use, and false the moment the
connection is lost or the worker stops making progress while it has work (hung).

Knows nothing of HTTP.
"""

from __future__ import annotations

import logging
import os
import ssl
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.abc

from lifecycle.core.ports import generate_probe
from lifecycle.link.wire_stream import FrameStream, client_tls_context, connect, parse_address
from lifecycle.link.worker_client import DEFAULT_MAX_QUEUED, WorkerClient
from wire import WireError
from wire.child import SUPERVISED

__all__ = [
    "STOP_GRACE",
    "LoadFailed",
    "Supervisor",
    "SupervisorConfig",
    "WarmupFailed",
    "supervision_info",
]

log = logging.getLogger("lifecycle.link.supervisor")


STOP_GRACE = 3.0  # seconds a spawned worker has to exit after SHUTDOWN, by default


@dataclass(frozen=True, slots=True)
class SupervisorConfig:
    worker: str | None = None  # address of a worker started elsewhere; None: spawn one
    # Where the worker started elsewhere is now, asked before each connection (a Ray
    # replica's address moves with its actor; ``worker`` then names it, e.g. ray:0).
    locate: Callable[[], Awaitable[str]] | None = None
    worker_module: str = "gpu.worker"  # spawned as: python -m <module> --listen unix:...
    worker_args: tuple[str, ...] = ()  # e.g. ("--model", path, "--device", "cpu")
    hello_timeout: float = 300.0  # loading a model takes a while
    warmup: bool = True
    warmup_timeout: float = 300.0
    hung_timeout: float = 60.0  # has work, no frame for this long: hung
    max_queued: int = DEFAULT_MAX_QUEUED  # the dispatch queue's bound (WorkerClient)
    watchdog_interval: float = 0.5
    audit_interval: float = 5.0  # while work is held: ask the worker what never arrived
    backoff: tuple[float, ...] = (0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
    stable_after: float = 30.0  # a life this long resets the back-off
    token: str | None = None  # answers a remote worker's CHALLENGE (wire.auth)
    tls_ca: str | None = None  # CA file a tls: worker's certificate is checked with
    # Seconds a spawned worker has to exit after its SHUTDOWN before it is killed: what
    # it does then (a disk prefix cache's spill of its blocks, gpu/runtime/disk_prefix.py).
    stop_grace: float = STOP_GRACE


AUDIT_TIMEOUT = 5.0  # seconds an AUDIT may wait for the worker's step to end


class WarmupFailed(RuntimeError):
    pass


class WorkerRefusedToStart(OSError):
    """A spawned worker exited with status 2 before its HELLO: it refused its model or
    its options (``gpu/worker/process.py`` prints why, one line, to the stderr it shares with
    this process); or it failed at start-up twice in a row with the same status.
    Starting it again would fail again: it is not restarted."""


class LoadFailed(RuntimeError):
    """A worker started by ``Supervisor.load`` gave up before it was ready (it refused
    its model or options, or failed at start-up twice the same way): the supervisor is
    unloaded again, and the message says why."""


class _StartFailed(OSError):
    """A spawned worker exited before its HELLO with ``status`` (not 2)."""

    def __init__(self, status: int) -> None:
        super().__init__(f"the worker exited with status {status} at start-up")
        self.status = status


REFUSED_STATUS = 2  # gpu.worker's exit status for a refused model file or options
_REFUSED = (
    "the worker refused its model or options at start-up (status 2; its error line is in "
    "this process's log)"
)
_EXIT_WAIT_S = 2.0  # a spawned worker's connection ended before HELLO: is it exiting?


class Supervisor:
    """Keeps one worker running from ``run`` to ``stop``. ``loaded=False`` builds it
    unloaded (a model loaded on demand, ``lifecycle.link.model_set``): no worker until
    ``load()``; ``unload()`` stops the worker again, its memory given back, and the
    supervisor waits for the next ``load()``."""

    def __init__(
        self, config: SupervisorConfig = SupervisorConfig(), *, loaded: bool = True
    ) -> None:
        self.config = config
        self.client: WorkerClient | None = None
        self.ready = False
        # starting | ready | restarting | hung | failed | stopped | unloaded
        self.status = "starting" if loaded else "unloaded"
        self.restarts = 0
        self.last_error: str | None = None
        self.worker_pid: int | None = None
        self.address: str | None = config.worker  # where it connects (``locate``'s last)
        self.on_ready: list[Callable[[WorkerClient], None]] = []
        self._ready_event = anyio.Event()
        self._stopping = False
        self._life_scope: anyio.CancelScope | None = None
        # Set once a spawned worker listens (it has taken its options and device) or
        # this supervisor gave up; a remote worker's is set from the start.
        self._listening = anyio.Event()
        if config.worker is not None or not loaded:
            self._listening.set()
        # Whether a worker is wanted (False: unloaded); ``_wanted_event`` wakes ``run``.
        self._wanted = loaded
        self._wanted_event = anyio.Event()
        self._on_demand = not loaded  # a give-up unloads it (load() fails), not failed
        self._changed = anyio.Event()  # pulsed on ready, unloaded and given up

    @property
    def members(self) -> list[Supervisor]:
        """The supervisors behind this one (a ``WorkerPool`` has several)."""
        return [self]

    def member_name(self, index: int) -> str:
        """How traces name the worker: its address, or its pid when it runs here."""
        return self.address or f"local pid {self.worker_pid}"

    def pick(self, prompt: Sequence[int] | None = None) -> WorkerClient | None:
        """The worker's client for a call (``prompt`` routes in a pool), when ready."""
        return self.client if self.ready else None

    async def wait_ready(self) -> WorkerClient:
        while not (self.ready and self.client is not None):
            await self._ready_event.wait()
        return self.client

    async def wait_listening(self) -> None:
        """Until the spawned worker listens: it took its options and its device (it
        listens before it loads the model). Raises ``WorkerRefusedToStart`` when it
        refused them, or failed at start-up twice the same way."""
        await self._listening.wait()
        if self.status == "failed":
            raise WorkerRefusedToStart(self.last_error or "the worker did not start")

    async def run(self) -> None:
        """Keep a worker connected and ready until cancelled or ``stop()``."""
        attempt = 0
        failed_start: int | None = None  # the status of the last life's failed start
        fresh = not self.restarts  # this life is a start or a load, not a restart
        try:
            while not self._stopping:
                if not self._wanted:  # unloaded until load() (or stop())
                    self.status, attempt, failed_start = "unloaded", 0, None
                    self._set_ready(False)
                    self._pulse()
                    await self._wanted_event.wait()
                    fresh = True  # a load, not a restart
                    continue
                started = time.monotonic()
                start_failed: int | None = None
                try:
                    await self._one_life(fresh)
                except _StartFailed as exc:
                    if exc.status == failed_start:  # the same again: it would loop
                        if self._give_up(WorkerRefusedToStart(f"{exc} twice in a row")):
                            return
                        continue
                    start_failed = exc.status
                    self.last_error = str(exc)
                    log.error("worker failed: %s", exc)
                except WorkerRefusedToStart as exc:
                    if self._give_up(exc):
                        return
                    continue
                except (OSError, TimeoutError, WireError, WarmupFailed, anyio.EndOfStream) as exc:
                    self.last_error = f"{type(exc).__name__}: {exc}"
                    log.error("worker failed: %s", self.last_error)
                except Exception as exc:  # a bug of ours: logged, and the server stays up
                    self.last_error = f"{type(exc).__name__}: {exc}"
                    log.exception("supervising the worker failed")
                failed_start = start_failed
                self._set_ready(False)
                if self._stopping:
                    break
                if not self._wanted:  # unload(): no restart
                    continue
                if time.monotonic() - started > self.config.stable_after:
                    attempt = 0
                delay = self.config.backoff[min(attempt, len(self.config.backoff) - 1)]
                attempt += 1
                self.restarts += 1
                fresh = False
                self.status = "restarting"
                log.warning("restarting the worker in %.1fs (restart %d)", delay, self.restarts)
                await anyio.sleep(delay)
        finally:
            if self.status != "failed":
                self.status = "stopped"
            self._set_ready(False)
            self._listening.set()
            self._pulse()

    def _give_up(self, exc: WorkerRefusedToStart) -> bool:
        """Not restarted: failed, and True (``run`` ends); a worker started by ``load()``
        is unloaded instead (that load fails with this error), and False."""
        self.last_error = str(exc)
        log.error("%s: not restarting it", exc)
        self._set_ready(False)
        self._listening.set()
        if self._on_demand:
            self._wanted, self._wanted_event = False, anyio.Event()
            return False
        self.status = "failed"
        self._pulse()
        return True

    async def load(self) -> None:
        """Start the worker of an unloaded supervisor (a no-op for one that has a
        worker) and wait until it is ready; ``LoadFailed`` when it gave up first."""
        self._on_demand = True  # from now on, a give-up unloads it
        if not self._wanted and not self._stopping:
            self._wanted, self.last_error, self.status = True, None, "starting"
            self._wanted_event.set()
        while not self.ready:
            changed = self._changed
            if self._stopping:
                raise LoadFailed("the server is shutting down")
            if not self._wanted or self.status == "failed":
                raise LoadFailed(self.last_error or "the worker did not start")
            await changed.wait()

    async def unload(self) -> None:
        """Stop the worker and wait until its process ended (its memory given back);
        ``run`` then waits, unloaded, for the next ``load()``. What it still held is
        aborted: the caller unloads a worker that holds nothing."""
        if not self._wanted:
            return
        self._wanted, self._wanted_event = False, anyio.Event()
        await self._end_life()
        while self.status != "unloaded" and not self._stopping and not self._wanted:
            changed = self._changed
            await changed.wait()

    def _pulse(self) -> None:
        """Wake whoever waits for a change of state (``load``, ``unload``)."""
        self._changed.set()
        self._changed = anyio.Event()

    async def stop(self) -> None:
        """End ``run``: a spawned worker is asked to shut down; a remote one (not ours to
        stop) sees the connection close, frees what it held and waits for the next
        frontend."""
        self._stopping = True
        self._wanted_event.set()  # an unloaded one's run ends
        await self._end_life()

    async def _end_life(self) -> None:
        """End the worker's life (``stop``, ``unload``): what it holds aborted, a spawned
        worker asked to shut down, a remote one's connection closed (the worker is not
        ours to stop: it frees what it held and waits for the next frontend)."""
        client = self.client
        if client is not None:
            client.abort_all()
            if self.config.worker is None:
                await client.shutdown()
            else:
                with anyio.CancelScope(shield=True):
                    await client.close()
        if self._life_scope is not None:
            self._life_scope.cancel()

    # -- one worker's life ---------------------------------------------------------------
    async def _one_life(self, fresh: bool) -> None:
        self.status = "starting" if fresh else "restarting"
        with (
            anyio.CancelScope() as self._life_scope,
            tempfile.TemporaryDirectory(prefix="lifecycle-") as tmp,
        ):
            proc: anyio.abc.Process | None = None
            address = self.config.worker
            if self.config.locate is not None:
                address = self.address = await self.config.locate()
            if address is None:
                address = f"unix:{os.path.join(tmp, 'worker.sock')}"
                proc = await self._spawn(address)
            try:
                client = await self._handshake(address, proc)
                self.worker_pid = client.pid or (proc.pid if proc else None)
                await self._serve(client)
            finally:
                self.client = None
                if proc is not None:
                    await _reap(
                        proc, self.config.stop_grace if self._stopping or not self._wanted else 0.0
                    )

    async def _handshake(self, address: str, proc: anyio.abc.Process | None) -> WorkerClient:
        """Connected and HELLO read. A spawned worker listens before it loads its model,
        so one that ends before HELLO (a model it refuses: status 2) ends the connection
        first: its exit status says which kind of failure that was."""
        try:
            frames = await self._connect(address, proc)
            with anyio.fail_after(self.config.hello_timeout):
                return await WorkerClient.handshake(
                    frames, self.config.max_queued, self.config.token
                )
        except (WorkerRefusedToStart, _StartFailed):
            raise
        except Exception as exc:
            if proc is None:
                raise
            with anyio.move_on_after(_EXIT_WAIT_S):
                await proc.wait()
            if (ended := _start_failure(proc)) is not None:
                raise ended from exc
            raise

    async def _spawn(self, address: str) -> anyio.abc.Process:
        # --supervised: Ctrl-C and a group SIGTERM drain this process; the worker's stop
        # is the SHUTDOWN after the drain (wire/child.py)
        argv = [sys.executable, "-m", "wire.child", SUPERVISED, self.config.worker_module]
        argv += ["--listen", address]
        argv += list(self.config.worker_args)
        log.info("starting worker: %s", " ".join(argv))
        return await anyio.open_process(argv, stdin=None, stdout=None, stderr=None)

    async def _connect(self, address: str, proc: anyio.abc.Process | None) -> FrameStream:
        """Connect, retrying while the worker starts: every 50 ms for a spawned one, with
        a back-off up to 2 s for a remote one (which may be down for a while); one whose
        address is located (``SupervisorConfig.locate``) is located again each time."""
        addr = parse_address(address)
        tls = client_tls_context(self.config.tls_ca) if addr.tls else None
        delay = 0.05
        with anyio.fail_after(self.config.hello_timeout):
            while True:
                if proc is not None and (ended := _start_failure(proc)) is not None:
                    raise ended
                try:
                    frames = await connect(addr, tls)
                    self._listening.set()
                    return frames
                except ssl.SSLError:
                    raise  # a certificate or protocol problem: retrying at once will not help
                except OSError as exc:
                    if proc is None:
                        self.last_error = f"cannot reach the worker at {address}: {exc}"
                    await anyio.sleep(delay)
                    if proc is None:
                        delay = min(delay * 2, 2.0)
                    if self.config.locate is not None:  # a replica Ray placed again may
                        address = self.address = await self.config.locate()  # have moved
                        addr = parse_address(address)
                        tls = client_tls_context(self.config.tls_ca) if addr.tls else None

    async def _serve(self, client: WorkerClient) -> None:
        self.client = client
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._warm_up, client)
            tg.start_soon(self._watchdog, client)
            reason = await client.run()
            tg.cancel_scope.cancel()
        self.last_error = reason if self._wanted else None
        if not self._stopping and self._wanted:
            log.error("worker connection ended: %s", reason)

    async def _warm_up(self, client: WorkerClient) -> None:
        if self.config.warmup:
            with anyio.fail_after(self.config.warmup_timeout):
                ok, detail = await generate_probe(client)
            if not ok:
                self.last_error = f"warm-up failed: {detail}"
                log.error(self.last_error)
                await client.close()
                return
        self.status = "ready"
        self._set_ready(True)
        for callback in self.on_ready:
            callback(client)

    async def _watchdog(self, client: WorkerClient) -> None:
        """Hung: work held and no progress for ``hung_timeout``. Before that verdict, and
        every ``audit_interval`` while work is held, the worker is asked which requests
        it never received (``WorkerClient.audit``): those end alone, the worker stays."""
        cfg = self.config
        limit_ns = int(cfg.hung_timeout * 1e9)
        audit_ns = int(min(cfg.audit_interval, cfg.hung_timeout) * 1e9)
        last_audit = time.monotonic_ns()
        while True:
            await anyio.sleep(cfg.watchdog_interval)
            now = time.monotonic_ns()
            if not client.busy:
                last_audit = now
                continue
            stalled = now - client.last_progress_ns > limit_ns
            if not stalled and now - last_audit < audit_ns:
                continue
            last_audit = now
            try:
                await client.audit(timeout=min(cfg.hung_timeout / 2, AUDIT_TIMEOUT))
            except (TimeoutError, ConnectionError):
                pass  # no answer: a stalled worker is hung
            if stalled and client.busy and time.monotonic_ns() - client.last_progress_ns > limit_ns:
                self.status = "hung"
                self.last_error = f"no progress for {cfg.hung_timeout:.1f}s with work held"
                log.error("worker hung: %s; restarting it", self.last_error)
                self._set_ready(False)
                await client.close()
                return

    def _set_ready(self, ready: bool) -> None:
        self.ready = ready
        if ready:
            self._ready_event.set()
            self._pulse()
        elif self._ready_event.is_set():
            self._ready_event = anyio.Event()

    def info(self) -> dict[str, Any]:
        return supervision_info(self)


def _start_failure(proc: anyio.abc.Process) -> OSError | None:
    """What a spawned worker's exit before HELLO was: a refusal (status 2, never
    restarted) or another failed start (restarted once); None while it runs."""
    if proc.returncode is None:
        return None
    if proc.returncode == REFUSED_STATUS:
        return WorkerRefusedToStart(_REFUSED)
    return _StartFailed(proc.returncode)


async def _reap(proc: anyio.abc.Process, grace: float) -> None:
    with anyio.CancelScope(shield=True):
        if proc.returncode is None and grace:
            with anyio.move_on_after(grace):
                await proc.wait()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def supervision_info(sup: Any) -> dict[str, Any]:
    """What ``/server_info`` shows of a supervisor, or of a ``WorkerPool`` of them."""
    return {
        "status": sup.status,
        "ready": sup.ready,
        "restarts": sup.restarts,
        "last_error": sup.last_error,
        "pid": sup.worker_pid,
    }
