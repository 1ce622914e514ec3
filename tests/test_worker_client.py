"""The dispatcher against a real scripted worker process over a real Unix socket."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from lifecycle.core.ports import generate_probe
from lifecycle.core.states import Cause
from lifecycle.core.submission import WorkerFailure
from lifecycle.link.wire_stream import connect, parse_address
from lifecycle.link.worker_client import WorkerClient

from .scripted import scripted_worker

pytestmark = pytest.mark.anyio


class RecordingSink:
    """A test sink: records what the dispatcher delivers."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.extras: list[dict[str, Any]] = []
        self.end: Any = None
        self.done = anyio.Event()

    def append(self, ids: list[int], extra: dict[str, Any] | None = None) -> None:
        assert self.end is None, "output after the terminal entry"
        self.ids += ids
        if extra:
            self.extras.append(extra)

    def finish(self, reason: Any) -> None:
        assert self.end is None, "two terminal entries"
        self.end = reason
        self.done.set()


async def _client(address: str) -> WorkerClient:
    return await WorkerClient.handshake(await connect(parse_address(address)))


async def test_outputs_credits_and_release() -> None:
    with scripted_worker("--max-pending", "3", "--max-running", "2") as addr:
        client = await _client(addr)
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.run)
            sinks = [RecordingSink() for _ in range(7)]
            for i, s in enumerate(sinks):
                client.submit([10 + i, 20, 30], {"max_new_tokens": 5, "ignore_eos": True}, {}, [s])
            assert client.in_flight == 0 and client.queued == 7  # nothing sent yet
            with anyio.fail_after(10):
                for s in sinks:
                    await s.done.wait()
            for i, s in enumerate(sinks):
                assert s.ids == [10 + i, 20, 30, 10 + i, 20]
                assert s.end == {"type": "length", "length": 5}
                assert s.extras[0]["prompt_tokens"] == 3
            load = await client.stats()
            assert load["kv_blocks_free"] == load["kv_blocks_total"] and load["running"] == 0
            assert client.in_flight == 0
            tg.cancel_scope.cancel()


async def test_n_samples_and_abort_keeps_tombstone_until_confirmed() -> None:
    with scripted_worker("--step-delay", "0.02") as addr:
        client = await _client(addr)
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.run)
            pair = [RecordingSink(), RecordingSink()]
            client.submit([1, 2, 3], {"max_new_tokens": 3, "ignore_eos": True}, {}, pair)
            long = RecordingSink()
            rids = client.submit([5, 6], {"max_new_tokens": 1000, "ignore_eos": True}, {}, [long])
            with anyio.fail_after(10):
                for s in pair:
                    await s.done.wait()
                assert pair[0].ids == [1, 2, 3] and pair[1].ids == [2, 3, 1]
                while not long.ids:
                    await anyio.sleep(0.01)
                client.abort(rids, forget=True)
                assert client.tombstones == 1 and client.in_flight == 1
                while client.in_flight:
                    await anyio.sleep(0.01)
            assert long.end is None  # forgotten: nothing delivered after the abort
            load = await client.stats()
            assert load["kv_blocks_free"] == load["kv_blocks_total"]
            tg.cancel_scope.cancel()


async def test_abort_before_dispatch_ends_locally() -> None:
    with scripted_worker("--max-pending", "1", "--step-delay", "0.02") as addr:
        client = await _client(addr)
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.run)
            first, second = RecordingSink(), RecordingSink()
            client.submit([1], {"max_new_tokens": 50, "ignore_eos": True}, {}, [first])
            rids = client.submit([2], {"max_new_tokens": 50, "ignore_eos": True}, {}, [second])
            await anyio.sleep(0.05)
            assert client.queued == 1
            client.abort(rids)
            assert second.end["type"] == "abort" and client.queued == 0
            with anyio.fail_after(10):
                await first.done.wait()
            tg.cancel_scope.cancel()


async def test_worker_death_fails_everything_held() -> None:
    with scripted_worker("--die-after-steps", "3", "--step-delay", "0.01") as addr:
        client = await _client(addr)
        sinks = [RecordingSink() for _ in range(3)]
        for s in sinks:
            client.submit([7, 8], {"max_new_tokens": 100, "ignore_eos": True}, {}, [s])
        with anyio.fail_after(10):
            reason = await client.run()
        assert "closed" in reason
        for s in sinks:
            assert isinstance(s.end, WorkerFailure) and s.end.cause is Cause.WORKER_LOST
        late = RecordingSink()
        client.submit([1], {}, {}, [late])
        assert isinstance(late.end, WorkerFailure)


async def test_req_error_is_terminal_for_its_rid_only() -> None:
    with scripted_worker("--context-length", "64") as addr:
        client = await _client(addr)
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.run)
            bad, good = RecordingSink(), RecordingSink()
            client.submit([1] * 60, {"max_new_tokens": 10}, {}, [bad])
            client.submit([3], {"max_new_tokens": 2, "ignore_eos": True}, {}, [good])
            with anyio.fail_after(10):
                await bad.done.wait()
                await good.done.wait()
            assert isinstance(bad.end, WorkerFailure) and bad.end.cause is Cause.TOO_LONG
            assert good.ids == [3, 3]
            assert client.in_flight == 0
            tg.cancel_scope.cancel()


async def test_generate_probe_passes_on_its_own_output_and_wakes_on_an_end_without_one() -> None:
    """The warm-up and ``/health_generate`` probe passes only on its own tokens; a sample
    that ends without any (the connection lost while it waits, or refused at submit)
    wakes it at once with the reason."""
    with scripted_worker("--prefill-delay", "30") as slow, scripted_worker() as quick:
        client = await _client(quick)
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.run)
            with anyio.fail_after(10):
                assert await generate_probe(client) == (True, "ok")
                assert await generate_probe(client, max_new_tokens=3) == (True, "ok")
            tg.cancel_scope.cancel()

        stuck = await _client(slow)
        got: list[tuple[bool, str]] = []

        async def probe() -> None:
            got.append(await generate_probe(stuck))

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(stuck.run)
                tg.start_soon(probe)
                while not stuck.busy:  # handed to the worker, which sits in its prefill
                    await anyio.sleep(0.01)
                await stuck.close()  # the connection ends: run() fails what it held
        ((ok, detail),) = got
        assert not ok and detail.startswith("worker_lost: ")
        ok, detail = await generate_probe(stuck)  # closed now: refused at submit
        assert (ok, detail) == (False, "worker_lost: the worker is not connected")


async def test_submit_frames_stay_under_the_limit_and_an_oversized_request_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 37 item 4: entries are cut into SUBMIT frames that each stay under the frame
    limit (here lowered to 2,000 bytes); one request that alone exceeds it is refused
    before dispatch, and nothing else is disturbed."""
    import lifecycle.link.worker_client as wc
    import wire

    monkeypatch.setattr(wc, "SUBMIT_ENTRY_LIMIT", 2000)
    with scripted_worker("--max-pending", "64") as addr:
        client = await _client(addr)
        sent: list[int] = []
        frames = client._frames

        class Spy:  # the client's frame stream, recording each SUBMIT's entry bytes
            async def send(self, frame: Any) -> None:
                if isinstance(frame, wire.Submit):
                    sent.append(sum(wire.submit_entry_bytes(e) for e in frame.entries))
                await frames.send(frame)

            def __getattr__(self, name: str) -> Any:
                return getattr(frames, name)

        client._frames = Spy()  # type: ignore[assignment]
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.run)
            stop = ["x" * 590]  # each entry ~650 bytes: three to a frame
            sinks = [RecordingSink() for _ in range(7)]
            for i, s in enumerate(sinks):
                sampling = {"max_new_tokens": 2, "ignore_eos": True, "stop": stop}
                client.submit([10 + i, 20], sampling, {}, [s])
            big = RecordingSink()
            sub = client.submit([1], {"max_new_tokens": 2, "stop": ["y" * 3000]}, {}, [big])
            assert sub.hold.value == "released"
            assert isinstance(big.end, WorkerFailure) and big.end.cause is Cause.INVALID
            assert "bytes on the worker link" in big.end.message
            with anyio.fail_after(10):
                for s in sinks:
                    await s.done.wait()
            assert [s.ids for s in sinks] == [[10 + i, 20] for i in range(7)]
            assert len(sent) >= 3 and max(sent) <= 2000 and sum(sent) > 4000
            tg.cancel_scope.cancel()
