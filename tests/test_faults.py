"""``wire.faults``: plans, timing rules, actions, loading, and the cost without a plan."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import timeit

import anyio
import pytest

from wire import faults
from wire.faults import FaultPlan, FaultRule, InjectedFault, fault_point, installed


def test_no_plan_is_a_no_op_and_cheap() -> None:
    assert faults.active_plan() is None
    assert fault_point("worker.forward", 3) is None
    n = 200_000
    per_call = min(timeit.repeat(lambda: fault_point("worker.forward"), number=n, repeat=3)) / n
    # A Python call with one global check: ~50-100 ns here; the bound leaves room for load.
    assert per_call < 1e-6, f"{per_call * 1e9:.0f} ns per fault_point without a plan"


def test_nth_hit_and_times() -> None:
    with installed([FaultRule("worker.forward", "nan", nth=3, times=2)]) as plan:
        fired = [fault_point("worker.forward") is not None for _ in range(6)]
    assert fired == [False, False, True, True, False, False]
    assert plan.fired("worker.forward") == 2
    assert faults.active_plan() is None


def test_rid_filter_and_other_points_untouched() -> None:
    with installed([FaultRule("worker.sample", "corrupt", rid=7, times=0)]):
        assert fault_point("worker.sample", 6) is None
        assert fault_point("worker.forward", 7) is None
        f = fault_point("worker.sample", 7)
        assert f is not None and f.action == "corrupt" and f.rid == 7
        assert fault_point("worker.sample", 7) is not None  # times=0: every hit


def test_probability_is_seeded() -> None:
    def run() -> list[bool]:
        rule = FaultRule("frontend.dispatch", "drop", times=0, probability=0.3, seed=42)
        with installed([rule]):
            return [fault_point("frontend.dispatch") is not None for _ in range(200)]

    first = run()
    assert first == run()
    assert 30 < sum(first) < 90


def test_actions_applied_in_place() -> None:
    with installed([FaultRule("frontend.tokenize", "raise", message="boom")]):
        f = fault_point("frontend.tokenize")
        assert f is not None
        with pytest.raises(InjectedFault, match="boom at frontend.tokenize"):
            f.apply()
    with installed([FaultRule("worker.forward", "delay", delay=0.05)]):
        f = fault_point("worker.forward")
        assert f is not None
        t = time.monotonic()
        assert f.apply() is None
        assert time.monotonic() - t >= 0.05
    with installed([FaultRule("worker.frame_send", "drop")]):
        f = fault_point("worker.frame_send")
        assert f is not None and f.apply() is f  # the call site must act


@pytest.mark.anyio
async def test_async_stall_is_cancellable() -> None:
    with installed([FaultRule("frontend.client_write", "stall")]):
        f = fault_point("frontend.client_write")
        assert f is not None
        with anyio.move_on_after(0.05) as scope:
            await f.apply_async()
        assert scope.cancelled_caught


def test_bad_rules_refused() -> None:
    with pytest.raises(ValueError, match="unknown fault point"):
        FaultRule("worker.nowhere", "raise")
    with pytest.raises(ValueError, match="unknown fault action"):
        FaultRule("worker.forward", "explode")
    with pytest.raises(ValueError, match="timing"):
        FaultRule("worker.forward", "raise", nth=0)


def test_plan_from_json_text_and_file(tmp_path) -> None:  # noqa: ANN001
    plan = FaultPlan([FaultRule("worker.forward", "kill", nth=5)])
    again = faults.load_plan(plan.to_json())
    assert again.rules == plan.rules
    path = tmp_path / "plan.json"
    path.write_text(json.dumps([{"point": "worker.start", "action": "delay", "delay": 0.1}]))
    assert faults.load_plan(str(path)).rules == [FaultRule("worker.start", "delay", delay=0.1)]


def test_env_var_installs_a_plan_at_import() -> None:
    code = (
        "from wire.faults import fault_point, active_plan;"
        "print(active_plan() is not None, fault_point('worker.start') is not None)"
    )
    env = {**os.environ, faults.ENV_VAR: '{"rules": [{"point": "worker.start", "action": "nan"}]}'}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["True", "True"]


def test_kill_action_kills_the_process() -> None:
    code = (
        "from wire.faults import fault_point;"
        "f = fault_point('worker.forward'); f.apply(); print('survived')"
    )
    env = {**os.environ, faults.ENV_VAR: '[{"point": "worker.forward", "action": "kill"}]'}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == -9 and "survived" not in out.stdout


@pytest.mark.anyio
async def test_control_call_on_a_lost_worker_connection_is_a_connection_error(tmp_path) -> None:  # noqa: ANN001
    """Found by the fault suite: /server_info polled in the instant between a worker's
    loss and the supervisor noticing answered 500 (an uncaught ClosedResourceError)."""
    from lifecycle.link.wire_stream import FrameStream, listen, parse_address
    from lifecycle.link.worker_client import WorkerClient
    from wire import Hello

    address = parse_address(f"unix:{tmp_path / 'w.sock'}")
    listener = await listen(address)
    async with listener:
        stream = await anyio.connect_unix(address.path)
        frames = FrameStream(stream)
        client = WorkerClient(frames, Hello({"pid": 1}, {"max_pending": 1}))
        await frames.aclose()
        with pytest.raises(ConnectionError):
            await client.stats(timeout=1.0)
