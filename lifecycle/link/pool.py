"""Several workers behind one frontend (``serve --dp N``): a ``WorkerPool`` of
supervisors that the frontend uses as it uses one ``Supervisor``, and the router that
picks a worker per call (docs/scaling.md).

Each worker keeps its own supervisor, credits, abort lane and restarts: a worker lost
fails only the calls it held, and the pool is ready while one of them is. The policy
picks among the ready ones:

- ``round_robin``: in turn.
- ``least_load``: the fewest requests held (in flight at the worker plus queued for it).
- ``cache_aware``: the worker that last served the longest prefix of this prompt (in
  the workers' KV blocks, whose size HELLO gives), while its load is within ``balance_abs`` requests and
  ``balance_rel`` times the least loaded one's; otherwise the least loaded. The prefix
  index is bounded (least recently used blocks go first) and forgets a worker's blocks
  when its cache is flushed (``WorkerPool.flush``).

Members join and leave at run time (``add``, ``drain`` then ``remove``: a Ray
deployment scaled by ``/replicas``). A member keeps its index for the pool's life, so
the router's ``picks``, the metrics' ``worker`` label, ``/server_info`` and traces keep
naming the same worker: one that left keeps its slot, marked ``removed``.
"""

from __future__ import annotations

import hashlib
import itertools
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import anyio
import anyio.abc

from lifecycle.link.supervisor import LoadFailed, Supervisor, supervision_info
from lifecycle.link.worker_client import WorkerClient

__all__ = ["DRAINING", "POLICIES", "REMOVED", "Router", "WorkerPool", "held"]

POLICIES = ("round_robin", "least_load", "cache_aware")
_MAX_BLOCKS = 64  # prefix blocks looked at per prompt
_INDEX_SIZE = 100_000  # prefix blocks remembered
DRAINING, REMOVED = "draining", "removed"  # a member on its way out, and one gone
_DRAIN_POLL_S = 0.05


def held(client: WorkerClient) -> int:
    """The requests a worker holds: in flight at it plus queued for it (its load)."""
    return client.in_flight + client.queued


class Router:
    def __init__(self, policy: str, balance_abs: int = 8, balance_rel: float = 1.5) -> None:
        if policy not in POLICIES:
            raise ValueError(f"router policy must be one of {', '.join(POLICIES)}")
        self.policy = policy
        self.balance_abs, self.balance_rel = balance_abs, balance_rel
        self._turn = itertools.count()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # prefix block -> worker
        self.picks: list[int] = []  # calls routed to each worker
        self._cached: list[int] = []  # prefix blocks the index gives each worker
        self.affinity_hits = 0  # cache_aware picks that followed a prefix

    def pick(self, ready: list[tuple[int, WorkerClient]], prompt: Sequence[int] | None) -> int:
        """The index (in the pool) of the worker for a call with ``prompt``."""
        while len(self.picks) < 1 + max(i for i, _ in ready):
            self.picks.append(0)
            self._cached.append(0)
        if self.policy == "round_robin":
            choice = ready[next(self._turn) % len(ready)][0]
        elif self.policy == "least_load":  # ties: the one picked least so far
            choice = min(ready, key=lambda r: (held(r[1]), self.picks[r[0]], r[0]))[0]
        else:  # a new prefix goes where the least is cached (SGLang's smallest tree)
            least = min(ready, key=lambda r: (held(r[1]), self._cached[r[0]], r[0]))
            # prefix blocks are the workers' KV blocks (HELLO's capacity; the same for all)
            block = int(ready[0][1].capacity["block_size"])
            keys = _prefix_keys(prompt, block) if prompt else []
            choice = self._follow(keys, ready, least) if keys else int(least[0])
            for k in keys:
                self._remember(k, choice)
        self.picks[choice] += 1
        return choice

    def _follow(
        self, keys: list[bytes], ready: list[tuple[int, WorkerClient]], least: tuple[int, Any]
    ) -> int:
        loads = dict((i, held(c)) for i, c in ready)
        floor = held(least[1])
        for key in reversed(keys):  # the longest prefix first
            w = self._index.get(key)
            if w is not None and w in loads:
                if loads[w] <= max(floor + self.balance_abs, floor * self.balance_rel):
                    self.affinity_hits += 1
                    return w
                break
        return int(least[0])

    @property
    def indexed_blocks(self) -> int:
        """Prefix blocks the index remembers (``/server_info``'s ``router``)."""
        return len(self._index)

    def forget(self, workers: set[int]) -> int:
        """Drop what the prefix index says of ``workers``, whose caches were flushed, so no
        call follows a prefix that is no longer cached; returns how many prefix blocks
        were dropped."""
        gone = [k for k, w in self._index.items() if w in workers]
        for k in gone:
            self._cached[self._index.pop(k)] -= 1
        return len(gone)

    def _remember(self, key: bytes, worker: int) -> None:
        old = self._index.get(key)
        if old is not None:
            self._cached[old] -= 1
        self._index[key] = worker
        self._cached[worker] += 1
        self._index.move_to_end(key)
        while len(self._index) > _INDEX_SIZE:
            _, gone = self._index.popitem(last=False)
            self._cached[gone] -= 1


def _prefix_keys(prompt: Sequence[int], block: int) -> list[bytes]:
    """One key per whole ``block``-token block of the prompt's start: a hash of all
    tokens up to the block's end (so equal keys mean equal prefixes)."""
    keys, h = [], hashlib.blake2b(digest_size=16)
    n = min(len(prompt) // block, _MAX_BLOCKS)
    data, step = array("q", prompt[: n * block]).tobytes(), block * 8
    for b in range(n):
        h.update(data[b * step : (b + 1) * step])
        keys.append(h.copy().digest())
    return keys


class WorkerPool:
    """Supervisors that look like one to the frontend: ready while any is, ``pick`` routes."""

    def __init__(self, members: list[Supervisor], router: Router) -> None:
        self.members = members
        self.router = router
        self._leaving: dict[int, str] = {}  # index -> DRAINING or REMOVED
        self._group: anyio.abc.TaskGroup | None = None  # ``run``'s, where members join
        self._stopping = anyio.Event()

    # -- which members serve -----------------------------------------------------------------
    def state(self, index: int) -> str:
        """Member ``index``'s state: draining or removed once it leaves, else its
        supervisor's status (starting, ready, restarting...)."""
        return self._leaving.get(index) or self.members[index].status

    @property
    def live(self) -> list[tuple[int, Supervisor]]:
        """The members routed to (not draining, not removed), with their indexes."""
        return [(i, s) for i, s in enumerate(self.members) if i not in self._leaving]

    # -- what the frontend and the routes read of a supervisor ----------------------------
    @property
    def ready(self) -> bool:
        return any(s.ready for _, s in self.live)

    @property
    def status(self) -> str:
        if self.ready:
            return "ready"
        live = self.live
        return live[0][1].status if live else "stopped"

    @property
    def client(self) -> WorkerClient | None:
        """A ready worker's client (for the probe and stats); None when none is ready."""
        for _, s in self.live:
            if s.ready and s.client is not None:
                return s.client
        return None

    @property
    def worker_pid(self) -> int | None:
        return self.members[0].worker_pid

    @property
    def restarts(self) -> int:
        return sum(s.restarts for s in self.members)

    @property
    def last_error(self) -> str | None:
        return next((s.last_error for _, s in self.live if s.last_error), None)

    def info(self) -> dict[str, Any]:
        live = self.live
        return {
            **supervision_info(self),
            "router": self.router.policy,
            "workers_ready": sum(s.ready for _, s in live),
            "workers": len(live),
        }

    def member_name(self, index: int) -> str:
        """How traces name worker ``index`` (``Supervisor.member_name``)."""
        return self.members[index].member_name(0)

    async def wait_listening(self) -> None:
        """Until every spawned worker listens (``Supervisor.wait_listening``)."""
        for s in self.members:
            await s.wait_listening()

    def pick(self, prompt: Sequence[int] | None = None) -> WorkerClient | None:
        """The routed worker's client for a call with ``prompt``; without one, any ready
        worker's (a readiness check: the router neither counts nor learns it)."""
        if prompt is None:
            return self.client
        ready = [(i, s.client) for i, s in self.live if s.ready and s.client]
        if not ready:
            return None
        i = self.router.pick(ready, prompt)  # type: ignore[arg-type]
        return self.members[i].client

    async def flush(self, timeout: float = 30.0) -> list[tuple[int, bool, str]]:
        """``/flush_cache`` on every ready worker, at once: ``(index, ok, message)`` each.
        The router forgets the prefixes of the workers that flushed. A worker not ready
        is left out: it comes back from a restart with an empty cache."""
        out: list[tuple[int, bool, str]] = []

        async def one(i: int, client: WorkerClient) -> None:
            try:
                ok, message = await client.flush(timeout)
            except (TimeoutError, ConnectionError) as exc:
                ok, message = False, f"flush failed: {exc or type(exc).__name__}"
            out.append((i, ok, message))

        async with anyio.create_task_group() as tg:
            for i, s in self.live:
                if s.ready and s.client is not None:
                    tg.start_soon(one, i, s.client)
        self.router.forget({i for i, ok, _ in out if ok})
        return sorted(out)

    # -- lifecycle ---------------------------------------------------------------------------
    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            self._group = tg
            for s in self.members:
                tg.start_soon(s.run)
            try:
                await self._stopping.wait()  # members may join until the pool stops
            finally:
                self._group = None

    def add(self, member: Supervisor) -> int:
        """A member joins (its supervisor started, routed to once ready); its index.
        RuntimeError once the pool stopped."""
        if self._group is None or self._stopping.is_set():
            raise RuntimeError("the pool is not running")
        self.members.append(member)
        self._group.start_soon(member.run)
        return len(self.members) - 1

    def drain(self, index: int) -> None:
        """No call is routed to member ``index`` any more (``remove`` ends it)."""
        self._leaving.setdefault(index, DRAINING)

    async def remove(self, index: int) -> None:
        """Member ``index`` drained (``drain``), then, once the calls it holds have
        finished whole (its worker holds none, none queued for it), its supervisor
        stopped; its slot stays, marked removed, and the router forgets its prefixes."""
        self.drain(index)
        member = self.members[index]
        while (c := member.client) is not None and (c.busy or c.queued):
            await anyio.sleep(_DRAIN_POLL_S)
        await member.stop()
        self._leaving[index] = REMOVED
        self.router.forget({index})

    async def stop(self) -> None:
        self._stopping.set()
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as tg:
                for s in self.members:
                    tg.start_soon(s.stop)

    async def load(self) -> None:
        """Every member's worker started and ready (``Supervisor.load``, at once); the
        first ``LoadFailed`` when one gave up, the others unloaded again."""
        failed: list[BaseException] = []

        async def one(s: Supervisor) -> None:
            try:
                await s.load()
            except LoadFailed as exc:
                failed.append(exc)

        async with anyio.create_task_group() as tg:
            for s in self.members:
                tg.start_soon(one, s)
        if failed:
            await self.unload()
            raise failed[0]

    async def unload(self) -> None:
        """Every member's worker stopped (``Supervisor.unload``, at once)."""
        async with anyio.create_task_group() as tg:
            for s in self.members:
                tg.start_soon(s.unload)

    async def wait_ready(self) -> WorkerClient:
        while True:
            client = self.client
            if client is not None:
                return client
            with anyio.move_on_after(0.05):
                await self.members[0].wait_ready()
