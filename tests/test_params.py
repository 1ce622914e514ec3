"""SGLang /generate validation: each rule gives its exact message; nothing else escapes."""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lifecycle.core.params import (
    GenerateRequest,
    RequestError,
    SamplingRequest,
    check_lengths,
    expand_samples,
    parse_generate,
    parse_sampling_params,
)
from lifecycle.core.sampling import FIELDS as SAMPLING_FIELDS
from lifecycle.core.states import Cause
from wire import SamplingParams, Submit, SubmitEntry, encode_frame, pack_ids

from .wire_schema import validate_frame

V = 49152  # SmolLM2's vocabulary size


def sp(**kw: Any) -> SamplingRequest:
    return parse_sampling_params(kw, vocab_size=V)


def gen(body: Any) -> GenerateRequest:
    return parse_generate(body, vocab_size=V)


def message_of(fn: Any, *args: Any, cause: Cause = Cause.INVALID) -> str:
    with pytest.raises(RequestError) as err:
        fn(*args)
    assert err.value.status == 400 and err.value.cause is cause
    return err.value.message


# -- sampling_params: SGLang verify() messages ---------------------------------------------


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"temperature": -0.5}, "temperature must be a non-negative finite number, got -0.5."),
        ({"temperature": -1}, "temperature must be a non-negative finite number, got -1."),
        (
            {"temperature": float("inf")},
            "temperature must be a non-negative finite number, got inf.",
        ),
        ({"top_p": -1}, "top_p must be in (0, 1], got -1."),
        ({"top_p": 0}, "top_p must be in (0, 1], got 0."),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5."),
        ({"min_p": 1.1}, "min_p must be in [0, 1], got 1.1."),
        ({"min_p": -0.1}, "min_p must be in [0, 1], got -0.1."),
        ({"top_k": 0}, "top_k must be -1 (disable) or at least 1, got 0."),
        ({"top_k": -2}, "top_k must be -1 (disable) or at least 1, got -2."),
        ({"frequency_penalty": 2.5}, "frequency_penalty must be in [-2, 2], got 2.5."),
        ({"presence_penalty": -3}, "presence_penalty must be in [-2, 2], got -3."),
        (
            {"repetition_penalty": 0},
            "repetition_penalty must be in (0, 2] (1.0 = no penalty), got 0.",
        ),
        (
            {"repetition_penalty": 2.1},
            "repetition_penalty must be in (0, 2] (1.0 = no penalty), got 2.1.",
        ),
        ({"min_new_tokens": -1}, "min_new_tokens must be in [0, max_new_tokens], got -1."),
        ({"max_new_tokens": -1}, "max_new_tokens must be at least 0, got -1."),
        (
            {"max_new_tokens": 4, "min_new_tokens": 5},
            "min_new_tokens must be in [0, max_new_tokens(4)], got 5.",
        ),
        ({"logit_bias": {str(V): 1.0}}, f"logit_bias must has keys in [0, {V - 1}], got {V}."),
        ({"logit_bias": {"-1": 1.0}}, f"logit_bias must has keys in [0, {V - 1}], got -1."),
        ({"logit_bias": {"abc": 1.0}}, f"logit_bias must has keys in [0, {V - 1}], got abc."),
        (
            {"json_schema": "{}", "regex": "a"},
            "Only one of regex, json_schema, or ebnf can be set.",
        ),
        ({"regex": "a+"}, "regex is not supported by this server"),
        ({"json_schema": "{}"}, "json_schema is not supported by this server"),
        ({"ebnf": "root ::= 'a'"}, "ebnf is not supported by this server"),
        ({"stop_regex": "x"}, "stop_regex is not supported by this server"),
        ({"custom_params": {"a": 1}}, "custom_params is not supported by this server"),
        ({"n": 0}, "n must be at least 1, got 0."),
        # The worker's limits, which SGLang lacks: refused here, never by the worker.
        ({"n": 65}, "n must be at most 64, got 65."),
        ({"stop_token_ids": [1, V]}, f"stop_token_ids must be in [0, {V - 1}], got {V}."),
        ({"logit_bias": {"5": 2e9}}, "logit_bias[5] must be in [-1e9, 1e9], got 2000000000.0."),
    ],
)
def test_sampling_rule_messages(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(RequestError) as err:
        sp(**kw)
    assert err.value.message == message and err.value.status == 400


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"foo": 1}, "Unknown sampling parameter: 'foo'."),
        ({"temperature": "0.5"}, "temperature must be a number, got '0.5'."),
        ({"temperature": True}, "temperature must be a number, got True."),
        ({"max_new_tokens": 1.5}, "max_new_tokens must be an integer, got 1.5."),
        ({"top_k": "5"}, "top_k must be an integer, got '5'."),
        ({"ignore_eos": 1}, "ignore_eos must be a boolean, got 1."),
        ({"stop": 5}, "stop must be a string or a list of strings, got 5."),
        ({"stop": ["a", 1]}, "stop must be a string or a list of strings, got ['a', 1]."),
        ({"stop": [""]}, "stop strings must not be empty."),
        ({"stop_token_ids": 5}, "stop_token_ids must be a list of integers, got 5."),
        ({"stop_token_ids": [-1]}, "stop_token_ids must be non-negative integers."),
        (
            {"logit_bias": [1]},
            "logit_bias must be an object mapping token ids to numbers, got [1].",
        ),
        ({"logit_bias": {"5": "x"}}, "logit_bias[5] must be a number, got 'x'."),
        ({"sampling_seed": 1, "seed": 2}, "Set only one of sampling_seed and seed."),
        ({"top_p": 10**400}, f"top_p is out of range, got {10**400}."),
        ({"logit_bias": {"1": -(10**400)}}, f"logit_bias[1] is out of range, got {-(10**400)}."),
        (
            {"sampling_seed": 1 << 64},
            f"sampling_seed must fit in a signed 64-bit integer, got {1 << 64}.",
        ),
    ],
)
def test_sampling_type_errors_are_400_not_500(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(RequestError) as err:
        sp(**kw)
    assert err.value.message == message


def test_sampling_defaults_and_explicit_null_is_default() -> None:
    assert sp() == SamplingRequest()
    nulls = {k: None for k in SAMPLING_FIELDS if k != "max_new_tokens"}
    assert sp(**nulls) == SamplingRequest()
    assert sp(max_new_tokens=None).max_new_tokens is None  # Optional: null = to the context end
    assert sp(stream_interval=4) == SamplingRequest()  # accepted, no effect
    assert sp(regex=None, json_schema=None) == SamplingRequest()


@pytest.mark.parametrize("t", [0, 0.0, 1e-7, 9.99e-7])
def test_tiny_temperature_is_greedy(t: float) -> None:
    p = sp(temperature=t, top_k=0)  # SGLang overwrites top_k before verify: no error
    assert (p.params.temperature, p.params.top_k, p.greedy) == (1.0, 1, True)


def test_sampling_values_are_converted() -> None:
    p = sp(
        temperature=0.7,
        top_p=1,
        top_k=-1,
        max_new_tokens=16.0,
        stop="</s>",
        stop_token_ids=[2, None, 2, 1],
        logit_bias={"5": 2, "7": -1.5},
        sampling_seed=42,
        n=3,
        skip_special_tokens=False,
    )
    w = p.params
    assert w.temperature == 0.7 and isinstance(w.top_p, float) and w.top_k == -1
    assert p.max_new_tokens == 16 and p.stop == ("</s>",) and w.stop_token_ids == (1, 2)
    assert w.logit_bias == ((5, 2.0), (7, -1.5)) and w.seed == 42 and p.n == 3
    assert sp(seed=7).params.seed == 7
    assert sp(logit_bias={}).params.logit_bias == ()


def test_to_wire_carries_only_non_defaults() -> None:
    assert SamplingRequest().to_wire(128) == {"max_new_tokens": 128}
    p = sp(temperature=0, stop=["x"], stop_token_ids=[3], logit_bias={"1": 1}, seed=-5, n=2)
    assert p.to_wire(10) == {
        "max_new_tokens": 10,
        "top_k": 1,
        "n": 2,
        "stop": ["x"],
        "stop_token_ids": [3],
        "logit_bias": {1: 1.0},
        "seed": -5,
    }
    assert "skip_special_tokens" not in sp(skip_special_tokens=False).to_wire(1)


def test_detokenizer_options_stay_in_the_frontend() -> None:
    # Regression (issue 16): no_stop_trim travelled on the wire and the worker never read
    # it. The worker's half (wire.SamplingParams) has no such field; the frontend keeps it.
    p = sp(no_stop_trim=True, skip_special_tokens=False, spaces_between_special_tokens=False)
    assert (p.no_stop_trim, p.skip_special_tokens, p.spaces_between_special_tokens) == (
        True,
        False,
        False,
    )
    assert p.to_wire(4) == {"max_new_tokens": 4} and p.params == SamplingParams()
    assert not {"no_stop_trim", "skip_special_tokens"} & {f.name for f in fields(SamplingParams)}


def test_length_is_settled_per_prompt() -> None:
    p = sp(max_new_tokens=None, min_new_tokens=50)
    assert p.max_new_tokens is None and p.to_context_end
    # What the context leaves (check_lengths) goes in; a larger minimum is capped to it.
    assert p.to_wire(10) == {"max_new_tokens": 10, "min_new_tokens": 10}
    assert sp(max_new_tokens=20, min_new_tokens=5).to_wire(20) == {
        "max_new_tokens": 20,
        "min_new_tokens": 5,
    }


def test_top_k_beyond_the_vocabulary_is_the_whole_vocabulary() -> None:
    assert sp(top_k=V).params.top_k == -1 and sp(top_k=10**30).params.top_k == -1
    assert sp(top_k=V - 1).params.top_k == V - 1


# -- /generate bodies ----------------------------------------------------------------------


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
def test_generate_rule_messages(body: Any, message: str) -> None:
    assert message_of(gen, body) == message


def test_single_text_defaults() -> None:
    req = gen({"text": "hello"})
    assert not req.is_batch and not req.stream and len(req.items) == 1
    item = req.items[0]
    assert (item.index, item.text, item.input_ids, item.client_rid) == (0, "hello", None, None)
    assert item.sampling == SamplingRequest()
    assert (item.return_logprob, item.logprob_start_len, item.top_logprobs_num) == (False, -1, 0)
    assert item.token_ids_logprob is None and not item.return_hidden_states


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
    a, b = req.items
    assert a.return_logprob and b.return_logprob
    assert (a.top_logprobs_num, b.top_logprobs_num) == (1, 2)
    assert a.token_ids_logprob == [5, 6] and b.token_ids_logprob == [5, 6]
    assert a.token_ids_logprob is not b.token_ids_logprob
    assert a.return_text_in_logprobs and (a.return_hidden_states, b.return_hidden_states) == (
        False,
        True,
    )
    req = gen({"text": ["a", "b"], "token_ids_logprob": [[1], []]})
    assert [i.token_ids_logprob for i in req.items] == [[1], None]
    assert gen({"text": "a", "token_ids_logprob": []}).items[0].token_ids_logprob is None
    assert gen({"text": "a", "token_ids_logprob": 7}).items[0].token_ids_logprob == [7]


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


# -- random bodies: only RequestError, never another exception ----------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.integers(-(10**400), 10**400)
    | st.floats()
    | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
FIELDS = [
    "text",
    "input_ids",
    "sampling_params",
    "stream",
    "rid",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "token_ids_logprob",
    "return_text_in_logprobs",
    "return_hidden_states",
    "image_data",
    "log_metrics",
]
SAMPLING_KEYS = list(SAMPLING_FIELDS) + [
    "sampling_seed",
    "regex",
    "json_schema",
    "x",
]
sampling_dicts = st.dictionaries(st.sampled_from(SAMPLING_KEYS), json_values, max_size=5)
bodies = st.one_of(
    json_values,
    st.fixed_dictionaries(
        {},
        optional={
            **{f: json_values for f in FIELDS},
            "text": st.text(max_size=5) | st.lists(st.text(max_size=3), max_size=3) | json_values,
            "input_ids": st.lists(st.integers(-2, V + 2), max_size=4)
            | st.lists(st.lists(st.integers(-2, V + 2), max_size=3), max_size=3)
            | json_values,
            "sampling_params": sampling_dicts | st.lists(sampling_dicts, max_size=3) | json_values,
            "rid": st.text(max_size=3) | st.lists(st.sampled_from(["a", "b", "c"]), max_size=3),
        },
    ),
)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bodies)
def test_random_bodies_raise_only_request_error(body: Any) -> None:
    try:
        req = gen(body)
    except RequestError as err:
        assert err.status == 400 and err.message
        return
    assert req.items and all(isinstance(i.sampling, SamplingRequest) for i in req.items)
    for item in req.items:
        item.sampling.to_wire(1)  # whatever validated can be put on the wire


@settings(max_examples=500, deadline=None)
@given(sampling_dicts)
def test_random_sampling_params_raise_only_request_error(obj: dict[str, Any]) -> None:
    try:
        p = parse_sampling_params(obj, vocab_size=V)
    except RequestError:
        return
    assert p.params.top_k == -1 or p.params.top_k >= 1
    assert 0.0 < p.params.top_p <= 1.0 and p.n >= 1


valid_sampling = st.fixed_dictionaries(
    {},
    optional={
        "max_new_tokens": st.none() | st.integers(0, 5000),
        "min_new_tokens": st.integers(0, 6000),
        "temperature": st.floats(0, 1e6) | st.integers(0, 3) | st.sampled_from([0.0, 1e-7]),
        "top_p": st.floats(1e-9, 1.0),
        "top_k": st.sampled_from([-1, 1]) | st.integers(1, 2 * V) | st.just(10**30),
        "min_p": st.floats(0, 1),
        "frequency_penalty": st.floats(-2, 2),
        "presence_penalty": st.floats(-2, 2),
        "repetition_penalty": st.floats(1e-9, 2),
        "stop": st.text(min_size=1, max_size=4) | st.lists(st.text(min_size=1), max_size=3),
        "stop_token_ids": st.lists(st.none() | st.integers(0, V - 1), max_size=4),
        "ignore_eos": st.booleans(),
        "no_stop_trim": st.booleans(),
        "skip_special_tokens": st.booleans(),
        "seed": st.integers(-(2**63), 2**63 - 1),
        "logit_bias": st.dictionaries(
            st.integers(0, V - 1).map(str), st.floats(-1e9, 1e9) | st.integers(-100, 100)
        ),
        "n": st.integers(1, 64),
    },
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_sampling | sampling_dicts, st.integers(1, 4000))
def test_whatever_the_frontend_accepts_the_worker_reads_back(
    obj: dict[str, Any], prompt_len: int
) -> None:
    """The two halves of one contract agree: the frontend's 400s cover every limit the
    worker's ``from_wire`` has, and what it sends is on spec (``specs/wire.cddl``)."""
    try:
        p = parse_sampling_params(obj, vocab_size=V)
        max_new = check_lengths(prompt_len, p.max_new_tokens, context_length=8192)
    except RequestError:
        return
    sent = p.to_wire(max_new)
    validate_frame(encode_frame(Submit([SubmitEntry(1, pack_ids([1] * prompt_len), sent, {})])))
    assert SamplingParams.from_wire(sent, vocab_size=V) == p.for_prompt(max_new)
