"""Grammar-constrained sampling in the step engine, in memory, on the real model.

The mask is applied per row inside continuous batching: unconstrained rows in the same
batch sample exactly what they sample alone; constrained rows (forks included) match
their grammar; compile time and the cache hit travel in the first STEP entry, and a
finished grammar ends its sample at once with ``grammar_done``.
"""

from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest
import torch

from gpu.runtime.engine import Engine, EngineConfig
from gpu.runtime.grammar import allowed_tokens
from gpu.runtime.sampling import _constrain, sample
from tests.model_steps import SampleRow
from wire import SamplingParams, StepEntry, SubmitEntry, ids_to_list, pack_ids

GREEDY = {"temperature": 0, "max_new_tokens": 24}


@pytest.fixture(scope="module")
def fp32_model():  # noqa: ANN201
    """fp32 weights: constrained rows are compared with the same rows run alone."""
    from gpu.model.loader import load_model

    return load_model(device="cpu", weights="fp32")


@pytest.fixture()
def engine(fp32_model) -> Engine:  # noqa: ANN001
    return Engine(fp32_model, EngineConfig(kv_blocks=256))


def run(engine: Engine, reqs: list[tuple[int, list[int], dict]]) -> dict[int, list[StepEntry]]:
    errors, done = engine.submit([SubmitEntry(r, pack_ids(p), s, {}) for r, p, s in reqs])
    assert not errors and not done, (errors, done)
    got: dict[int, list[StepEntry]] = {}
    while engine.has_work:
        for e in engine.step():
            got.setdefault(e.rid, []).append(e)
    assert engine.blocks.num_free == engine.blocks.num_blocks
    return got


def text_of(engine: Engine, entries: list[StepEntry]) -> str:
    ids = [t for e in entries for t in ids_to_list(e.new_ids)]
    return engine.loaded.tokenizer.decode(ids)


def test_mask_bits_unpack_in_token_order() -> None:
    words = torch.zeros(2, 2, dtype=torch.int32)
    words[0, 0] = 1 << 3
    words[1, 1] = -(1 << 31)  # bit 31 of word 1: token 63
    allowed = allowed_tokens(words, 60)
    assert allowed.shape == (2, 60)
    assert allowed[0].nonzero().flatten().tolist() == [3]
    assert not allowed[1].any()  # token 63 is past the vocabulary


def test_a_grammar_wins_over_a_min_new_tokens_ban() -> None:
    logits = torch.zeros(2, 8)
    logits[:, 5] = 9.0
    rows = [
        SampleRow(SamplingParams(top_k=1, min_new_tokens=3), [1], [], None, eog_ids=(2,))
        for _ in range(2)
    ]
    only_end = torch.tensor([[1 << 2]], dtype=torch.int32)  # packed: token 2 alone
    # Row 1 alone is constrained to the end token the ban forbids: the grammar wins.
    assert sample(logits.clone(), rows, allowed=([1], only_end)).tokens == [5, 2]
    # Unprocessed logits whose allowed tokens are all -inf: uniform over what is allowed.
    dead = torch.full((1, 8), -math.inf)
    dead[0, 5] = 1.0
    free = [SampleRow(SamplingParams(top_k=1), [1], [], None, eog_ids=(2,))]
    assert sample(dead, free, allowed=([0], only_end)).tokens == [2]


@pytest.mark.parametrize("native", [True, False])
def test_the_native_and_torch_masks_agree(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The C loop (gpu/kernels/csrc/token_mask.c) and the torch fallback ban the same tokens, leave
    the free rows alone, and keep the allowed logits as they were."""
    if not native:
        monkeypatch.setattr("gpu.runtime.sampling.load_kernels", lambda: None)
    gen = torch.Generator().manual_seed(0)
    vocab = 1000  # not a multiple of 32: the last word is partial
    logits = torch.randn(6, vocab, generator=gen)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), dtype=torch.int32, generator=gen)
    bitmask[1] = -1  # all allowed
    bitmask[2, :] = 0
    bitmask[2, 3] = 1 << 7  # token 103 alone
    rows = [0, 3, 5]
    before = logits.clone()
    _constrain(logits, logits, rows, bitmask)
    allowed = allowed_tokens(bitmask, vocab)
    for k, r in enumerate(rows):
        expect = before[r].masked_fill(~allowed[k], -math.inf)
        assert torch.equal(logits[r], expect)
    for r in (1, 2, 4):
        assert torch.equal(logits[r], before[r])
    assert allowed[2].nonzero().flatten().tolist() == [103]


def test_constrained_and_free_rows_share_a_batch(engine: Engine) -> None:
    tok = engine.loaded.tokenizer
    prompt = tok.encode("The phone number is ")
    alone = run(engine, [(0, prompt, GREEDY)])
    pattern = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["n"],
        "additionalProperties": False,
    }
    mixed = run(
        engine,
        [
            (10, prompt, GREEDY),
            (20, prompt, {**GREEDY, "grammar": ["regex", pattern]}),
            (30, prompt, {"max_new_tokens": 40, "seed": 3, "n": 3,
                          "grammar": ["json_schema", json.dumps(schema)]}),
        ],
    )  # fmt: skip
    assert text_of(engine, mixed[10]) == text_of(engine, alone[0])  # untouched by the mask
    assert "grammar_compile_ms" not in (mixed[10][0].extra or {})
    assert re.fullmatch(pattern, text_of(engine, mixed[20]))
    for rid in (30, 31, 32):  # the forks copy the parent's matcher
        jsonschema.validate(json.loads(text_of(engine, mixed[rid])), schema)
        assert mixed[rid][-1].extra["grammar_done"] is True
        assert mixed[rid][-1].finish[0] == "stop"
    first = mixed[20][0].extra
    assert first["grammar_cached"] is False and first["grammar_compile_ms"] > 0
    again = run(engine, [(40, prompt, {**GREEDY, "grammar": ["regex", pattern]})])
    assert again[40][0].extra["grammar_cached"] is True
    assert text_of(engine, again[40]) == text_of(engine, mixed[20])


def test_a_finished_grammar_ends_at_once_without_sampling_the_end(engine: Engine) -> None:
    tok = engine.loaded.tokenizer
    got = run(
        engine, [(0, tok.encode("Yes or no? "), {**GREEDY, "grammar": ["regex", "(yes|no)"]})]
    )
    (*_, last) = got[0]
    assert text_of(engine, got[0]) in ("yes", "no")
    assert last.finish == ["stop", tok.eos_id] and last.extra["grammar_done"] is True
    ids = [t for e in got[0] for t in ids_to_list(e.new_ids)]
    assert tok.eos_id not in ids


def test_a_grammar_the_library_refuses_is_invalid_for_that_rid_only(engine: Engine) -> None:
    errors, _ = engine.submit(
        [
            SubmitEntry(0, pack_ids([1, 2, 3]), {"grammar": ["regex", "a("], "n": 2}, {}),
            SubmitEntry(5, pack_ids([1, 2, 3]), {"grammar": ["jsonschema", "{}"]}, {}),
        ]
    )
    assert [(r, c) for r, c, _ in errors] == [(0, "invalid"), (1, "invalid"), (5, "invalid")]
    assert "unclosed group" in errors[0][2] and "grammar must be [kind, source]" in errors[2][2]
    assert not engine.has_work
