"""Objects in a JSON schema end (issue 53, point 4): ``wire.grammar.close_objects``.

An object schema that lists its ``properties`` and says nothing else of its keys admits
those keys only, as xgrammar's strict mode (SGLang's and vLLM's default) does: a model
cannot add keys until ``max_new_tokens`` runs out (SmolLM2 did on 29 of 80 prompts with
the population schema once its numbers were bounded). ``additionalProperties: true``
keeps an object open; ``allOf`` branches, ``$ref`` and compositions are left as they are.
Checked on real llguidance matchers over the bundled model's tokenizer."""

from __future__ import annotations

import json
from typing import Any

from wire.grammar import close_objects

from .structured_cases import OPEN_INTEGER_SCHEMA
from .test_grammar_numbers import _accepts


def _schema(schema: dict[str, Any], text: str) -> bool:
    return _accepts("json_schema", json.dumps(schema), text)


def test_an_object_listing_its_properties_takes_no_other_key() -> None:
    s = OPEN_INTEGER_SCHEMA
    assert _schema(s, '{"city": "Paris", "country": "France", "population": 2100000}')
    assert not _schema(
        s, '{"city": "Paris", "country": "France", "population": 2100000, "area": 105}'
    )
    nested = {
        "type": "object",
        "properties": {"p": {"type": "object", "properties": {"q": {"type": "string"}}}},
    }
    assert _schema(nested, '{"p": {"q": "x"}}')
    assert not _schema(nested, '{"p": {"q": "x", "r": "y"}}')
    assert not _schema(nested, '{"p": {"q": "x"}, "z": 1}')


def test_an_object_that_says_more_of_its_keys_keeps_its_word() -> None:
    open_ = {
        "type": "object",
        "properties": {"a": {"type": "string"}},
        "additionalProperties": True,
    }
    assert _schema(open_, '{"a": "x", "b": 1}')
    typed = {"type": "object", "properties": {"a": {"type": "string"}},
             "additionalProperties": {"type": "integer"}}  # fmt: skip
    assert _schema(typed, '{"a": "x", "b": 1}') and not _schema(typed, '{"a": "x", "b": "y"}')
    free = {"type": "object"}  # no properties listed: any object
    assert _schema(free, '{"b": 1}')


def test_compositions_and_references_are_left_as_they_are() -> None:
    a = {"type": "object", "properties": {"a": {"type": "string"}}}
    b = {"type": "object", "properties": {"b": {"type": "string"}}}
    both = {"allOf": [a, b]}
    assert close_objects(both) == both  # closed branches with other names admit nothing
    assert _schema(both, '{"a": "x", "b": "y"}')
    ref = {"$defs": {"a": a}, "type": "object", "properties": {"x": {"type": "string"}},
           "$ref": "#/$defs/a"}  # fmt: skip
    assert "additionalProperties" not in close_objects(ref)
    either = {"anyOf": [a, b]}
    closed = close_objects(either)
    assert all(branch["additionalProperties"] is False for branch in closed["anyOf"])
    assert close_objects(True) is True and close_objects({"type": "string"}) == {"type": "string"}
