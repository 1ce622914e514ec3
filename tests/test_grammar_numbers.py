"""Numbers in a JSON schema end (issue 53, point 4): ``wire.grammar.bound_numbers``.

An ``integer`` or ``number`` a schema leaves open gets default bounds before llguidance
compiles it: integers int64 less its 1024 lowest values (at most 19 digits), numbers under
1e16 with at most 10 digits after the point. Checked on real llguidance matchers over the
bundled model's tokenizer, through ``to_llguidance`` as the frontend and the worker call
it, for a json_schema and for a tool call's ``%json`` arguments. The model end to end:
``tests/test_structured_model.py::test_an_open_integer_ends_within_80_tokens``.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lifecycle.chat.tool_params import ToolSpec, tool_grammar
from wire.grammar import INTEGER_BOUNDS, NUMBER_STEP, bound_numbers, check_grammar, to_llguidance

from .structured_cases import OPEN_INTEGER_SCHEMA
from .tool_cases import call_block

INT = {"minimum": INTEGER_BOUNDS[0], "maximum": INTEGER_BOUNDS[1]}
NUM = {"exclusiveMinimum": -1e16, "exclusiveMaximum": 1e16, "multipleOf": NUMBER_STEP}


@cache
def _ll_tokenizer() -> Any:
    import llguidance

    from modelfile.vocab import load_tokenizer

    tok, _, config = load_tokenizer()
    return llguidance.LLTokenizer(
        tok.backend.to_str(), n_vocab=config.vocab_size, eos_token=list(config.eog_ids)
    )


@cache
def _compiled(kind: str, source: str) -> Any:
    import llguidance

    matcher = llguidance.LLMatcher(_ll_tokenizer(), to_llguidance(kind, source))
    assert not matcher.is_error(), matcher.get_error()
    return matcher


def _accepts(kind: str, source: str, text: str) -> bool:
    """The grammar admits ``text`` whole."""
    matcher = _compiled(kind, source).deep_copy()
    ids = _ll_tokenizer().tokenize_str(text)
    return matcher.validate_tokens(ids) == len(ids) and (
        matcher.consume_tokens(ids) and matcher.is_accepting()
    )


def _continues(kind: str, source: str, text: str) -> bool:
    """The grammar admits ``text`` as the start of an output."""
    ids = _ll_tokenizer().tokenize_str(text)
    return _compiled(kind, source).deep_copy().validate_tokens(ids) == len(ids)


def _schema(schema: dict[str, Any], text: str) -> bool:
    return _accepts("json_schema", json.dumps(schema), text)


def test_open_numbers_are_bounded_at_every_depth_and_a_schemas_own_bounds_kept() -> None:
    i, n = {"type": "integer"}, {"type": "number"}
    schema: dict[str, Any] = {
        "type": "object",
        "$defs": {"count": i},
        "properties": {
            "a": i, "b": {"type": ["integer", "null"]}, "c": {"type": "array", "items": n},
            "d": {"anyOf": [i, {"type": "string"}]}, "e": {"oneOf": [n, {"$ref": "#/$defs/count"}]},
            "f": {"type": "object", "properties": {"g": i}, "additionalProperties": n},
            "h": {"prefixItems": [i], "items": False},
            "kept": {"type": "integer", "maximum": 100},
            "excl": {"type": "number", "exclusiveMinimum": 0},
            "data": {"type": "integer", "enum": [1, 2]}, "fixed": {"const": 12345678901234567890123},
        },
        "patternProperties": {"^x": i},
        "additionalProperties": {"allOf": [n]},
    }  # fmt: skip
    bounded = bound_numbers(schema)
    p = bounded["properties"]
    assert bounded["$defs"]["count"] == {**i, **INT}
    assert p["a"] == {**i, **INT} and p["b"] == {"type": ["integer", "null"], **INT}
    assert p["c"]["items"] == {**n, **NUM}
    assert p["d"]["anyOf"] == [{**i, **INT}, {"type": "string"}]
    assert p["e"]["oneOf"] == [{**n, **NUM}, {"$ref": "#/$defs/count"}]
    assert p["f"]["properties"]["g"] == {**i, **INT}
    assert p["f"]["additionalProperties"] == {**n, **NUM}
    assert p["h"] == {"prefixItems": [{**i, **INT}], "items": False}
    assert p["kept"] == {"type": "integer", "maximum": 100, "minimum": INTEGER_BOUNDS[0]}
    assert p["excl"] == {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1e16,
                         "multipleOf": NUMBER_STEP}  # fmt: skip
    assert p["data"] == schema["properties"]["data"] and p["fixed"] == schema["properties"]["fixed"]
    assert bounded["patternProperties"]["^x"] == {**i, **INT}
    assert bounded["additionalProperties"] == {"allOf": [{**n, **NUM}]}
    assert schema["properties"]["a"] == i  # the caller's schema is not changed
    assert bound_numbers({"type": "object"}) == {"type": "object"} and bound_numbers(True) is True


@pytest.mark.parametrize(
    ("population", "ok"),
    [
        ("0", True), ("-42", True), ("8336817", True),
        (str(2**63 - 1), True), (str(INTEGER_BOUNDS[0]), True),
        ("1" * 20, False), ("1" * 30, False), (str(2**63), False), (str(-(2**63) - 1), False),
        # llguidance cannot take -2**63 as a bound: int64's 1024 lowest values are out
        (str(-(2**63)), False), (str(INTEGER_BOUNDS[0] - 1), False),
    ],
)  # fmt: skip
def test_an_open_integer_is_int64(population: str, ok: bool) -> None:
    text = f'{{"city": "Manila", "country": "Philippines", "population": {population}}}'
    assert _schema(OPEN_INTEGER_SCHEMA, text) is ok


def test_a_twentieth_digit_is_refused_as_it_is_written() -> None:
    """The output is bounded: after 19 digits the grammar admits no digit more."""
    head = '{"city": "M", "country": "P", "population": '
    source = json.dumps(OPEN_INTEGER_SCHEMA)
    assert _continues("json_schema", source, head + "1" * 19)
    assert not _continues("json_schema", source, head + "1" * 20)


@settings(max_examples=60, deadline=None)
@given(st.integers(INTEGER_BOUNDS[0], INTEGER_BOUNDS[1]), st.integers(20, 40))
def test_any_int64_but_no_20_digit_integer(value: int, digits: int) -> None:
    assert _schema({"type": "integer"}, str(value))
    assert not _schema({"type": "integer"}, str(10 ** (digits - 1) + value % 10))
    assert not _schema({"type": "integer"}, f"-{10 ** (digits - 1)}")


@pytest.mark.parametrize(
    ("number", "ok"),
    [
        ("0", True), ("3.25", True), ("-0.5", True), ("9" * 16, True), ("-" + "9" * 16, True),
        ("1234567890123456.0123456789", True), ("1." + "1" * 10, True),
        ("1" * 17, False), ("1." + "1" * 11, False), ("1e5", False), ("1" * 40, False),
    ],
)  # fmt: skip
def test_an_open_number_has_16_digits_before_the_point_and_10_after(number: str, ok: bool) -> None:
    assert _schema({"type": "number"}, number) is ok


@pytest.mark.parametrize(
    ("schema", "text", "ok"),
    [
        ({"type": "integer", "maximum": 100}, "100", True),
        ({"type": "integer", "maximum": 100}, "101", False),
        ({"type": "integer", "maximum": 100}, str(INTEGER_BOUNDS[0]), True),  # default below
        ({"type": "integer", "exclusiveMinimum": 0}, "0", False),
        ({"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25}, "0.75", True),
        ({"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25}, "1.25", False),
        ({"type": "number", "maximum": 1e18}, "1" * 18, True),  # above the default 1e16
        ({"type": "number", "multipleOf": 0.001}, "0.125", True),
        ({"type": "number", "multipleOf": 0.001}, "0.1251", False),
    ],
)  # fmt: skip
def test_a_schemas_own_bounds_apply(schema: dict[str, Any], text: str, ok: bool) -> None:
    assert _schema(schema, text) is ok


def test_a_tool_calls_integer_arguments_are_bounded() -> None:
    params = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    tools = ({"type": "function", "function": {"name": "count", "parameters": params}},)
    grammar = tool_grammar(ToolSpec(tools, "function", "count", False))
    assert _accepts("lark", grammar, call_block("count", {"n": 2**63 - 1}))
    assert not _accepts("lark", grammar, call_block("count", {"n": 10**19}))
    # "%json" in a literal or a comment is text, not a schema
    quoted = 'start: "%json {\\"type\\": \\"integer\\"}" // %json {"type": "integer"}\n'
    assert to_llguidance("lark", quoted).count("minimum") == 0


@pytest.mark.parametrize(
    ("schema", "text", "ok"),
    [
        ({"allOf": [{"type": "number"}, {"multipleOf": 0.5}]}, "1.5", True),
        ({"allOf": [{"type": "number"}, {"multipleOf": 0.5}]}, "1.25", False),
        ({"type": "number", "anyOf": [{"multipleOf": 3}, {"type": "string"}]}, "12", True),
        ({"allOf": [{"type": "number"}, {"type": "number"}]}, "0.5", True),
        ({"type": "number", "$defs": {"n": {"type": "number"}}, "$ref": "#/$defs/n"}, "7.5", True),
    ],
)  # fmt: skip
def test_a_multipleof_anywhere_means_no_default_step(
    schema: dict[str, Any], text: str, ok: bool
) -> None:
    """llguidance intersects two multipleOf by their least common multiple in 32-bit
    integers: the default 1e-10 with the schema's 0.5 overflows it, and the grammar
    admitted nothing. A schema that sets a multipleOf anywhere gets no default step."""
    assert _schema(schema, text) is ok
    if "multipleOf" in json.dumps(schema):
        assert json.dumps(bound_numbers(schema)).count("multipleOf") == 1


@pytest.mark.parametrize(
    ("kind", "source"),
    [
        ("json_schema", '{"const": -9223372036854775807}'),
        ("json_schema", '{"type": "array", "items": {"enum": [1, -9223372036854775296]}}'),
        ("lark", 'start: %json {"const": [-9223372036854775808]}'),
    ],
)
def test_integers_that_crash_llguidance_are_refused(kind: str, source: str) -> None:
    """llguidance 1.9.1 crashes the process compiling these; a client must get a 400."""
    with pytest.raises(ValueError, match="cannot take"):
        check_grammar(kind, source)
    check_grammar("json_schema", '{"const": -9223372036854775295}')  # just above: compiles


def test_an_integer_past_the_double_range_is_a_clear_error_not_a_crash() -> None:
    """Regression: the check for llguidance's crashing integers converted every integer
    to a float, and one past the double range raised OverflowError (a 500) instead of
    the library's ValueError (a 400); found by tests/test_params_fuzz.py."""
    huge = "1" + "0" * 400
    for source in (f'{{"const": {huge}}}', f'{{"type": "integer", "maximum": {huge}}}'):
        with pytest.raises(ValueError):
            check_grammar("json_schema", source)
