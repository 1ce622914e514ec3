"""A seeded request draws the same random numbers alone and in any batch (issue 34).

The sampler and the engine on logits that do not depend on the batch: the model is
replaced by a table (a row's logits are a function of its own last token and position,
by indexing and one add, so they are bitwise the same in any batch). What is left to
differ is the sampling: which rows share the call, in which order, what they filter,
whether they are seeded, greedy or forks, and the scheduler's waits and preemptions.
The kernels' own batch invariance is tested where they live; the served default end to
end in tests/test_determinism_served.py.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from gpu.model.loader import LoadedModel, load_model
from gpu.runtime.engine import Engine, EngineConfig
from gpu.runtime.sampling import sample
from tests.model_steps import SampleRow
from tests.tiny_gguf import TinyModel
from wire import SamplingParams, StepEntry, SubmitEntry, ids_to_list, pack_ids

V = 4096  # wide enough that a draw in the wrong order picks another token


def _row(seed: int | None, **kw: Any) -> SampleRow:
    g = None if seed is None else torch.Generator().manual_seed(seed)
    return SampleRow(SamplingParams(**kw), [1, 2, 3], [4, 4, 5], g, eog_ids=(2,))


# What other rows in a batch may ask: greedy, sampled with or without a seed, each filter,
# penalties and bias (which make the sampler process the batch's logits).
OTHERS: list[dict[str, Any]] = [
    {"temperature": 0.0},
    {"temperature": 0.7},
    {"temperature": 1.0, "top_k": 5},
    {"temperature": 0.9, "top_p": 0.5},
    {"temperature": 1.2, "min_p": 0.2},
    {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.01},
    {"temperature": 0.8, "frequency_penalty": 0.5, "logit_bias": ((7, 3.0),)},
    {"top_k": 1},
]
TARGETS: list[dict[str, Any]] = [
    {"temperature": 0.8},
    {"temperature": 1.0, "top_k": 50},
    {"temperature": 0.8, "top_p": 0.9},
    {"temperature": 1.0, "min_p": 0.05},
    {"temperature": 0.6, "top_k": 100, "top_p": 0.95, "min_p": 0.02},
    {"temperature": 0.8, "repetition_penalty": 1.3},
]


def test_a_filter_on_another_row_does_not_move_a_seeded_draw() -> None:
    """The regression: one row's top_k sorted every row of the call, and the seeded row
    without a filter met its noise in probability order instead of token order, so its
    token depended on whether anything in its batch filtered (0 of 30 seeds agreed)."""
    x = torch.randn(2, V, generator=torch.Generator().manual_seed(0)) * 3
    alone = [sample(x[1:], [_row(s, temperature=1.0)]).tokens[0] for s in range(30)]
    batch = [
        sample(x, [_row(9, temperature=0.8, top_k=20), _row(s, temperature=1.0)]).tokens[1]
        for s in range(30)
    ]
    assert batch == alone and len(set(alone)) > 10


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: "-".join(map(str, t)))
def test_a_seeded_row_samples_alone_as_in_any_batch(target: dict[str, Any]) -> None:
    rng = random.Random(str(target))
    logits = torch.randn(65, V, generator=torch.Generator().manual_seed(1)) * 4
    mine = logits[0]
    alone = [sample(mine[None].clone(), [_row(s, **target)]).tokens[0] for s in range(8)]
    assert len(set(alone)) > 1
    for trial in range(12):
        size = rng.choice([2, 3, 7, 8, 9, 16, 33, 64])
        where = rng.randrange(size)
        for s in range(8):
            rows = [
                _row(rng.choice([None, rng.randrange(100)]), **rng.choice(OTHERS))
                for _ in range(size - 1)
            ]
            rows.insert(where, _row(s, **target))
            x = logits[1:size].clone()
            x = torch.cat([x[:where], mine[None], x[where:]])
            got = sample(x, rows, want_logprobs=rng.random() < 0.3).tokens[where]
            assert got == alone[s], (trial, size, where, s)


def test_ties_keep_their_vocabulary_order() -> None:
    """Tied probabilities at the top-k boundary: the kept tokens are the lowest ids, the
    same alone and in a batch (a stable sort; an unstable one may keep either)."""
    x = torch.zeros(1, V)
    x[0, 100:200] = 5.0  # 100 tokens tied at the top
    seen = {sample(x.clone(), [_row(s, temperature=1.0, top_k=10)]).tokens[0] for s in range(200)}
    assert seen == set(range(100, 110))


# -- the engine ------------------------------------------------------------------------


class TableModel:
    """Stands in for the model: a row's logits are ``tok[last id] + pos[position]``, so a
    sequence gets bitwise the same logits alone, in any batch, after a preemption."""

    def __init__(self, vocab: int, context: int) -> None:
        g = torch.Generator().manual_seed(7)
        self.tok = torch.randn(vocab, vocab, generator=g) * 2.5
        self.pos = torch.randn(context, vocab, generator=g)

    def trunk(self, ids: torch.Tensor, pos: torch.Tensor, cache: object) -> torch.Tensor:
        return torch.stack([ids, pos], dim=1)

    def logits(self, x: torch.Tensor, idx: torch.Tensor, want_hidden: bool = False) -> Any:
        rows = x.index_select(0, idx)
        out = self.tok[rows[:, 0]] + self.pos[rows[:, 1]]
        return (out, out) if want_hidden else out


@pytest.fixture(scope="module")
def lm(tiny_gguf: TinyModel) -> LoadedModel:
    return load_model(tiny_gguf.path, device="cpu", weights="fp32")


def _engine(lm: LoadedModel, max_running: int = 64, kv_blocks: int = 400) -> Engine:
    engine = Engine(lm, EngineConfig(kv_blocks=kv_blocks, block_size=4, max_running=max_running))
    engine.model = TableModel(lm.config.vocab_size, lm.config.context_length)  # type: ignore[assignment]
    return engine


def _run(
    engine: Engine, reqs: list[tuple[int, list[int], dict[str, Any]]]
) -> tuple[dict[int, list[int]], int]:
    """Every rid's tokens, and how many preemptions the requests went through."""
    errors, _ = engine.submit([SubmitEntry(r, pack_ids(p), s, {}) for r, p, s in reqs])
    assert not errors, errors
    got: dict[int, list[StepEntry]] = {}
    while engine.has_work:
        for e in engine.step():
            got.setdefault(e.rid, []).append(e)
    assert not engine.check() and engine.blocks.num_free == engine.blocks.num_blocks
    retractions = sum((es[-1].extra or {}).get("num_retractions", 0) for es in got.values())
    return {
        r: [t for e in es for t in ids_to_list(e.new_ids)] for r, es in got.items()
    }, retractions


SEEDED = [  # (rid, sampling): rids leave room for n = 3
    (1000, {"temperature": 0.8, "seed": 11, "max_new_tokens": 14, "ignore_eos": True}),
    (1010, {"temperature": 1.0, "top_k": 40, "top_p": 0.9, "seed": -5, "max_new_tokens": 12}),
    (1020, {"temperature": 0.8, "n": 3, "seed": 42, "max_new_tokens": 10, "ignore_eos": True}),
    (1030, {"temperature": 1.1, "min_p": 0.05, "presence_penalty": 0.4, "seed": 3}),
]


def _other(rng: random.Random) -> dict[str, Any]:
    s = dict(rng.choice(OTHERS))
    s["logit_bias"] = dict(s.get("logit_bias", ()))
    s |= {"max_new_tokens": rng.randrange(3, 16), "ignore_eos": rng.random() < 0.5}
    if rng.random() < 0.5:
        s["seed"] = rng.randrange(1 << 40)
    if rng.random() < 0.2:
        s["n"] = 2
    return s


@pytest.mark.parametrize(
    ("mix", "max_running", "kv_blocks"),
    [(0, 64, 400), (1, 64, 400), (2, 3, 400), (3, 8, 40), (4, 64, 400)],
    ids=["batch", "reordered", "few-slots", "preempting", "late-arrivals"],
)
def test_seeded_requests_sample_alone_as_in_any_batch(
    lm: LoadedModel, mix: int, max_running: int, kv_blocks: int
) -> None:
    """Each seeded request (and the n = 3 siblings, seeds + 1 and + 2) alone, then among
    other requests of every kind, in another order, with few running slots (waits, forks
    that recompute), a KV budget that preempts, or arriving while others decode."""
    rng = random.Random(mix)
    v = lm.config.vocab_size
    prompt = {rid: [rng.randrange(5, v) for _ in range(rng.randrange(3, 30))] for rid, _ in SEEDED}
    alone: dict[int, list[int]] = {}
    for rid, s in SEEDED:
        alone |= _run(_engine(lm), [(rid, prompt[rid], s)])[0]
    assert len(alone) == 6 and len({tuple(t) for r, t in alone.items() if 1020 <= r < 1030}) == 3
    others = [
        (10 * i, [rng.randrange(5, v) for _ in range(rng.randrange(2, 40))], _other(rng))
        for i in range(12)
    ]
    reqs = [*others, *((rid, prompt[rid], s) for rid, s in SEEDED)]
    rng.shuffle(reqs)
    engine = _engine(lm, max_running, kv_blocks)
    if mix == 4:  # the seeded ones join a batch already decoding
        engine.submit([SubmitEntry(r, pack_ids(p), s, {}) for r, p, s in others])
        for _ in range(3):
            engine.step()
        reqs = [(rid, prompt[rid], s) for rid, s in SEEDED]
    got, retractions = _run(engine, reqs)
    assert (retractions > 0) == (mix == 3)
    parted = {r: (got[r], t) for r, t in alone.items() if got[r] != t}
    assert not parted, parted
