"""The frontend and the worker accept exactly the same request options (issue 38): a
``/generate`` body's ``logprob_start_len``, ``top_logprobs_num`` and
``token_ids_logprob``, and an embed request's logprobs, are checked by the frontend with
the worker's own bounds (``wire.RequestOptions``), so nothing the frontend accepts is
refused by the worker later, and nothing it refuses would have run. The worker's side is
the real one (``gpu.runtime.sampling.parse_request``, which the scripted worker shares through
``wire.RequestOptions.from_wire``)."""

from __future__ import annotations

import itertools
from typing import Any

from gpu.runtime.sampling import parse_request
from lifecycle.core.errors import RequestError
from lifecycle.core.params import parse_generate
from wire import MAX_TOP_LOGPROBS, RequestOptions

VOCAB, PROMPT = 2048, 6
STARTS = [-2, -1, 0, PROMPT - 1, PROMPT, PROMPT + 5, 1.5]
TOPS = [-1, 0, 1, 20, MAX_TOP_LOGPROBS, MAX_TOP_LOGPROBS + 1, VOCAB + 1]
GIVEN = [None, [0], [VOCAB - 1], [VOCAB], [-1], [3, 3]]


def _frontend(options: dict[str, Any]) -> RequestOptions | None:
    """The options the frontend submits for ``options``, or None when it answers 400."""
    body = {"input_ids": list(range(1, PROMPT + 1)), **options}
    try:
        item = parse_generate(body, vocab_size=VOCAB).items[0]
        return item.request_options(VOCAB, PROMPT)
    except RequestError:
        return None


def _worker(options: dict[str, Any]) -> RequestOptions | None:
    """What the worker reads from the same values, or None when it refuses them."""
    wire_map = {k: v for k, v in options.items() if v is not None}
    try:
        return parse_request({"max_new_tokens": 4}, wire_map, VOCAB, PROMPT)[1]
    except ValueError:
        return None


def test_logprob_options_have_one_range() -> None:
    checked = refused = 0
    for start, top, given in itertools.product(STARTS, TOPS, GIVEN):
        options = {"return_logprob": True, "logprob_start_len": start,
                   "top_logprobs_num": top, "token_ids_logprob": given}  # fmt: skip
        ours, theirs = _frontend(options), _worker(options)
        assert (ours is None) == (theirs is None), (options, ours, theirs)
        if ours is not None:  # what the frontend sends reads back as itself
            assert RequestOptions.from_wire(ours.to_wire(), VOCAB, PROMPT) == ours
        checked += 1
        refused += ours is None
    assert 0 < refused < checked  # the grid has both sides of every bound


def test_the_prompt_logprob_budget_is_one_rule() -> None:
    """The frame budget for prompt logprobs depends on the prompt's length: a long
    prompt with many top logprobs per position is refused by both, before it runs, and
    one with fewer runs on both."""
    n = 10_000
    for top, runs in ((512, False), (5, True)):
        options = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": top}
        ours, theirs = _frontend_for(options, n), _worker_for(options, n)
        assert (ours is not None, theirs is not None) == (runs, runs), top


def _frontend_for(options: dict[str, Any], prompt_len: int) -> RequestOptions | None:
    item = parse_generate({"input_ids": [1] * prompt_len, **options}, vocab_size=VOCAB).items[0]
    try:
        return item.request_options(VOCAB, prompt_len)
    except RequestError as exc:
        assert "frame budget" in exc.message
        return None


def _worker_for(options: dict[str, Any], prompt_len: int) -> RequestOptions | None:
    try:
        return parse_request({"max_new_tokens": 1}, options, VOCAB, prompt_len)[1]
    except ValueError as exc:
        assert "frame budget" in str(exc)
        return None


def test_sampling_ranges_are_one_table() -> None:
    """The bounded sampling numbers (``wire.RANGES``): every value at and around each
    bound is accepted by the frontend exactly when the worker accepts it, and a refusal
    names the same interval on both sides."""
    from lifecycle.core.sampling import parse_sampling_params
    from wire import RANGES, SamplingParams

    for key, r in RANGES.items():
        for v in (r.lo - 0.5, r.lo, r.lo + 1e-9, r.default, r.hi, r.hi + 1e-9, r.hi + 0.5):
            try:
                parse_sampling_params({key: v}, vocab_size=VOCAB)
                ours = None
            except RequestError as exc:
                ours = exc.message
            try:
                SamplingParams.from_wire({key: v}, VOCAB)
                theirs = None
            except ValueError as exc:
                theirs = str(exc)
            assert (ours is None) == (theirs is None), (key, v, ours, theirs)
            if ours is not None and theirs is not None:
                assert ours == theirs == r.message(key, repr(v)), (ours, theirs)
