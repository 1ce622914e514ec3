"""Running seeds: one scenario per seed on a fresh ``SimLoop``, then the invariants.

``run_seed(seed)`` plays ``draw(seed)`` on a loop seeded with the same number and
returns a ``Result``: the violations (invariant name and what broke), the scenario's
shape, and the trace (records' transitions in virtual time, aborts, faults, answers)
that ``python -m tests.dsim --seed N`` prints.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import anyio
import orjson

from tests.dsim import invariants
from tests.dsim.clients import Answer, HttpClient, request_bytes
from tests.dsim.known import known_reason
from tests.dsim.loop import SimLoop, virtual_clock
from tests.dsim.scenario import Played, Scenario, draw, play_conn, play_control
from tests.dsim.world import World
from wire.faults import FaultPlan, install, installed

__all__ = ["Result", "replay_command", "run_seed"]

CLIENT_BUDGET = 30.0  # virtual seconds every client must be done in
SETTLE = 20.0  # virtual seconds the server may take to hold nothing once clients are done


def replay_command(seed: int) -> str:
    return f".venv/bin/python -m tests.dsim --seed {seed}"


@dataclass(slots=True)
class Result:
    seed: int
    shape: tuple[Any, ...]
    violations: list[tuple[str, str]] = field(default_factory=list)
    trace: list[str] = field(default_factory=list)
    virtual_s: float = 0.0
    passes: int = 0
    real_s: float = 0.0
    known: str | None = None  # every violation is a listed finding (``tests.dsim.known``)

    @property
    def ok(self) -> bool:
        return not self.violations or self.known is not None


def run_seed(seed: int, *, keep_trace: bool = False) -> Result:
    scn = draw(seed)
    result = Result(seed, scn.shape())
    loop = SimLoop(seed)
    t0 = time.perf_counter()
    previous_level = logging.root.manager.disable
    logging.disable(logging.CRITICAL)  # the product logs every fault it meets, by design
    collecting = gc.isenabled()
    gc.disable()  # a cycle collected mid-run would finalize async generators at a moment
    try:  # no seed decides; reference counting alone frees objects at points that replay
        with virtual_clock(seed), installed(FaultPlan(list(scn.rules))) as plan:
            anyio.run(
                _main, scn, result, plan, keep_trace,
                backend="asyncio", backend_options={"loop_factory": lambda: loop},
            )  # fmt: skip
    finally:
        logging.disable(previous_level)
        if collecting:
            gc.enable()
    result.real_s = time.perf_counter() - t0
    result.passes = loop.passes
    return result


async def _main(scn: Scenario, result: Result, plan: FaultPlan, keep_trace: bool) -> None:
    world = World(scn.world)
    played = Played()
    async with anyio.create_task_group() as tg:
        await tg.start(world.run)
        t0 = anyio.current_time()
        with anyio.move_on_after(CLIENT_BUDGET) as budget:
            async with anyio.create_task_group() as clients:
                for conn in scn.conns:
                    clients.start_soon(play_conn, world, conn, played)
                for at, action, rid in scn.controls:
                    clients.start_soon(play_control, world, at, action, rid, played)
        if budget.cancelled_caught:
            played.hung = [q.label for q in scn.reqs if not _settled(played, q.label)]
        install(None)  # faults are the scenario's: the checks below run on a sound server
        world.config_link_off()
        await _settle(world)
        world.scenario_records = dict(world.records)  # the reuse batch is not the scenario's
        if not played.drained and scn.reuse:
            played.reuse = await _reuse_rids(world)
            await _settle(world)
        result.virtual_s = anyio.current_time() - t0
        result.violations = invariants.check(scn, world, played, plan)
        if result.violations:
            result.known = known_reason(world.link_fired, {n for n, _ in result.violations})
        if keep_trace or result.violations:
            result.trace = trace_lines(scn, world, played, plan)
        tg.cancel_scope.cancel()


def _settled(played: Played, label: str) -> bool:
    a = played.answers.get(label)
    return a is None or a.complete or a.left or a.cut is not None


async def _settle(world: World) -> None:
    """Wait (virtual time) until nothing is held and a worker is connected and ready."""
    sup = world.supervisor
    with anyio.move_on_after(SETTLE):
        while True:
            await anyio.sleep(0.05)
            quiet = not any(world.live_books().values())
            if quiet and (
                world.server.draining or sup.ready and sup.client and not sup.client.closed
            ):
                return


async def _reuse_rids(world: World) -> Answer | None:
    """Every client rid the scenario used, in one batch: each must be free again."""
    rids = sorted({log.rec.client_rid for log in world.records.values() if log.rec.client_rid})
    if not rids:
        return None
    body = {"rid": rids, "input_ids": [[5]] * len(rids), "sampling_params": {"max_new_tokens": 1}}
    end = world.connect("reuse")
    client = HttpClient(end)
    answer = Answer("reuse")
    with anyio.move_on_after(10.0):
        if await client.send(request_bytes("POST", "/generate", orjson.dumps(body))):
            await client.read_response(answer, "POST")
    await end.aclose()
    return answer


def trace_lines(scn: Scenario, world: World, played: Played, plan: FaultPlan) -> list[str]:
    out = [f"scenario: {scn}"]
    for log in world.scenario_records.values():
        rec = log.rec
        edges = " ".join(f"{t:.4f}:{s}" + (f"({d})" if d else "") for t, s, d in log.edges)
        out.append(
            f"record {log.label} life={log.life} wire={list(log.wire_rids)} "
            f"tokens={rec.tokens} terminals={log.terminals} {edges}"
        )
    for a in world.aborts:
        live = [(r.client_rid, r.state.value) for r, _, _ in a.live]
        out.append(f"abort seq={a.seq} rid={a.rid} all={a.abort_all} live={live}")
    for f in plan.log:
        out.append(f"fault {f.point} {f.action}")  # its rid is a process-wide record id
    out += [f"link {x}" for x in world.link_fired]
    for label, a in played.answers.items():
        out.append(
            f"answer {label}: status={a.status} complete={a.complete} left={a.left} "
            f"cut={a.cut} body={a.body[:300]!r} events={str(a.events)[:300]}"
        )
    out.append(f"drained={played.drained} killed={played.killed} aborts={played.abort_status}")
    out.append(f"books={world.live_books()} restarts={world.supervisor.restarts}")
    if played.reuse is not None:
        out.append(f"reuse: status={played.reuse.status} body={played.reuse.body[:200]!r}")
    return out
