"""A deterministic, seeded simulation of clients and faults against the real server.

Each seed picks one scenario (``Scenario.from_seed``): an API (native ``/generate``,
``/v1/completions``, ``/v1/chat/completions``, the ``/v1/stream`` WebSocket), a mode
(unary, stream, batch, n=2), a client behaviour (complete, or leave with FIN or RST at
one point, stall, reuse its rid, cancel) and a fault. Scenarios run a few at a time
against ONE in-process server (``lifecycle.app.serve_app``) on real sockets, with the
real scripted worker process behind it; after every group, once the server settled, the
invariants are checked: every request reached exactly one terminal state, nothing is
left in the registry or the worker, every complete reply holds the scripted output.

A seed chooses the scenario; the interleaving is real time, so a failing seed replays
the same client actions, not the same schedule (it usually fails again)::

    python -m tests.simulation --seed 1234
    python -m tests.simulation --seeds 2000 --start 0 --concurrency 4
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import anyio

from lifecycle.app import App, AppConfig, serve_app
from lifecycle.core.fsm import RequestRecord, set_observer
from lifecycle.core.states import TERMINAL
from tests.sim_flows import Expect, Outcome, http_flow, ws_flow
from tests.sim_world import Books, TerminalCounter, books, settle
from wire.faults import FaultPlan, FaultRule, installed

__all__ = ["Scenario", "SimReport", "main", "run_scenarios"]

APIS = ("native", "completions", "chat", "ws")
MODES = ("unary", "stream", "batch", "n2")
WS_KINDS = ("generate", "completions", "chat")
HTTP_BEHAVIOURS = (
    "complete", "partial_body", "after_send", "while_queued", "during_prefill",
    "after_head", "between_chunks", "after_last", "stall", "reuse_rid",
)  # fmt: skip
WS_BEHAVIOURS = (
    "complete", "partial_body", "after_send", "while_queued", "during_prefill",
    "between_chunks", "after_last", "stall", "reuse_rid", "ws_cancel", "ws_close",
)  # fmt: skip
# Faults are weighted, not uniform: each runs its scenario alone and a hung or killed
# worker costs a restart, so "none" keeps most of the run concurrent.
FAULTS = ("none", "dispatch_drop", "frame_recv_corrupt", "client_write_drop", "kill_worker")
FAULT_WEIGHTS = (84, 3, 4, 5, 4)
WORDS = ("alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "seven", "blue", "why")

SEND_TIMEOUT = 0.5
HUNG_TIMEOUT = 0.75
MAX_PENDING, MAX_RUNNING, MAX_QUEUED = 8, 4, 64
WORKER_ARGS = ("--step-delay", "0.002", "--prefill-delay", "0.005")
SETTLE = 3.0  # seconds a group may take to settle once its clients are done
CLIENT_TIMEOUT = 20.0
BLOCKERS = MAX_PENDING + 2  # "while_queued": enough requests to fill the worker's credits
BLOCKER_TOKENS = 12


def replay(seed: int) -> str:
    return f"python -m tests.simulation --seed {seed}"


@dataclass(frozen=True, slots=True)
class Scenario:
    seed: int
    api: str  # native | completions | chat | ws
    kind: str  # the body's shape: native | completions | chat
    mode: str
    stream: bool
    behaviour: str
    rst: bool  # leave with RST (SO_LINGER 0) rather than FIN
    fault: str
    max_new: int
    prompts: tuple[tuple[int, ...], ...]
    texts: tuple[str, ...]
    k: int  # between_chunks: bytes (HTTP) or deltas (WebSocket) read before leaving
    delay: float  # how long after sending a client leaves (early points)
    fault_nth: int
    fault_delay: float

    @classmethod
    def from_seed(cls, seed: int) -> Scenario:
        r = random.Random(seed)
        api = r.choice(APIS)
        kind = {"native": "native", "ws": ""}.get(api, api) or r.choice(WS_KINDS)
        kind = "native" if kind == "generate" else kind
        mode = r.choice(MODES if kind != "chat" else ("unary", "stream", "n2"))
        behaviour = r.choice(WS_BEHAVIOURS if api == "ws" else HTTP_BEHAVIOURS)
        batch = 2 if mode == "batch" else 1
        return cls(
            seed=seed,
            api=api,
            kind=kind,
            mode=mode,
            stream=api == "ws" or mode == "stream" or (mode != "unary" and r.random() < 0.5),
            behaviour=behaviour,
            rst=r.random() < 0.5,
            fault=r.choices(FAULTS, weights=FAULT_WEIGHTS)[0],
            max_new=128 if behaviour == "stall" else r.randint(4, 64),
            prompts=tuple(
                tuple(r.randint(10, 4000) for _ in range(r.randint(1, 5))) for _ in range(batch)
            ),
            texts=tuple(
                " ".join(r.choice(WORDS) for _ in range(r.randint(1, 4))) for _ in range(batch)
            ),
            k=r.randint(1, 6) if api == "ws" else r.randint(1, 1500),
            delay=r.choice((0.0, r.uniform(0.0, 0.003), r.uniform(0.003, 0.03))),
            fault_nth=r.randint(1, 4),
            fault_delay=r.uniform(0.0, 0.04),
        )

    @property
    def alone(self) -> bool:
        """Process-global faults run alone, so no other scenario is blamed for them."""
        return self.fault != "none"

    @property
    def rid(self) -> str:
        return f"sim-{self.seed}"

    def describe(self) -> str:
        how = "RST" if self.rst else "FIN"
        api = f"ws/{self.kind}" if self.api == "ws" else self.api
        stream = " stream" if self.stream else ""
        return (
            f"seed {self.seed}: {api} {self.mode}{stream}, {self.behaviour} ({how}, k={self.k}, "
            f"delay={self.delay * 1000:.1f} ms), fault {self.fault}, max_new {self.max_new}"
        )

    def body(self, rid: str) -> dict[str, Any]:
        n = 2 if self.mode == "n2" else 1
        many = self.mode == "batch"
        if self.kind == "native":
            ids = [list(p) for p in self.prompts]
            sampling = {"max_new_tokens": self.max_new, "ignore_eos": True, "n": n}
            body = {"input_ids": ids if many else ids[0], "sampling_params": sampling}
            if self.behaviour == "stall":  # cumulative logprob frames: megabytes, not kilobytes
                body.update(return_logprob=True, top_logprobs_num=20)
        else:
            body = {"max_tokens": self.max_new, "ignore_eos": True, "n": n}
            if self.kind == "completions":
                body["prompt"] = list(self.texts) if many else self.texts[0]
            else:
                body["messages"] = [{"role": "user", "content": self.texts[0]}]
        body["rid"] = rid
        if self.api != "ws":
            body["stream"] = self.stream
        return body

    def path(self) -> str:
        return {
            "native": "/generate",
            "completions": "/v1/completions",
            "chat": "/v1/chat/completions",
        }[self.kind]

    def expect(self) -> Expect:
        n = 2 if self.mode == "n2" else 1
        allowed = {503} | ({500, 503, 504} if self.fault != "none" else set())
        return Expect(
            api=self.kind,
            stream=self.stream,
            prompts=[list(p) for p in self.prompts] if self.kind == "native" else None,
            samples=len(self.prompts) * n,
            max_new=self.max_new,
            n=n,
            allowed=frozenset(allowed),
            cut_ok=self.fault in ("client_write_drop", "kill_worker", "frame_recv_corrupt"),
        )

    def fault_plan(self) -> FaultPlan | None:
        rule = {
            "dispatch_drop": FaultRule("frontend.dispatch", "drop", nth=self.fault_nth),
            "frame_recv_corrupt": FaultRule("frontend.frame_recv", "corrupt", nth=self.fault_nth),
            "client_write_drop": FaultRule("frontend.client_write", "drop", nth=self.fault_nth),
        }.get(self.fault)
        return FaultPlan([rule]) if rule is not None else None


@dataclass
class SimReport:
    scenarios: int
    leaks: int
    broken: list[tuple[int, str]]
    restarts: int = 0  # fresh servers started after leaks made the old one unusable
    seconds: float = 0.0
    groups: list[tuple[tuple[int, ...], float]] = field(default_factory=list)  # seeds, seconds
    causes: Counter[str] = field(default_factory=Counter)  # the server's failed requests

    def summary(self) -> str:
        return (
            f"scenarios run: {self.scenarios}, leaks found: {self.leaks}, "
            f"broken invariants: {len(self.broken)}"
        )


@dataclass
class _Sim:
    """One server and the books carried from group to group."""

    app: App
    counter: TerminalCounter
    report: SimReport
    baseline: Books
    leaked: set[int] = field(default_factory=set)  # record ids already reported

    def broken(self, seed: int, message: str) -> None:
        self.report.broken.append((seed, f"{message}\n    {Scenario.from_seed(seed).describe()}"
                                   f"\n    replay: {replay(seed)}"))  # fmt: skip

    @property
    def degraded(self) -> bool:
        b = self.baseline
        return b.in_flight >= MAX_PENDING // 2 or max(b.live, b.tombstones) >= MAX_QUEUED // 4

    async def run_group(self, group: list[Scenario]) -> None:
        started = time.monotonic()
        self.counter.begin()
        plan = group[0].fault_plan() if len(group) == 1 else None
        with installed(plan) if plan is not None else nullcontext():
            async with anyio.create_task_group() as tg:
                for sc in group:
                    tg.start_soon(self._scenario, sc)
        self.report.scenarios += len(group)
        await self._check(group)
        self.report.groups.append((tuple(sc.seed for sc in group), time.monotonic() - started))

    async def _scenario(self, sc: Scenario) -> None:
        try:
            with anyio.fail_after(CLIENT_TIMEOUT):
                async with anyio.create_task_group() as tg:
                    if sc.fault == "kill_worker":
                        tg.start_soon(self._kill_worker, sc.fault_delay)
                    for problem in await self._drive(sc):
                        self.broken(sc.seed, problem)
        except TimeoutError:
            self.broken(sc.seed, f"a client got no end within {CLIENT_TIMEOUT} s")

    async def _drive(self, sc: Scenario) -> list[str]:
        if sc.behaviour == "while_queued":
            async with anyio.create_task_group() as tg:
                for i in range(BLOCKERS):
                    tg.start_soon(self._blocker, sc, i)
                await anyio.sleep(0.005)  # the blockers take the worker's credits first
                outcome = await self._client(sc, sc.behaviour, sc.rid)
            return outcome.problems
        if sc.behaviour != "reuse_rid":
            return (await self._client(sc, sc.behaviour, sc.rid)).problems
        first = await self._client(sc, "rid_first", sc.rid)
        problems = first.problems + await self._rid_released(sc.rid)
        second = await self._client(sc, "complete", sc.rid)
        if second.status == 400:  # its body says why ("Duplicate request ID detected")
            return [*problems, f"reusing rid {sc.rid!r} after its request ended: {second.problems}"]
        return problems + second.problems

    async def _client(self, sc: Scenario, behaviour: str, rid: str) -> Outcome:
        port, body = self.app.port, sc.body(rid)
        if sc.api == "ws":
            msg = {"type": {"native": "generate"}.get(sc.kind, sc.kind), "id": 1, "body": body}
            return await ws_flow(port, msg, sc.expect(), behaviour, sc.k, sc.delay, rst=sc.rst)
        return await http_flow(port, sc.path(), body, sc.expect(), behaviour, sc.k, sc.delay,
                               rst=sc.rst)  # fmt: skip

    async def _blocker(self, sc: Scenario, i: int) -> None:
        body = {
            "input_ids": [11 + i, 12 + i],
            "sampling_params": {"max_new_tokens": BLOCKER_TOKENS, "ignore_eos": True},
            "rid": f"{sc.rid}-b{i}",
        }
        mine = sc.expect()  # the scenario's fault reaches its blockers too
        e = Expect(
            "native", False, [[11 + i, 12 + i]], 1, BLOCKER_TOKENS, 1, mine.allowed, mine.cut_ok
        )
        outcome = await http_flow(
            self.app.port, "/generate", body, e, "complete", 0, 0.0, rst=False
        )
        for problem in outcome.problems:
            self.broken(sc.seed, f"blocker {i}: {problem}")

    async def _rid_released(self, rid: str) -> list[str]:
        """Wait (bounded) until the request named ``rid`` (a batch: rid_0, rid_1) was
        registered and has left the registry. A client that left before the server read
        its body may never be registered: then only a short wait."""
        registry = self.app.frontend.registry
        names = (rid, f"{rid}_0", f"{rid}_1")
        with anyio.move_on_after(0.3):
            while not any(r.client_rid in names for r in self.counter.group_records()):
                await anyio.sleep(0.005)
        with anyio.move_on_after(SETTLE):
            while any(registry.by_client_rid(r) is not None for r in names):
                await anyio.sleep(0.005)
            return []
        held = [registry.by_client_rid(r) for r in names]
        states = [f"{r.client_rid}: {r.state.value}" for r in held if r is not None]
        return [f"rid still registered {SETTLE} s after its client left ({', '.join(states)})"]

    async def _kill_worker(self, delay: float) -> None:
        await anyio.sleep(delay)
        pid = self.app.supervisor.worker_pid
        if pid:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    async def _check(self, group: list[Scenario]) -> None:
        slow = any(sc.fault in ("dispatch_drop", "kill_worker") for sc in group)
        now = await settle(self.app, self.baseline, SETTLE + (HUNG_TIMEOUT + 2.0 if slow else 0))
        fe, seeds = self.app.frontend, [sc.seed for sc in group]
        ended = fe.registry.finished + sum(fe.registry.failed.values())
        if fe.registry.received != ended + len(fe.registry):
            self.broken(seeds[0], f"books: received {fe.registry.received} != ended {ended} + live "
                        f"{len(fe.registry)} (group {seeds})")  # fmt: skip
        stuck = {r.id: r for r in fe.registry if r.id not in self.leaked}
        for r in self.counter.group_records():
            if r.id not in self.leaked and fe.registry.tombstone(r.id) is not None:
                stuck[r.id] = r
        for rec in stuck.values():
            self.leaked.add(rec.id)
            self.report.leaks += 1
            self.broken(_seed_of(rec, seeds), f"leak: {_rec_text(rec)} still in the registry "
                        f"{SETTLE} s after its clients were done")  # fmt: skip
        if not stuck and not now.within(self.baseline):
            self.report.leaks += 1
            self.broken(seeds[0], f"leak: worker not idle after settling: {now} (was "
                        f"{self.baseline}; group {seeds})")  # fmt: skip
        for rec, terminals in self.counter.group_counts():
            live = rec in fe.registry
            if terminals > 1 or (terminals == 0 and not live) or (live and rec.state in TERMINAL):
                self.broken(_seed_of(rec, seeds), f"{_rec_text(rec)}: {terminals} terminal "
                            f"transitions, live={live}")  # fmt: skip
        self.baseline = now


def _rec_text(rec: RequestRecord) -> str:
    return f"request {rec.id} (rid {rec.client_rid}, state {rec.state.value})"


def _seed_of(rec: RequestRecord, seeds: list[int]) -> int:
    rid = rec.client_rid or ""
    if rid.startswith("sim-"):
        head = rid[4:].split("-")[0].split("_")[0]
        if head.isdigit() and int(head) in seeds:
            return int(head)
    return seeds[0]


def groups(scenarios: Iterable[Scenario], concurrency: int) -> Iterable[list[Scenario]]:
    """Consecutive scenarios, ``concurrency`` at a time; one with a fault goes alone."""
    group: list[Scenario] = []
    for sc in scenarios:
        if sc.alone:
            yield [sc]
            continue
        group.append(sc)
        if len(group) >= concurrency:
            yield group
            group = []
    if group:
        yield group


def sim_config() -> AppConfig:
    return AppConfig(
        port=0,
        worker_module="lifecycle.testing.scripted_worker",
        worker_extra_args=WORKER_ARGS,
        max_pending=MAX_PENDING,
        max_running=MAX_RUNNING,
        max_queued=MAX_QUEUED,
        send_timeout=SEND_TIMEOUT,
        hung_timeout=HUNG_TIMEOUT,
        restart_backoff=(0.05,),
        debug_routes=False,
    )


Progress = Callable[[SimReport], None]


async def run_scenarios(
    seeds: Iterable[int], *, concurrency: int = 4, progress: Progress | None = None
) -> SimReport:
    """Run one scenario per seed against one server (a fresh one only when leaks have
    used up the old one's credits); returns what was found."""
    started = time.monotonic()
    report = SimReport(0, 0, [])
    pending = list(groups((Scenario.from_seed(s) for s in seeds), max(1, concurrency)))
    first = True
    while pending:
        report.restarts += 0 if first else 1
        first = False
        async with anyio.create_task_group() as tg:
            app: App = await tg.start(serve_app, sim_config())
            with anyio.fail_after(60):
                await app.supervisor.wait_ready()
            counter = TerminalCounter()
            counter.previous = set_observer(counter)
            try:
                sim = _Sim(app, counter, report, await books(app))
                while pending and not sim.degraded:
                    await sim.run_group(pending.pop(0))
                    if progress is not None:
                        progress(report)
            finally:
                report.causes.update(app.frontend.registry.failed)
                set_observer(counter.previous)
                tg.cancel_scope.cancel()
    report.seconds = time.monotonic() - started
    return report


def kinds(report: SimReport) -> Counter[str]:
    """Failing seeds by API, mode and behaviour (what ``main`` prints)."""
    out: Counter[str] = Counter()
    for seed in sorted({s for s, _ in report.broken}):
        sc = Scenario.from_seed(seed)
        out[f"{sc.api}/{sc.kind} {sc.mode} {sc.behaviour} fault={sc.fault}"] += 1
    return out


def print_report(report: SimReport, *, limit: int = 50) -> None:
    print(report.summary())
    print(f"({report.seconds:.1f} s, {report.restarts} server restarts)")
    print("requests failed by cause: " + ", ".join(f"{c} {n}" for c, n in report.causes.items()))
    slowest = sorted(report.groups, key=lambda g: -g[1])[:5]
    print("slowest groups: " + ", ".join(f"{list(s)} {t:.2f} s" for s, t in slowest))
    for kind, count in kinds(report).most_common():
        print(f"  {count:5d}  {kind}")
    for seed, message in report.broken[:limit]:
        print(f"seed {seed}: {message}")
    if len(report.broken) > limit:
        print(f"... and {len(report.broken) - limit} more")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.simulation", description=__doc__)
    p.add_argument("--seed", type=int, help="replay one seed (runs it alone)")
    p.add_argument("--seeds", type=int, default=300, help="how many seeds")
    p.add_argument("--start", type=int, default=0, help="the first seed")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--verbose", action="store_true", help="show the server's log")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.CRITICAL)
    seeds = [args.seed] if args.seed is not None else range(args.start, args.start + args.seeds)
    if args.seed is not None:
        print(Scenario.from_seed(args.seed).describe())
    concurrency = 1 if args.seed is not None else args.concurrency
    report = anyio.run(lambda: run_scenarios(seeds, concurrency=concurrency))
    print_report(report)
    return 1 if report.leaks or report.broken else 0


if __name__ == "__main__":
    sys.exit(main())
