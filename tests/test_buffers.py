"""Handoff buffers, in memory: admission bounds, and output that is never dropped or gapped."""

from __future__ import annotations

import anyio
import pytest

from lifecycle.core.buffers import AdmissionQueue, Chunk, OutputBuffer, OutputOverflow
from lifecycle.core.states import Cause

pytestmark = pytest.mark.timeout(20)


# -- admission -----------------------------------------------------------------------------


def test_admission_refuses_when_full_and_reopens_on_release() -> None:
    q = AdmissionQueue(2)
    assert q.capacity == 2 and q.depth == 0 and not q.full
    assert q.try_admit() and q.try_admit()
    assert q.full and not q.try_admit() and q.depth == 2
    q.release()
    assert not q.full and q.try_admit()


def test_admission_release_without_admit_is_a_bug() -> None:
    q = AdmissionQueue(1)
    with pytest.raises(RuntimeError):
        q.release()
    with pytest.raises(ValueError):
        AdmissionQueue(0)


# -- output buffer, sync side --------------------------------------------------------------


def test_take_nowait_returns_everything_since_last_read() -> None:
    buf = OutputBuffer(10)
    assert buf.take_nowait() is None
    buf.append([1, 2], {"prompt_tokens": 3})
    buf.append([3])
    buf.append([], {"logprobs": b"x"})
    assert buf.total == 3 and buf.pending == 3
    assert buf.take_nowait() == Chunk(
        [1, 2, 3], [{"prompt_tokens": 3}, {"logprobs": b"x"}], None, 0
    )
    assert buf.take_nowait() is None
    buf.append([4])
    assert buf.take_nowait() == Chunk([4], [], None, 3)


def test_end_is_delivered_with_or_after_the_last_data_and_then_repeats() -> None:
    buf = OutputBuffer(10)
    buf.append([1])
    buf.finish({"type": "length", "length": 1})
    assert buf.ended
    assert buf.take_nowait() == Chunk([1], [], {"type": "length", "length": 1}, 0)
    again = buf.take_nowait()
    assert again is not None and again.ids == [] and again.end == {"type": "length", "length": 1}


def test_first_terminal_wins_and_late_output_is_ignored() -> None:
    buf = OutputBuffer(10)
    assert buf.finish(Cause.CLIENT_STALLED)
    assert not buf.finish({"type": "stop", "matched": 2})
    assert buf.append([5]) is False  # a late step for an ended request
    chunk = buf.take_nowait()
    assert chunk == Chunk([], [], Cause.CLIENT_STALLED, 0)
    with pytest.raises(ValueError):
        OutputBuffer(1).finish(None)


def test_limit_is_enforced_not_silently_dropped() -> None:
    buf = OutputBuffer(3)
    buf.append([1, 2, 3])
    with pytest.raises(OutputOverflow):
        buf.append([4])
    assert buf.total == 3 and buf.take_nowait() == Chunk([1, 2, 3], [], None, 0)


# -- output buffer, a slow reader ----------------------------------------------------------


@pytest.mark.anyio
async def test_slow_reader_gets_fewer_larger_chunks_and_no_gap() -> None:
    n_steps = 500
    buf = OutputBuffer(n_steps * 2)
    chunks: list[Chunk] = []

    async def producer() -> None:
        for step in range(n_steps):
            buf.append([2 * step, 2 * step + 1], {"step": step})
            if step % 7 == 0:
                await anyio.sleep(0)  # the dispatcher yields between worker frames
        buf.finish({"type": "length", "length": 2 * n_steps})

    async def slow_reader() -> None:
        # As a call reads its buffers: everything there is at each wake-up (here, after
        # each slow client write), nothing in between.
        while True:
            chunk = buf.take_nowait()
            if chunk is not None:
                chunks.append(chunk)
                if chunk.end is not None:
                    return
            await anyio.sleep(0.001)  # a slow client write

    async with anyio.create_task_group() as tg:
        tg.start_soon(slow_reader)
        tg.start_soon(producer)

    ids = [t for c in chunks for t in c.ids]
    assert ids == list(range(2 * n_steps))  # every token, in order, once
    assert [e["step"] for c in chunks for e in c.extras] == list(range(n_steps))
    assert [c.start for c in chunks] == [
        sum(len(c.ids) for c in chunks[:i]) for i in range(len(chunks))
    ]
    assert chunks[-1].end == {"type": "length", "length": 2 * n_steps}
    assert all(c.end is None for c in chunks[:-1])
    assert len(chunks) < n_steps / 5  # coalesced, not one chunk per step
