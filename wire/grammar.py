"""The output constraint of a SUBMIT entry (``specs/wire.cddl`` ``grammar``): one definition.

A request may carry one grammar its output must match: ``[kind, source]`` with ``kind``
one of ``GRAMMAR_KINDS``. The source travels as the client wrote it; both sides read it
with the same ``to_llguidance``, which turns it into an llguidance grammar
(``llguidance.LLMatcher``: JSON schema, regular expression and Lark grammars, one Rust
core; docs/structured.md has the measurements behind the choice):

- ``json_schema``: a JSON Schema as JSON text. Output is compact JSON with
  ``json.dumps``' separators (``", "``, ``": "``) and no other whitespace, so a model
  cannot spend its budget on blank space; a keyword llguidance does not implement is
  refused, never silently ignored.
- ``regex``: the whole output matches it (Rust ``regex`` syntax, as llguidance reads it).
- ``ebnf``: SGLang's EBNF (the GBNF dialect: ``root ::= ...``), translated to Lark by
  llguidance's own ``gbnf_to_lark``; what it cannot translate is refused with its message.
- ``lark``: llguidance's Lark dialect as it is (the frontend builds these for tool calls;
  ``%json {...}`` embeds a JSON schema).

The frontend checks a grammar before anything is queued (``check_grammar``: a bad one is
a 400 with the library's message); the worker compiles it against its tokenizer, once
per distinct grammar (``gpu/grammar.py``).
"""

from __future__ import annotations

import functools
import json
from typing import Any

__all__ = [
    "GRAMMAR_KINDS",
    "GRAMMAR_MAX_CHARS",
    "JSON_SEPARATORS",
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
        return matcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)  # type: ignore[arg-type]
    if kind == "regex":
        return matcher.grammar_from_regex(source)
    if kind == "ebnf":
        try:
            return matcher.grammar_from_lark(gbnf_to_lark(source))
        except Exception as exc:  # gbnf_to_lark raises bare Exceptions for unknown rules
            raise ValueError(f"ebnf is not a valid grammar: {exc}.") from None
    if kind == "lark":
        return matcher.grammar_from_lark(source)
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
