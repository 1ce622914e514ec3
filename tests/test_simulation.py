"""The seeded client/worker simulation (``tests/simulation.py``): a few hundred scenarios
of clients leaving, stalling, cancelling and reusing rids, with faults, against one real
server and scripted worker; no request may leak and every invariant must hold.

``LIFECYCLE_SIM_SEEDS`` sets how many seeds (60 by default, to keep the suite under its
time: the deterministic simulation, ``tests/test_dsim.py``, runs 1,000 scenarios on
virtual time beside it and ``bench/reliability.py --dsim N`` any number; this one keeps
real sockets, real processes and real time); a failing seed is printed with the command
that replays it.
"""

from __future__ import annotations

import os

import pytest

from tests.simulation import print_report, run_scenarios

pytestmark = pytest.mark.anyio

SEEDS = int(os.environ.get("LIFECYCLE_SIM_SEEDS", "60"))


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.timeout(600)
async def test_simulated_clients_leak_nothing() -> None:
    report = await run_scenarios(range(SEEDS), concurrency=4)
    print_report(report, limit=len(report.broken))
    assert report.scenarios == SEEDS
    failures = "\n".join(f"seed {seed}: {message}" for seed, message in report.broken)
    assert report.leaks == 0 and not report.broken, f"{report.summary()}\n{failures}"
