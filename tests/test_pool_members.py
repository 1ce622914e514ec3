"""Members that join and leave a ``WorkerPool`` at run time (lifecycle/link/pool.py), on
stand-in supervisors: a member added is routed to once ready; one drained is no longer
picked, and ``remove`` waits for what it holds before stopping it; every member keeps
its index, a removed one its slot."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from lifecycle.link.pool import Router, WorkerPool


class _Client:
    def __init__(self) -> None:
        self.in_flight = self.queued = 0
        self.capacity = {"block_size": 4}

    @property
    def busy(self) -> bool:
        return bool(self.in_flight)


class _Member:
    """What the pool reads of a supervisor."""

    def __init__(self) -> None:
        self.client: _Client | None = _Client()
        self.ready, self.status, self.restarts = True, "ready", 0
        self.last_error, self.worker_pid = None, None
        self._stopped = anyio.Event()

    async def run(self) -> None:
        await self._stopped.wait()

    async def stop(self) -> None:
        self.ready, self.client, self.status = False, None, "stopped"
        self._stopped.set()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _picks(pool: WorkerPool, n: int) -> list[int]:
    members: list[Any] = pool.members
    return [members.index(_owner(pool, pool.pick([1, 2, 3]))) for _ in range(n)]


def _owner(pool: WorkerPool, client: Any) -> Any:
    return next(m for m in pool.members if m.client is client)


@pytest.mark.anyio
async def test_members_join_drain_and_leave_keeping_their_indexes() -> None:
    pool = WorkerPool([_Member(), _Member()], Router("round_robin"))  # type: ignore[list-item]
    async with anyio.create_task_group() as tg:
        tg.start_soon(pool.run)
        await anyio.sleep(0)
        assert pool.add(_Member()) == 2  # type: ignore[arg-type]
        assert sorted(_picks(pool, 3)) == [0, 1, 2]
        held = pool.members[1].client
        assert held is not None
        held.in_flight = 1
        pool.drain(1)
        assert pool.state(1) == "draining" and 1 not in _picks(pool, 6)
        removing = anyio.Event()

        async def remove() -> None:
            await pool.remove(1)
            removing.set()

        tg.start_soon(remove)
        await anyio.sleep(0.2)
        assert not removing.is_set() and pool.members[1].client is held  # waits for it
        held.in_flight = 0
        with anyio.fail_after(2):
            await removing.wait()
        assert [pool.state(i) for i in range(3)] == ["ready", "removed", "ready"]
        assert pool.info()["workers"] == 2 and len(pool.router.picks) == 3
        assert sorted(set(_picks(pool, 4))) == [0, 2]
        await pool.stop()
    with pytest.raises(RuntimeError, match="not running"):
        pool.add(_Member())  # type: ignore[arg-type]
