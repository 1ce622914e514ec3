"""The /generate body: field rules and messages, batches, n, logprob options, lengths."""

from __future__ import annotations

import json
from typing import Any

import pytest

from lifecycle.core.params import (
    SamplingRequest,
    check_lengths,
    expand_samples,
)
from lifecycle.core.states import Cause
from wire import RequestOptions

from .params_helpers import V, gen, message_of


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ([1, 2], "The request body must be a JSON object."),
        ({}, "Either text, input_ids or input_embeds should be provided."),
        (
            {"text": None, "input_ids": None},
            "Either text, input_ids or input_embeds should be provided.",
        ),
        ({"text": "a", "input_ids": [1]}, "Provide either text or input_ids, not both."),
        ({"input_ids": []}, "input_ids cannot be empty."),
        ({"input_ids": [[1], []]}, "input_ids cannot be empty."),
        (
            {"input_ids": "abc"},
            "input_ids must be a list of integers or a list of lists of integers.",
        ),
        (
            {"input_ids": [1, "a"]},
            "input_ids must be a list of integers or a list of lists of integers.",
        ),
        (
            {"input_ids": [1, V]},
            f"The input_ids [1, {V}] contains values greater than the vocab size ({V}).",
        ),
        (
            {"input_ids": [[1], [V + 5]]},
            f"The input_ids [{V + 5}] contains values greater than the vocab size ({V}).",
        ),
        ({"input_ids": [1, -1]}, "The input_ids [1, -1] contains negative values."),
        ({"text": 5}, "text must be a string or a list of strings."),
        ({"text": []}, "text cannot be an empty list."),
        ({"text": "a", "stream": "yes"}, "stream must be a boolean, got 'yes'."),
        (
            {"text": "a", "return_text_in_logprobs": 1},
            "return_text_in_logprobs must be a boolean, got 1.",
        ),
        ({"text": "a", "return_logprob": "true"}, "return_logprob must be a boolean, got 'true'."),
        (
            {"text": "a", "logprob_start_len": -2},
            "logprob_start_len must be an integer >= -1, got -2.",
        ),
        (
            {"text": "a", "top_logprobs_num": -1},
            "top_logprobs_num must be an integer >= 0, got -1.",
        ),
        ({"text": "a", "foo": 1}, "Unknown field in the request body: 'foo'."),
        ({"text": "a", "image_data": "x.png"}, "image_data is not supported by this server"),
        ({"text": "a", "lora_path": "adapter"}, "lora_path is not supported by this server"),
        (
            {"text": "a", "session_params": {"id": "s"}},
            "session_params is not supported by this server",
        ),
        ({"text": "a", "input_embeds": [[0.1]]}, "input_embeds is not supported by this server"),
        (
            {"text": "a", "sampling_params": 3},
            "sampling_params must be an object or a list of objects.",
        ),
        (
            {"text": "a", "sampling_params": [{}]},
            "sampling_params must be an object for a single prompt.",
        ),
        (
            {"text": ["a", "b"], "sampling_params": [{}]},
            "The length of sampling_params (1) should be equal to the batch size (2).",
        ),
        (
            {"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 3}]},
            "The parallel_sample_num should be the same for all samples in sample params.",
        ),
        (
            {"text": ["a", "b"], "sampling_params": [{"n": 2}, {}]},
            "The parallel_sample_num should be the same for all samples in sample params.",
        ),
        (
            {"text": ["a", "b"], "rid": ["x", "x"]},
            "Duplicate request IDs detected within the request: ['x']",
        ),
        (
            {"text": ["a", "b"], "rid": ["x"]},
            "The specified rids length mismatch with the batch_size for batch processing.",
        ),
        ({"text": "a", "rid": 5}, "The rid should be a string or a list of strings."),
        ({"text": "a", "rid": ["x"]}, "The rid should be a string for a single request."),
        (
            {"text": ["a", "b"], "sampling_params": {"n": 2}, "return_logprob": [True, False]},
            "Cannot use list return_logprob with parallel_sample_num > 1",
        ),
        (
            {"text": ["a", "b"], "sampling_params": {"n": 2}, "top_logprobs_num": [1, 2]},
            "Cannot use list top_logprobs_num with parallel_sample_num > 1",
        ),
        (
            {"text": ["a", "b"], "sampling_params": {"n": 2}, "token_ids_logprob": [[1], [2]]},
            "Cannot use list token_ids_logprob with parallel_sample_num > 1",
        ),
        (
            {"text": ["a", "b"], "logprob_start_len": [1]},
            "The length of logprob_start_len (1) should be equal to the batch size (2).",
        ),
        (
            {"text": "a", "top_logprobs_num": [1]},
            "top_logprobs_num must be a single value for a single prompt.",
        ),
        (
            {"text": "a", "token_ids_logprob": [[1, 2]]},
            "token_ids_logprob must be a flat list of integers.",
        ),
        (
            {"text": "a", "token_ids_logprob": [1, "a"]},
            "token_ids_logprob must be a flat list of integers.",
        ),
        (
            {"text": "a", "token_ids_logprob": [1, True]},
            "token_ids_logprob must be a flat list of integers.",
        ),
        (
            {"text": "a", "token_ids_logprob": [1, V]},
            f"token_ids_logprob contains out-of-vocabulary token id {V}; valid range is [0, {V}).",
        ),
        (
            {"text": "a", "token_ids_logprob": -3},
            f"token_ids_logprob contains out-of-vocabulary token id -3; valid range is [0, {V}).",
        ),
        (
            {"text": ["a"] * 20, "sampling_params": {"n": 60}},
            "The request asks for 1200 sequences; at most 1024 are allowed.",
        ),
        (
            {"text": "a", "sampling_params": {"top_p": -1, "n": 3}},
            "top_p must be in (0, 1], got -1.",
        ),
    ],
)
def test_generate_rule_messages(body: Any, message: str, strict_fields: None) -> None:
    assert message_of(gen, body) == message


def test_single_text_defaults() -> None:
    req = gen({"text": "hello"})
    assert not req.is_batch and not req.stream and len(req.items) == 1
    item = req.items[0]
    assert (item.index, item.text, item.input_ids, item.client_rid) == (0, "hello", None, None)
    assert item.sampling == SamplingRequest()
    assert item.options == RequestOptions() and not item.return_text_in_logprobs


def test_ignored_and_null_unsupported_fields_are_accepted() -> None:
    req = gen(
        {"text": "a", "log_metrics": False, "priority": 3, "lora_path": None, "return_bytes": False}
    )
    assert len(req.items) == 1


def test_bench_serving_body_is_accepted() -> None:
    # What sglang.bench_serving sends (sglang.md §7).
    body = {
        "input_ids": [1, 2, 3],
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True},
        "stream": True,
        "lora_path": None,
        "return_logprob": False,
        "logprob_start_len": -1,
    }
    req = gen(json.loads(json.dumps(body)))
    item = req.items[0]
    assert (
        req.stream
        and item.input_ids == [1, 2, 3]
        and item.sampling.greedy
        and item.sampling.params.ignore_eos
    )


def test_batch_rid_prefix_and_list() -> None:
    req = gen({"input_ids": [[1], [2, 3]], "rid": "job"})
    assert req.is_batch and [i.client_rid for i in req.items] == ["job_0", "job_1"]
    assert [i.input_ids for i in req.items] == [[1], [2, 3]]
    req = gen({"text": ["a", "b"], "rid": ["p", "q"], "stream": True})
    assert [i.client_rid for i in req.items] == ["p", "q"] and req.stream
    assert gen({"text": "a", "rid": "only"}).items[0].client_rid == "only"


def test_single_prompt_with_n_becomes_a_batch_and_fans_out_by_repetition() -> None:
    req = gen({"text": "a", "sampling_params": {"n": 3}})
    assert req.is_batch and len(req.items) == 1 and req.items[0].sampling.n == 3
    req = gen({"text": ["p0", "p1"], "sampling_params": [{"n": 2, "top_k": 5}, {"n": 2}]})
    order = [(item.text, k) for item, k in expand_samples(req)]
    assert order == [("p0", 0), ("p1", 0), ("p0", 1), ("p1", 1)]
    assert req.items[0].sampling.params.top_k == 5 and req.items[1].sampling.params.top_k == -1


def test_logprob_options_broadcast_or_per_prompt() -> None:
    req = gen(
        {
            "text": ["a", "b"],
            "return_logprob": True,
            "top_logprobs_num": [1, 2],
            "logprob_start_len": 0,
            "token_ids_logprob": [5, 6],
            "return_text_in_logprobs": True,
            "return_hidden_states": [False, True],
        }
    )
    a, b = (item.options for item in req.items)
    assert a.return_logprob and b.return_logprob
    assert (a.top_logprobs_num, b.top_logprobs_num) == (1, 2)
    assert (a.logprob_start_len, b.logprob_start_len) == (0, 0)
    assert a.token_ids_logprob == (5, 6) and b.token_ids_logprob == (5, 6)
    assert req.items[0].return_text_in_logprobs and req.items[1].return_text_in_logprobs
    assert (a.return_hidden_states, b.return_hidden_states) == (False, True)
    req = gen({"text": ["a", "b"], "token_ids_logprob": [[1], []]})
    assert [i.options.token_ids_logprob for i in req.items] == [(1,), ()]
    assert gen({"text": "a", "token_ids_logprob": []}).items[0].options.token_ids_logprob == ()
    assert gen({"text": "a", "token_ids_logprob": 7}).items[0].options.token_ids_logprob == (7,)


# -- context length ------------------------------------------------------------------------


def test_check_lengths() -> None:
    assert check_lengths(10, 20, context_length=100) == 20
    assert check_lengths(10, None, context_length=100) == 90
    assert check_lengths(10, 0, context_length=100) == 0
    assert message_of(lambda: check_lengths(100, 1, context_length=100), cause=Cause.TOO_LONG) == (
        "The input (100 tokens) is longer than the model's context length (100 tokens)."
    )
    assert message_of(lambda: check_lengths(60, 40, context_length=100), cause=Cause.TOO_LONG) == (
        "Requested token count exceeds the model's maximum context length of 100 tokens. "
        "You requested a total of 100 tokens: 60 tokens from the input messages and 40 tokens "
        "for the completion. Please reduce the number of tokens in the input messages or the "
        "completion to fit within the limit."
    )
