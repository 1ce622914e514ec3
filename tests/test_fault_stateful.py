"""Property test: random sequences of submit / abort / disconnect / worker-kill / step
against the in-process ``Frontend`` (state machine, admission, dispatch, egress
handoffs) driving a real scripted worker process, with the invariants checked after
every step and the release invariants once the run is over.

The event loop runs in a blocking portal; each submitted call is owned by one task, as
an HTTP handler owns it; "disconnect" cancels that task's scope.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from lifecycle.core.call import GenerateCall
from lifecycle.core.errors import RequestError, ServeError
from lifecycle.core.frontend import Frontend, FrontendConfig
from lifecycle.core.live_calls import ABORT_MESSAGE
from lifecycle.core.params import parse_generate
from lifecycle.core.states import Cause
from lifecycle.link.supervisor import Supervisor, SupervisorConfig

SUPERVISOR = SupervisorConfig(
    worker_module="lifecycle.testing.scripted_worker",
    worker_args=("--max-pending", "4", "--max-running", "2", "--step-delay", "0.005"),
    hung_timeout=2.0,
    backoff=(0.05,),
)


@dataclass
class _Harness:
    portal: BlockingPortal
    fe: Frontend
    owners: list[_Owner] = field(default_factory=list)


@dataclass
class _Owner:
    call: GenerateCall
    scope: anyio.CancelScope | None = None
    ended: bool = False


async def _own(owner: _Owner) -> None:
    """What an HTTP handler does with its call: own it in one scope, start, run."""
    call = owner.call
    with anyio.CancelScope() as owner.scope:
        async with call:
            try:
                await call.start()
                await call.run_to_end()
            except (RequestError, ServeError):
                pass  # the call failed its records with their cause before raising
    owner.ended = True


def _client_gone() -> tuple[Cause, str]:
    return Cause.CLIENT_GONE, "client disconnected"


@pytest.fixture(scope="module")
def harness() -> Iterator[_Harness]:
    from lifecycle.runtime import _load_tokenizer

    tokenizer, _chat, model_config, _ = _load_tokenizer(None)
    with start_blocking_portal() as portal:
        sup = Supervisor(SUPERVISOR)
        running = portal.start_task_soon(sup.run)
        fe = Frontend(sup, tokenizer, model_config, FrontendConfig(max_queued=3))
        portal.call(_wait_ready, sup)
        yield _Harness(portal, fe)
        portal.call(sup.stop)
        running.result(10)


async def _wait_ready(sup: Supervisor) -> None:
    with anyio.fail_after(60):
        await sup.wait_ready()


def _books(fe: Frontend) -> tuple[int, int, int]:
    return (
        fe.registry.received,
        fe.registry.finished + sum(fe.registry.failed.values()),
        len(fe.registry),
    )


class FrontendMachine(RuleBasedStateMachine):
    h: _Harness

    @rule(max_new=st.integers(1, 40), n=st.integers(1, 2), prompt=st.integers(1, 5))
    def submit(self, max_new: int, n: int, prompt: int) -> None:
        body = {
            "input_ids": list(range(10, 10 + prompt)),
            "sampling_params": {"max_new_tokens": max_new, "n": n, "ignore_eos": True},
        }
        req = parse_generate(body, vocab_size=self.h.fe.model_config.vocab_size)
        owner = _Owner(self.h.fe.call(req, _client_gone))
        self.h.owners.append(owner)
        self.h.portal.start_task_soon(_own, owner)

    @rule(i=st.integers(0, 50))
    def disconnect(self, i: int) -> None:
        live = [o for o in self.h.owners if not o.ended and o.scope is not None]
        if live:
            self.h.portal.call(live[i % len(live)].scope.cancel)  # type: ignore[union-attr]

    @rule(i=st.integers(0, 50))
    def abort(self, i: int) -> None:
        def go() -> None:
            live = [o for o in self.h.owners if not o.ended and o.call.client is not None]
            if live:
                live[i % len(live)].call.abort(ABORT_MESSAGE)

        self.h.portal.call(go)

    @rule()
    def kill_worker(self) -> None:
        pid = self.h.fe.supervisor.worker_pid
        if pid and self.h.fe.supervisor.ready:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # already dying: the supervisor has not noticed yet
                pass

    @rule(dt=st.sampled_from([0.0, 0.02, 0.1]))
    def step(self, dt: float) -> None:
        time.sleep(dt)

    @invariant()
    def books_balance(self) -> None:
        received, ended, live = self.h.portal.call(_books, self.h.fe)
        assert received == ended + live, (received, ended, live)
        for o in self.h.owners:
            if o.ended:
                assert all(r.rec.terminal for r in o.call.runs)

    def teardown(self) -> None:
        self.h.portal.call(_settle, self.h)
        self.h.owners.clear()


async def _settle(h: _Harness) -> None:
    """Every call ends; then nothing is live, held, or leaked in the worker."""
    fe = h.fe
    with anyio.fail_after(20):
        while not all(o.ended for o in h.owners):
            await anyio.sleep(0.01)
        while True:
            client = await fe.supervisor.wait_ready()
            try:
                load: dict[str, Any] = await client.stats()
            except (ConnectionError, anyio.BrokenResourceError, anyio.ClosedResourceError):
                await anyio.sleep(0.01)  # a worker killed by the last step: wait for the next
                continue
            idle = (
                len(fe.registry) == 0
                and fe.registry.tombstones == 0
                and client.in_flight == 0
                and load["kv_blocks_free"] == load["kv_blocks_total"]
                and load["running"] == 0
                and load["waiting"] == 0
            )
            if idle:
                break
            await anyio.sleep(0.01)
    received, ended, live = _books(fe)
    assert live == 0 and received == ended


def test_frontend_state_machine(harness: _Harness) -> None:
    FrontendMachine.h = harness
    run = FrontendMachine.TestCase
    run.settings = settings(
        max_examples=12,
        stateful_step_count=12,
        deadline=None,
        database=None,
        # Real processes and real time: a failing sequence does not replay exactly, so
        # it is reported as found, not shrunk.
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    run().runTest()
