"""Issue 57: a step's host work per row kept short. Each short path must give what the
general one gives: quiet rows' entries (``gpu/runtime/step_books.py``), the greedy rows' argmax
(``gpu/runtime/sampling.py``, numpy on the CPU), and a STEP frame's bytes (``wire/step_cbor.py``).
"""

from __future__ import annotations

import math
import random

import cbor2
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gpu.runtime.step_books
from gpu.model.loader import LoadedModel, load_model
from gpu.runtime.engine import Engine, EngineConfig
from gpu.runtime.sampling import NON_FINITE, sample, sample_greedy
from tests.model_steps import SampleRow
from tests.tiny_gguf import TinyModel
from wire import Finish, Step, StepEntry, SubmitEntry, decode_frame, encode_frame, pack_ids
from wire.frames import K_STEP
from wire.sampling import SamplingParams
from wire.step_cbor import encode_step


@pytest.fixture(scope="module")
def lm(tiny_gguf: TinyModel) -> LoadedModel:
    return load_model(tiny_gguf.path, device="cpu")


def _requests(vocab: int) -> list[tuple[int, list[int], dict, dict]]:
    """Quiet greedy rows that end on a stop id, an end of generation or their length, and
    the rows that are not quiet: stop strings, penalties, logprobs, n > 1, seeded draws."""
    rng = random.Random(57)
    reqs = []
    rid = 1
    for i in range(40):
        prompt = [rng.randrange(5, vocab) for _ in range(rng.randrange(2, 30))]
        s: dict = {"temperature": 0, "max_new_tokens": rng.randrange(1, 40)}
        s["ignore_eos"] = i % 3 != 0
        if i % 4 == 1:  # a stop id among many: most of these end on one
            s["stop_token_ids"] = rng.sample(range(vocab), 25)
        o: dict = {}
        if i % 10 == 7:
            s["stop"] = ["a"]
        elif i % 10 == 8:
            o = {"return_logprob": True}
        elif i % 10 == 9:
            s.update(temperature=0.8, seed=i, n=2)
        elif i % 10 == 5:
            s.update(frequency_penalty=0.3)
        reqs.append((rid, prompt, s, o))
        rid += s.get("n", 1)
    return reqs


def _steps(lm: LoadedModel, reqs: list) -> list[list[StepEntry]]:
    """Every step's entries, the requests submitted in two waves, one aborted mid-way."""
    engine = Engine(lm, EngineConfig(kv_blocks=60, block_size=4, step_tokens=64,
                                     max_running=12, mixed_prefill_tokens=24))  # fmt: skip
    waves = [reqs[: len(reqs) // 2], reqs[len(reqs) // 2 :]]
    out = []
    while waves or engine.has_work:
        if waves and len(out) % 5 == 0:
            wave = waves.pop(0)
            errors, _ = engine.submit([SubmitEntry(r, pack_ids(p), s, o) for r, p, s, o in wave])
            assert not errors
        out.append(engine.step())
        if len(out) == 12:
            out[-1] += engine.abort([reqs[2][0]])
        assert len(out) < 3000
    assert not engine.check() and engine.blocks.num_free == engine.blocks.num_blocks
    return out


def test_quiet_rows_get_the_entries_the_general_path_gives(
    lm: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same steps with no row ever quiet: every entry equal, field by field."""
    reqs = _requests(lm.config.vocab_size)
    short = _steps(lm, reqs)
    ends = [e.finish[0] for step in short for e in step if e.finish]
    assert {Finish.STOP, Finish.LENGTH, Finish.ABORT} <= set(ends)
    monkeypatch.setattr(gpu.runtime.step_books, "quiet_ends", lambda seq, eog: None)
    assert _steps(lm, reqs) == short


def _logits(draw: st.DrawFn) -> torch.Tensor:
    rows, vocab = draw(st.integers(1, 9)), draw(st.integers(1, 70))
    values = st.sampled_from([-2.0, -1.0, -0.0, 0.0, 1.0, 3.5, math.inf, -math.inf, math.nan])
    flat = draw(st.lists(values, min_size=rows * vocab, max_size=rows * vocab))
    return torch.tensor(flat, dtype=torch.float32).view(rows, vocab)


@settings(max_examples=300, deadline=None)
@given(st.composite(_logits)())
def test_greedy_rows_take_maxs_first_index_and_non_finite_rows_fail(logits: torch.Tensor) -> None:
    """Ties, -0.0, +-inf and NaN: the numpy argmax on the CPU is ``max``'s first index."""
    best = logits.max(dim=-1)
    want = best.indices.masked_fill(~(best.values < math.inf), NON_FINITE).tolist()
    assert sample_greedy(logits) == want
    rows = [SampleRow(SamplingParams(temperature=0), [1], [], None)] * len(logits)
    assert sample(logits, rows).tokens == want
    assert sample_greedy(logits[1:]) == want[1:]  # a view that starts past the first row


_rid = st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 23, 24, 255, 256, 65535,
                 65536, 2**32 - 1, 2**32, 2**64 - 1]), st.integers(-5, -1), st.booleans())  # fmt: skip
_entry = st.one_of(
    st.tuples(_rid, st.binary(min_size=4, max_size=4), st.none(), st.none()),
    st.tuples(
        _rid,
        st.binary(max_size=12),
        st.sampled_from([None, ["stop", 3], ["length", 9]]),
        st.sampled_from([None, {"num_retractions": 0}, {}]),
    ),  # fmt: skip
)


@settings(max_examples=400, deadline=None)
@given(st.lists(_entry, max_size=40), st.integers(0, 2**64 - 1))
def test_a_step_frame_is_cbor2s_bytes(entries: list[tuple], step_no: int) -> None:
    """Plain entries written in bulk, the others by cbor2: the frame is cbor2's to the byte
    (a rid cbor2 writes another way, a bool or out of uint64, takes cbor2 for the frame)."""
    want = cbor2.dumps([K_STEP, step_no, entries])
    assert encode_step(K_STEP, step_no, entries) == want


def test_a_decode_steps_frame_decodes_to_its_entries() -> None:
    entries = [StepEntry(r, pack_ids([r % 300]), None, None) for r in range(20, 300)]
    entries[7] = StepEntry(27, pack_ids([4]), [Finish.LENGTH, 9], {"num_retractions": 0})
    frame = encode_frame(Step(3, entries))
    assert frame == cbor2.dumps([K_STEP, 3, entries])
    assert decode_frame(frame) == Step(3, entries)
