"""The output constraint of a SUBMIT entry (``specs/wire.cddl`` ``grammar``): one definition.

A request may carry one grammar its output must match: ``[kind, source]`` with ``kind``
one of ``GRAMMAR_KINDS``. The source travels as the client wrote it; both sides read it
with the same ``to_llguidance``, which turns it into an llguidance grammar
(``llguidance.LLMatcher``: JSON schema, regular expression and Lark grammars, one Rust
core; docs/structured.md has the measurements behind the choice):

- ``json_schema``: a JSON Schema as JSON text. Output is compact JSON with
  ``json.dumps``' separators (``", "``, ``": "``) and no other whitespace, so a model
  cannot spend its budget on blank space; a keyword llguidance does not implement is
  refused, never silently ignored. Every ``integer`` and ``number`` in it is bounded
  (``bound_numbers``), so a model cannot write digits until its budget ends, and an
  object that lists its ``properties`` has those only unless it says otherwise
  (``close_objects``, as xgrammar's strict mode: SGLang's and vLLM's default), so a
  model cannot add keys until its budget ends.
- ``regex``: the whole output matches it (Rust ``regex`` syntax, as llguidance reads it).
- ``ebnf``: SGLang's EBNF (the GBNF dialect: ``root ::= ...``), translated to Lark by
  llguidance's own ``gbnf_to_lark``; what it cannot translate is refused with its message.
- ``lark``: llguidance's Lark dialect as it is (the frontend builds these for tool calls;
  ``%json {...}`` embeds a JSON schema, whose numbers are bounded as a json_schema's).

The frontend checks a grammar before anything is queued (``check_grammar``: a bad one is
a 400 with the library's message); the worker compiles it against its tokenizer, once
per distinct grammar (``gpu/runtime/grammar.py``).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator
from typing import Any

__all__ = [
    "GRAMMAR_KINDS",
    "GRAMMAR_MAX_CHARS",
    "INTEGER_BOUNDS",
    "JSON_SEPARATORS",
    "NUMBER_LIMIT",
    "NUMBER_STEP",
    "bound_numbers",
    "close_objects",
    "check_grammar",
    "grammar_from_wire",
    "to_llguidance",
]

GRAMMAR_KINDS = ("json_schema", "regex", "ebnf", "lark")
# A grammar's source rides in every SUBMIT of its request; 256 KiB holds any schema a
# client writes by hand and keeps one request from filling a frame (64 MiB).
GRAMMAR_MAX_CHARS = 256 * 1024
JSON_SEPARATORS = (", ", ": ")  # item, key: json.dumps' defaults
_JSON_OPTIONS = {
    "item_separator": JSON_SEPARATORS[0],
    "key_separator": JSON_SEPARATORS[1],
    "whitespace_flexible": False,
}
# The bounds a schema's integer or number gets on a side it leaves open (docs/structured.md,
# "Numbers"). llguidance reads a bound as a double and writes the digits' regex from it:
# - integers: int64 less its 1024 lowest values. -2**63 does not compile (the regex
#   builder negates it), and the next double up is -(2**63 - 1024).
# - numbers: under 1e16 in magnitude (16 digits before the point), and when the schema
#   sets no ``multipleOf`` anywhere, a multiple of 1e-10 (at most 10 after it; the finest
#   power of ten llguidance's ``multipleOf`` reads exactly). A bounded number has no exponent.
INTEGER_BOUNDS = (-(2**63) + 1024, 2**63 - 1)
NUMBER_LIMIT = 1e16
NUMBER_STEP = 1e-10
# Keywords whose value is a schema or a list of them, and those whose value maps names to
# schemas (JSON Schema 2020-12, with draft 7's definitions, dependencies, additionalItems).
_SUBSCHEMAS = frozenset(
    ("additionalItems", "additionalProperties", "allOf", "anyOf", "contains", "else", "if",
     "items", "not", "oneOf", "prefixItems", "propertyNames", "then", "unevaluatedItems",
     "unevaluatedProperties")
)  # fmt: skip
_SCHEMA_MAPS = frozenset(
    ("$defs", "definitions", "dependencies", "dependentSchemas", "patternProperties", "properties")
)
# llguidance 1.9.1 crashes the process (SIGSEGV) compiling an integer literal (a const, an
# enum value) that is -2**63 as a double: one from -2**63 to -2**63 + 512.
_CRASHING_INTEGERS = (-(2**63), -(2**63) + 512)
# What in a Lark grammar can hold the text "%json" without being the directive (comments,
# string and regex literals), and the directive.
_LARK_TOKEN = re.compile(r'//[^\n]*|"(?:[^"\\\n]|\\.)*"|/(?:[^/\\\n]|\\.)+/|%json\b\s*')
_JSON_DECODER = json.JSONDecoder()


# What beside ``properties`` says more of an object's keys than they do: its own rule for
# the others, or a composition or reference whose branches may name more.
_OPEN_BESIDE = frozenset(
    ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf", "anyOf",
     "oneOf", "$ref", "$dynamicRef", "if", "then", "else", "not", "dependentSchemas",
     "dependencies")
)  # fmt: skip


def close_objects(schema: Any, in_all_of: bool = False) -> Any:
    """``schema`` with ``additionalProperties: false`` on each object schema that lists
    ``properties`` and says nothing else of its keys (``_OPEN_BESIDE``), at any depth.
    An ``allOf`` branch is left open: closed branches that name different properties
    would admit no object together. ``"additionalProperties": true`` keeps one open."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            value = {name: close_objects(sub) for name, sub in value.items()}
        elif key in _SUBSCHEMAS and isinstance(value, list):
            value = [close_objects(sub, in_all_of=key == "allOf") for sub in value]
        elif key in _SUBSCHEMAS:
            value = close_objects(value)
        out[key] = value
    if isinstance(out.get("properties"), dict) and not in_all_of and not _OPEN_BESIDE & out.keys():
        out["additionalProperties"] = False
    return out


def _bounded_schema(schema: Any) -> Any:
    """What llguidance compiles for a client's schema: objects closed, numbers bounded."""
    return bound_numbers(close_objects(schema))


def bound_numbers(schema: Any) -> Any:
    """``schema`` with a bound on each side that an ``integer`` or ``number`` in it leaves
    open, at any depth (properties, items, anyOf/oneOf/allOf branches, $defs...), and a
    ``multipleOf`` on each number when the schema sets none anywhere. What the schema sets
    is kept; data (``const``, ``enum``, ``default``, ``examples``) is not touched."""
    # llguidance intersects two multipleOf by their least common multiple in 32-bit
    # integers, and 1e-10 overflows it with most others (the schema would admit nothing).
    own_step = any(isinstance(v, dict) and "multipleOf" in v for v in _nested(schema))
    return _bounded(schema, None if own_step else NUMBER_STEP)


def _bounded(schema: Any, step: float | None) -> Any:
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            value = {name: _bounded(sub, step) for name, sub in value.items()}
        elif key in _SUBSCHEMAS and isinstance(value, list):
            value = [_bounded(sub, step) for sub in value]
        elif key in _SUBSCHEMAS:
            value = _bounded(value, step)
        out[key] = value
    return out | _default_bounds(out, step)


def _default_bounds(schema: dict[str, Any], step: float | None) -> dict[str, Any]:
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds if isinstance(kinds, list) else []
    if "const" in schema or "enum" in schema or not ("integer" in kinds or "number" in kinds):
        return {}
    if "number" in kinds:
        low, high = ("exclusiveMinimum", -NUMBER_LIMIT), ("exclusiveMaximum", NUMBER_LIMIT)
    else:
        low, high = ("minimum", INTEGER_BOUNDS[0]), ("maximum", INTEGER_BOUNDS[1])
    add: dict[str, Any] = {}
    if "minimum" not in schema and "exclusiveMinimum" not in schema:
        add[low[0]] = low[1]
    if "maximum" not in schema and "exclusiveMaximum" not in schema:
        add[high[0]] = high[1]
    if "number" in kinds and step is not None:
        add["multipleOf"] = step
    return add


def _nested(value: Any) -> Iterator[Any]:
    """``value`` and every value nested in it."""
    stack = [value]
    while stack:
        v = stack.pop()
        yield v
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)


def _refuse_crashing_integers(value: Any) -> None:
    for v in _nested(value):
        # in integers: a float() of one past the double range would raise OverflowError
        if type(v) is int and _CRASHING_INTEGERS[0] <= v <= _CRASHING_INTEGERS[1]:
            raise ValueError(
                f"json_schema holds the integer {v}, which the grammar library cannot take "
                f"(integers from {-(2**63)} to {-(2**63) + 512} crash it)."
            )


def _bound_lark_json(source: str) -> str:
    """``source`` with the schema of each ``%json`` directive bounded as a json_schema is."""
    parts, done, pos = [], 0, 0
    while (m := _LARK_TOKEN.search(source, pos)) is not None:
        pos = m.end()
        if not m.group().startswith("%json"):
            continue
        try:
            schema, end = _JSON_DECODER.raw_decode(source, pos)
        except ValueError:
            continue  # llguidance says what is wrong with it
        _refuse_crashing_integers(schema)
        bounded = _bounded_schema(schema)
        if bounded != schema:
            parts += [source[done:pos], json.dumps(bounded)]
            done = end
        pos = end
    return "".join(parts) + source[done:]


@functools.lru_cache(maxsize=256)
def to_llguidance(kind: str, source: str) -> str:
    """The llguidance grammar of ``[kind, source]``; ``ValueError`` says what is wrong."""
    import llguidance
    from llguidance.gbnf_to_lark import gbnf_to_lark

    matcher = llguidance.LLMatcher
    if kind == "json_schema":
        try:
            schema = json.loads(source)
        except ValueError as exc:
            raise ValueError(f"json_schema is not valid JSON: {exc}.") from None
        if not isinstance(schema, dict | bool):
            raise ValueError("json_schema must be a JSON object (a JSON Schema).")
        _refuse_crashing_integers(schema)
        return matcher.grammar_from_json_schema(_bounded_schema(schema), overrides=_JSON_OPTIONS)  # type: ignore[arg-type]
    if kind == "regex":
        return matcher.grammar_from_regex(source)
    if kind == "ebnf":
        try:
            return matcher.grammar_from_lark(gbnf_to_lark(source))
        except Exception as exc:  # gbnf_to_lark raises bare Exceptions for unknown rules
            raise ValueError(f"ebnf is not a valid grammar: {exc}.") from None
    if kind == "lark":
        return matcher.grammar_from_lark(_bound_lark_json(source))
    raise ValueError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, got {kind!r}.")


@functools.lru_cache(maxsize=256)
def check_grammar(kind: str, source: str) -> str:
    """Validate ``[kind, source]`` without a tokenizer: the llguidance grammar, or
    ``ValueError`` with the library's message (cached: a client's repeated schema is
    checked once)."""
    if len(source) > GRAMMAR_MAX_CHARS:
        raise ValueError(
            f"{kind} must be at most {GRAMMAR_MAX_CHARS} characters, got {len(source)}."
        )
    import llguidance

    grammar = to_llguidance(kind, source)
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        raise ValueError(f"{kind} is not a valid grammar: {problem.strip()}")
    return grammar


def grammar_from_wire(v: Any) -> tuple[str, str] | None:
    """The ``grammar`` field of a ``sampling`` map, shape-checked (the worker compiles it
    and reports what the library finds wrong)."""
    if v is None:
        return None
    if (
        not isinstance(v, list)
        or len(v) != 2
        or v[0] not in GRAMMAR_KINDS
        or not isinstance(v[1], str)
    ):
        raise ValueError(f"grammar must be [kind, source] with kind in {list(GRAMMAR_KINDS)}.")
    if len(v[1]) > GRAMMAR_MAX_CHARS:
        raise ValueError(f"grammar source must be at most {GRAMMAR_MAX_CHARS} characters.")
    return v[0], v[1]
