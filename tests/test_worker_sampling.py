"""The batched sampler and the worker's reading of SUBMIT maps, on hand-made logits (no model)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from gpu.runtime.sampling import NON_FINITE, parse_request, sample, sample_plain
from tests.model_steps import SampleRow
from tests.wire_schema import EVERY_SAMPLING_FIELD
from wire import SamplingParams, is_greedy

V = 50


def row(
    output: tuple[int, ...] = (), prompt: tuple[int, ...] = (), seed: int | None = 0, **kw
) -> SampleRow:
    g = torch.Generator().manual_seed(seed if seed is not None else 0)
    return SampleRow(SamplingParams(**kw), list(prompt), list(output), g, eog_ids=(2,))


def logits_with_peak(peak: int, second: int | None = None) -> torch.Tensor:
    x = torch.zeros(1, V)
    x[0, peak] = 10.0
    if second is not None:
        x[0, second] = 9.0
    return x


def test_greedy_forms_pick_the_argmax() -> None:
    x = logits_with_peak(7, 8)
    for kw in ({"temperature": 0.0}, {"top_k": 1}, {"temperature": 1e-7}):
        assert sample(x, [row(**kw)]).tokens == [7]


def test_one_greedy_rule_for_both_encodings() -> None:
    # The frontend sends SGLang's form (top_k 1, temperature 1.0); a peer may send
    # temperature 0. Both are the same rule, defined once in wire/sampling.py.
    assert SamplingParams(top_k=1).greedy and SamplingParams(temperature=0.0).greedy
    assert is_greedy(1e-7, -1) and not is_greedy(1e-6, -1) and not SamplingParams().greedy


def test_top_k_beyond_the_vocabulary_samples_the_whole_of_it() -> None:
    x = torch.randn(1, V)
    huge = [sample(x, [row(seed=s, top_k=10**12)]).tokens[0] for s in range(50)]
    assert huge == [sample(x, [row(seed=s, top_k=V)]).tokens[0] for s in range(50)]
    assert len(set(huge)) > 5


def test_min_new_tokens_masks_eog_until_reached() -> None:
    x = logits_with_peak(2, 9)
    assert sample(
        x, [row(temperature=0.0, min_new_tokens=2, max_new_tokens=5, output=(4,))]
    ).tokens == [9]
    assert sample(
        x, [row(temperature=0.0, min_new_tokens=2, max_new_tokens=5, output=(4, 4))]
    ).tokens == [2]


def test_penalties_follow_vllm_semantics() -> None:
    x = logits_with_peak(7, 8)
    assert sample(x, [row(temperature=0.0, repetition_penalty=2.0, prompt=(7,))]).tokens == [
        8
    ]  # 10/2 < 9
    assert sample(x, [row(temperature=0.0, presence_penalty=1.5, output=(7,))]).tokens == [8]
    assert sample(x, [row(temperature=0.0, frequency_penalty=0.4, output=(7, 7, 7))]).tokens == [8]
    assert sample(x, [row(temperature=0.0, frequency_penalty=0.4, output=(7, 7))]).tokens == [7]


def test_top_k_top_p_min_p_restrict_the_support() -> None:
    x = torch.zeros(1, V)
    x[0, :5] = torch.tensor([3.0, 2.9, 2.8, 2.7, 2.6])
    seen = {t for s in range(200) for t in sample(x, [row(seed=s, top_k=2)]).tokens}
    assert seen == {0, 1}
    seen = {t for s in range(200) for t in sample(x, [row(seed=s, top_p=0.01)]).tokens}
    assert seen == {0}
    seen = {t for s in range(200) for t in sample(x, [row(seed=s, min_p=0.85)]).tokens}
    assert seen <= {0, 1, 2} and 0 in seen


def test_top_p_keeps_the_token_that_crosses_it() -> None:
    """Top-p keeps the smallest prefix of the sorted tokens whose mass reaches top_p: the
    token that crosses it stays (SGLang, vLLM). Probabilities 0.5, 0.3, 0.15, 0.05 on ids
    7, 3, 9, 1 (the peak away from id 0, where a row with nothing left would land): top_p
    0.7 keeps {7, 3}, 0.4 keeps {7}, 0.85 keeps {7, 3, 9}."""
    x = torch.full((1, V), -math.inf)
    for tid, prob in ((7, 0.5), (3, 0.3), (9, 0.15), (1, 0.05)):
        x[0, tid] = math.log(prob)
    for top_p, support in ((0.7, {7, 3}), (0.4, {7}), (0.85, {7, 3, 9})):
        seen = {t for s in range(300) for t in sample(x.clone(), [row(seed=s, top_p=top_p)]).tokens}
        assert seen == support, top_p


def test_seed_gives_the_same_token_whatever_the_batch() -> None:
    x = torch.randn(4, V)
    alone = [sample(x[2:3], [row(seed=s, temperature=1.0)]).tokens[0] for s in range(20)]
    batched = [
        sample(
            x,
            [
                row(seed=99, temperature=0.5),
                row(temperature=0.0),
                row(seed=s, temperature=1.0),
                row(seed=1),
            ],
        ).tokens[2]
        for s in range(20)
    ]
    assert alone == batched and len(set(alone)) > 1


def test_logprobs_are_of_the_sampling_distribution() -> None:
    x = torch.randn(2, V)
    r = sample(x, [row(temperature=0.0), row(temperature=2.0)], want_logprobs=True)
    assert torch.allclose(r.logprobs[0], torch.log_softmax(x[0], -1))
    assert torch.allclose(r.logprobs[1], torch.log_softmax(x[1] / 2.0, -1))


@pytest.mark.parametrize(
    ("sampling", "options", "message"),
    [
        ({"top_p": -1}, {}, "top_p must be in (0, 1], got -1."),
        ({"temperature": math.nan}, {}, "temperature must be a finite number"),
        ({"repetition_penalty": 0}, {}, "repetition_penalty must be in (0, 2]"),
        ({"logit_bias": {V: 1}}, {}, "logit_bias must has keys in [0, 49]"),
        (
            {"min_new_tokens": 5, "max_new_tokens": 4},
            {},
            "min_new_tokens must be an integer in [0, 4]",
        ),
        ({"stop": [""]}, {}, "stop must be a list of non-empty strings"),
        ({"seed": 1.5}, {}, "seed must be a 64-bit integer"),
        ({"ignore_eos": 1}, {}, "ignore_eos must be a boolean"),
        ({"n": 65}, {}, "n must be an integer in [1, 64]"),
        ({"temperature": -1}, {}, "temperature must be at least 0, got -1."),
        ({"logit_bias": {1: 1e10}}, {}, "logit_bias[1] must be in [-1e+09, 1e+09]"),
        ({"stop_token_ids": [V]}, {}, "stop_token_ids has ids outside [0, 49]"),
        ({}, {"token_ids_logprob": [V]}, "token_ids_logprob has ids outside [0, 49]"),
        ({}, {"logprob_start_len": 3}, "logprob_start_len must be an integer in [-1, 2]"),
    ],
)
def test_invalid_fields_have_actionable_messages(
    sampling: dict, options: dict, message: str
) -> None:
    with pytest.raises(ValueError) as exc:
        parse_request(sampling, options, V, prompt_len=3)
    assert message in str(exc.value)


def test_defaults_and_nulls() -> None:
    p, o = parse_request({"temperature": None, "stop": "x"}, {}, V, 3)
    assert p == SamplingParams(stop=("x",)) and o.logprob_start_len == -1


def test_what_the_frontend_may_send_is_read() -> None:
    # The bounds are the frontend's, never stricter (tests/test_params.py checks all of it).
    p, _ = parse_request({"seed": -(2**63), "temperature": 1e7, "no_stop_trim": True}, {}, V, 3)
    assert (p.seed, p.temperature) == (-(2**63), 1e7)  # an unknown key is ignored
    full = replace(EVERY_SAMPLING_FIELD, seed=-3, n=3)
    assert SamplingParams.from_wire(full.to_wire(), V) == full


def test_prompt_logprobs_beyond_the_frame_budget_are_refused() -> None:
    opts = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 1000}
    with pytest.raises(ValueError, match="exceed the worker's frame budget"):
        parse_request({}, opts, 49152, prompt_len=8000)
    parse_request({}, {**opts, "logprob_start_len": 7990}, 49152, prompt_len=8000)


def test_a_row_of_non_finite_logits_is_marked_alone() -> None:
    """A NaN anywhere in a row, or a +inf, gives ``NON_FINITE`` for that row (the engine
    fails its request); the other rows draw what they draw without it, and a row whose
    tokens are all masked (-inf) but one is not a fault."""
    torch.manual_seed(0)
    x = torch.randn(5, V)

    def rows() -> list[SampleRow]:  # fresh generators for each draw
        return [row(temperature=0.0), row(seed=3, temperature=1.0), row(temperature=0.0),
                row(seed=4, temperature=0.7), row(temperature=0.0)]  # fmt: skip

    clean = sample(x.clone(), rows()).tokens
    bad = x.clone()
    bad[1, 5] = math.nan  # a sampled row
    bad[2, 0] = math.inf  # a greedy row
    bad[4, :] = -math.inf
    bad[4, 9] = 0.0  # everything masked but one token: sound
    got = sample(bad.clone(), rows()).tokens
    assert got == [clean[0], NON_FINITE, NON_FINITE, clean[3], 9]
    tokens, marked = sample_plain(bad, rows())
    assert marked.tolist() == got
    assert all(0 <= t < V for t in tokens.tolist())  # what the next step may read
