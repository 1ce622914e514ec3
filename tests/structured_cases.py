"""Constrained-decoding cases (issue 21): JSON schemas, regexes and one EBNF grammar.

Data only, shared by the structured-output tests and ``bench/grammar_libs.py``. Every
case is small enough that SmolLM2-135M sampling at temperature 1.0 finishes it inside its
``max_tokens``: arrays carry ``maxItems``, strings ``maxLength``, numbers a binary
``multipleOf`` (else a model may write digits until the budget ends; a binary step keeps
``jsonschema``'s float division exact), objects few properties and
``additionalProperties: false``. Digits are spelled ``[0-9]``, never ``\\d``: in the
Rust regex dialect llguidance reads, ``\\d`` is any Unicode digit, which a model can and
does emit.

Each schema has an ``example`` that validates against it (checked with ``jsonschema``),
used to walk a matcher token by token; each regex has one that ``re.fullmatch``-es it.
The EBNF grammar is in the GBNF-like dialect SGLang passes to xgrammar (``root ::= ...``);
``ebnf_matches`` tells whether a text obeys it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

__all__ = [
    "EBNF_EXAMPLE",
    "EBNF_GRAMMAR",
    "EBNF_MAX_TOKENS",
    "OPEN_INTEGER_PROMPT",
    "OPEN_INTEGER_SCHEMA",
    "REGEX_CASES",
    "SCHEMA_CASES",
    "RegexCase",
    "SchemaCase",
    "ebnf_matches",
]


@dataclass(frozen=True, slots=True)
class SchemaCase:
    name: str
    schema: dict[str, Any]
    example: Any  # a JSON value that validates against ``schema``
    max_tokens: int


@dataclass(frozen=True, slots=True)
class RegexCase:
    name: str
    pattern: str  # matched whole: the output must ``re.fullmatch`` it
    example: str
    max_tokens: int


def _obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    """A closed object schema; every property is required unless ``required`` says less."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


def _str(max_length: int, min_length: int = 1) -> dict[str, Any]:
    return {"type": "string", "minLength": min_length, "maxLength": max_length}


def _int(minimum: int, maximum: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": minimum, "maximum": maximum}


_POINT = _obj({"x": _int(-100, 100), "y": _int(-100, 100)})

SCHEMA_CASES: tuple[SchemaCase, ...] = (
    SchemaCase(
        "person",
        _obj({"name": _str(20), "age": _int(0, 120)}),
        {"name": "Ada Lovelace", "age": 36},
        60,
    ),
    SchemaCase(
        "flag",
        _obj({"enabled": {"type": "boolean"}, "reason": _str(30)}),
        {"enabled": True, "reason": "feature rollout"},
        60,
    ),
    SchemaCase(
        "enums",
        _obj(
            {
                "color": {"enum": ["red", "green", "blue"]},
                "shade": {"type": "string", "enum": ["light", "dark"]},
            }
        ),
        {"color": "green", "shade": "dark"},
        40,
    ),
    SchemaCase(
        "tags",
        _obj({"tags": {"type": "array", "items": _str(10), "minItems": 1, "maxItems": 3}}),
        {"tags": ["python", "llm"]},
        60,
    ),
    SchemaCase(
        "address",
        _obj(
            {
                "name": _str(20),
                "address": _obj(
                    {
                        "street": _str(30),
                        "city": _str(20),
                        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                    }
                ),
            }
        ),
        {"name": "Bob", "address": {"street": "12 High St", "city": "Leeds", "zip": "12345"}},
        100,
    ),
    SchemaCase(
        "temperature",
        _obj(
            {
                "temperature": {"type": "number", "minimum": -50, "maximum": 60, "multipleOf": 0.5},
                "unit": {"enum": ["C", "F"]},
            }
        ),
        {"temperature": 21.5, "unit": "C"},
        50,
    ),
    SchemaCase(
        "nullable",
        _obj(
            {
                "nickname": {"type": ["string", "null"], "maxLength": 15},
                "score": {"type": ["integer", "null"], "minimum": 0, "maximum": 100},
            }
        ),
        {"nickname": None, "score": 87},
        50,
    ),
    SchemaCase(
        "any_of",
        _obj({"value": {"anyOf": [_int(0, 1000), _str(10)]}, "label": _str(12)}),
        {"value": "ten", "label": "count"},
        50,
    ),
    SchemaCase(
        "defs_ref",
        {
            "$defs": {"point": _POINT},
            **_obj({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}}),
        },
        {"start": {"x": 0, "y": -3}, "end": {"x": 42, "y": 7}},
        70,
    ),
    SchemaCase(
        "phone",
        _obj(
            {
                "name": _str(16),
                "phone": {"type": "string", "pattern": "^\\+?[0-9]{3}-[0-9]{3}-[0-9]{4}$"},
            }
        ),
        {"name": "Office", "phone": "+555-123-4567"},
        60,
    ),
    SchemaCase(
        "event_date",
        _obj(
            {
                "event": _str(20),
                "date": {
                    "type": "string",
                    "pattern": "^[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])$",
                },
            }
        ),
        {"event": "launch", "date": "2026-12-03"},
        60,
    ),
    SchemaCase(
        "order_lines",
        _obj(
            {
                "lines": {
                    "type": "array",
                    "items": _obj({"id": _int(1, 999), "qty": _int(1, 10)}),
                    "minItems": 1,
                    "maxItems": 3,
                }
            }
        ),
        {"lines": [{"id": 17, "qty": 2}, {"id": 401, "qty": 1}]},
        90,
    ),
    SchemaCase(
        "code",
        _obj({"code": _str(6, min_length=3), "active": {"type": "boolean"}}),
        {"code": "AB12", "active": False},
        40,
    ),
    SchemaCase(
        "digits",
        {"type": "array", "items": _int(0, 9), "minItems": 2, "maxItems": 5},
        [3, 1, 4],
        30,
    ),
    SchemaCase(
        "status",
        _obj(
            {
                "kind": {"const": "response"},
                "status": {"enum": [200, 404, 500]},
                "ok": {"type": "boolean"},
            }
        ),
        {"kind": "response", "status": 404, "ok": False},
        40,
    ),
    SchemaCase(
        "optional",
        _obj({"title": _str(20), "subtitle": _str(20)}, required=["title"]),
        {"title": "Notes"},
        60,
    ),
    SchemaCase(
        "shape",
        {
            "anyOf": [
                _obj(
                    {
                        "kind": {"const": "circle"},
                        "r": {"type": "number", "minimum": 0, "maximum": 100, "multipleOf": 0.25},
                    }
                ),
                _obj({"kind": {"const": "rect"}, "w": _int(1, 100), "h": _int(1, 100)}),
            ]
        },
        {"kind": "rect", "w": 4, "h": 3},
        50,
    ),
    SchemaCase(
        "matrix",
        _obj(
            {
                "m": {
                    "type": "array",
                    "items": {"type": "array", "items": _int(-9, 9), "minItems": 2, "maxItems": 2},
                    "minItems": 2,
                    "maxItems": 2,
                }
            }
        ),
        {"m": [[1, 0], [0, -1]]},
        50,
    ),
    SchemaCase(
        "probability",
        _obj(
            {
                "label": {"enum": ["spam", "ham"]},
                "p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1, "multipleOf": 0.125},
            }
        ),
        {"label": "ham", "p": 0.875},
        40,
    ),
    SchemaCase(
        "tool_call",
        _obj(
            {
                "name": {"enum": ["get_weather", "get_time"]},
                "arguments": _obj({"city": _str(20), "days": _int(1, 7)}, required=["city"]),
            }
        ),
        {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},
        70,
    ),
)

_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_VERSION_PART = "(0|[1-9][0-9]{0,2})"

REGEX_CASES: tuple[RegexCase, ...] = (
    RegexCase("date", "[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])", "2026-12-03", 20),
    RegexCase("phone", "\\([0-9]{3}\\) [0-9]{3}-[0-9]{4}", "(555) 123-4567", 20),
    RegexCase("ipv4", f"({_OCTET}\\.){{3}}{_OCTET}", "192.168.0.254", 20),
    RegexCase(
        "email", "[a-z][a-z0-9._]{0,15}@[a-z]{2,10}\\.(com|org|net)", "ada.l@example.org", 30
    ),
    RegexCase("yes_no", "(yes|no)", "yes", 5),
    RegexCase("hex_colour", "#[0-9a-fA-F]{6}", "#1e90FF", 10),
    RegexCase("semver", f"{_VERSION_PART}\\.{_VERSION_PART}\\.{_VERSION_PART}", "1.9.10", 15),
    RegexCase("time_24h", "([01][0-9]|2[0-3]):[0-5][0-9]", "23:59", 10),
    RegexCase("zip", "[0-9]{5}(-[0-9]{4})?", "12345-6789", 15),
    RegexCase(
        "uuid",
        "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
        "123e4567-e89b-12d3-a456-426614174000",
        40,
    ),
)

# Issue 53, point 4: the schema of a chat request whose integer is left open (no bounds,
# the object open too). Greedy, SmolLM2 wrote ``"population": 1111...`` for the prompt until
# max_tokens ran out, before numbers were bounded by default (``wire.grammar.bound_numbers``).
OPEN_INTEGER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                   "population": {"type": "integer"}},
    "required": ["city", "country", "population"],
}  # fmt: skip
OPEN_INTEGER_PROMPT = "Give me the city, country and population of Manila as JSON."

# One to four "name: value" lines; a value is an integer, a quoted word or a boolean.
EBNF_GRAMMAR = r"""root ::= entry ("\n" entry){0,3}
entry ::= name ": " value
name ::= [a-z] [a-z_]{0,11}
value ::= integer | quoted | boolean
integer ::= "-"? [0-9]{1,6}
quoted ::= "\"" [a-zA-Z ]{0,16} "\""
boolean ::= "true" | "false"
"""
EBNF_EXAMPLE = 'name: "Ada"\nage: 36\nactive: true'
EBNF_MAX_TOKENS = 80

_ENTRY = '[a-z][a-z_]{0,11}: (?:-?[0-9]{1,6}|"[a-zA-Z ]{0,16}"|true|false)'
_EBNF_RE = re.compile(f"{_ENTRY}(?:\\n{_ENTRY}){{0,3}}")


def ebnf_matches(text: str) -> bool:
    """Whether ``text`` is in the language of ``EBNF_GRAMMAR`` (the same language, as a regex)."""
    return _EBNF_RE.fullmatch(text) is not None
