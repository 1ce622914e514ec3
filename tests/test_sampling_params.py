"""sampling_params: SGLang's verify() rules and messages, defaults, conversion, and what goes
on the wire."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import pytest

from lifecycle.core.params import (
    RequestError,
    SamplingRequest,
)
from lifecycle.core.sampling import FIELDS as SAMPLING_FIELDS
from wire import SamplingParams

from .params_helpers import V, sp

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
        ({"structural_tag": "x"}, "structural_tag is not supported by this server"),
        # stop_regex: compiled here, within the worker's bounds (wire.sampling).
        ({"stop_regex": 5}, "stop_regex must be a string or a list of strings, got 5."),
        (
            {"stop_regex": ["["]},
            "stop_regex '[' is not a valid regular expression: "
            "unterminated character set at position 0.",
        ),  # fmt: skip
        ({"stop_regex": "a*"}, "stop_regex 'a*' matches the empty string."),
        ({"stop_regex": "x" * 257}, "stop_regex patterns must be at most 256 characters, got 257."),
        ({"stop_regex": ["x"] * 17}, "stop_regex holds at most 16 patterns, got 17."),
        (
            {"stop_regex": "(a+)+b"},
            "stop_regex '(a+)+b' repeats a repeated part (like (a+)+), "
            "whose matching can take exponential time; write it without the nesting.",
        ),  # fmt: skip
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
        ({"regex": "a("}, "regex is not a valid grammar: at 1(8): invalid regex"),
        ({"json_schema": "{"}, "json_schema is not valid JSON: Expecting property name"),
        (
            {"json_schema": '{"type": "strin"}'},
            "json_schema is not a valid grammar: Invalid type: strin",
        ),
        ({"json_schema": "[1]"}, "json_schema must be a JSON object (a JSON Schema)."),
        ({"json_schema": 5}, "json_schema must be a string, got int."),
        ({"ebnf": "root ::= foo"}, "ebnf is not a valid grammar: Rule 'foo' not found."),
        ({"ebnf": 'root := "x"'}, "ebnf is not a valid grammar: Expected ::= at line 1"),
    ],
)
def test_grammar_messages(kw: dict[str, Any], message: str) -> None:
    """A bad constraint is a 400 with the grammar library's message (``wire.grammar``),
    before anything is queued; the message's start is ours, its detail llguidance's."""
    with pytest.raises(RequestError) as err:
        sp(**kw)
    assert err.value.message.startswith(message) and err.value.status == 400


def test_grammar_fields_reach_the_wire() -> None:
    """Each grammar field becomes the wire's ``grammar`` [kind, source]; an object schema
    travels as its JSON text."""
    assert sp(regex="[0-9]+").params.to_wire()["grammar"] == ["regex", "[0-9]+"]
    assert sp(ebnf='root ::= "a"').params.grammar == ("ebnf", 'root ::= "a"')
    wire = sp(json_schema={"type": "integer"}).params.to_wire()
    assert wire["grammar"] == ["json_schema", '{"type": "integer"}']
    assert SamplingParams.from_wire(wire, V).grammar == ("json_schema", '{"type": "integer"}')


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
def test_sampling_type_errors_are_400_not_500(
    kw: dict[str, Any], message: str, strict_fields: None
) -> None:
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
