"""Constrained decoding end to end: the real model behind the real server.

Every JSON schema, regex and the EBNF grammar of ``tests/structured_cases.py`` is asked
for over ``/generate`` at temperature 1.0 with several seeds; each output must parse and
validate (``jsonschema``), fully match, or obey the grammar. Streaming and ``n`` = 3 are
included, and the official ``openai`` client's ``response_format`` too. A 135M model
writes almost none of these shapes unconstrained: the test fails when the mask is not
applied.
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import pytest

from .structured_cases import OPEN_INTEGER_PROMPT, OPEN_INTEGER_SCHEMA

pytestmark = pytest.mark.timeout(600)

SEEDS = (1, 2, 3, 4, 5)


def _generate(base: str, sampling: dict[str, Any], text: str = "Answer: ") -> list[dict[str, Any]]:
    body = {"text": text, "sampling_params": {"temperature": 1.0, **sampling}}
    r = httpx.post(f"{base}/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    out = r.json()
    return out if isinstance(out, list) else [out]


def test_small_schema_parses_for_every_seed(model_server: str) -> None:
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    for seed in SEEDS:
        (item,) = _generate(
            model_server,
            {"json_schema": json.dumps(schema), "max_new_tokens": 60, "seed": seed},
            "Describe a person as JSON: ",
        )
        jsonschema.validate(json.loads(item["text"]), schema)
        fr = item["meta_info"]["finish_reason"]
        assert fr["type"] == "stop", item


def test_regex_full_match_with_n3(model_server: str) -> None:
    pattern = r"[0-9]{3}-[0-9]{4}"
    items = _generate(model_server, {"regex": pattern, "max_new_tokens": 20, "n": 3, "seed": 7})
    assert len(items) == 3
    for item in items:
        assert re.fullmatch(pattern, item["text"]), item["text"]


def test_the_trace_records_the_compile_and_the_grammar_end(model_server: str) -> None:
    sampling = {"regex": "(red|green|blue)", "max_new_tokens": 10, "temperature": 0}
    for rid in ("grammar-trace-1", "grammar-trace-2"):
        body = {"text": "A colour: ", "rid": rid, "sampling_params": sampling}
        assert httpx.post(f"{model_server}/generate", json=body, timeout=60).status_code == 200
    details = []
    for rid in ("grammar-trace-1", "grammar-trace-2"):
        trace = httpx.get(f"{model_server}/debug/requests/{rid}", timeout=10).json()
        (finish,) = [t for t in trace["transitions"] if t["event"] == "finish"]
        details.append(finish["detail"])
    assert details[0].startswith("grammar: compiled in ")
    assert "complete in 1 of 1 samples" in details[0]
    assert "(cache hit)" in details[1]  # the same source again: compiled once


def test_stream_of_a_constrained_request_is_its_unary_text(model_server: str) -> None:
    sampling = {"json_schema": json.dumps({"type": "array", "items": {"type": "integer"},
                                           "maxItems": 4}),
                "max_new_tokens": 40, "temperature": 0}  # fmt: skip
    (unary,) = _generate(model_server, sampling, "Four numbers: ")
    body = {"text": "Four numbers: ", "stream": True, "sampling_params": sampling}
    text = ""
    with httpx.stream("POST", f"{model_server}/generate", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text = json.loads(line[6:])["text"]
    assert text == unary["text"] and isinstance(json.loads(text), list)


def test_openai_response_format(model_server: str) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{model_server}/v1", api_key="none")
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20},
                       "population": {"type": "integer", "minimum": 0}},
        "required": ["city", "population"],
        "additionalProperties": False,
    }  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}
    msgs = [{"role": "user", "content": "Name a city and its population."}]
    chat = client.chat.completions.create(
        model="default",
        messages=msgs,
        response_format=fmt,
        max_tokens=60,
        seed=1,  # type: ignore[arg-type]
    )
    jsonschema.validate(json.loads(chat.choices[0].message.content or ""), schema)
    chunks = client.chat.completions.create(
        model="default", messages=msgs, response_format=fmt, max_tokens=60, seed=1,  # type: ignore[arg-type]
        temperature=0, stream=True,
    )  # fmt: skip
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(streamed), schema)
    done = client.completions.create(
        model="default", prompt="JSON: ", max_tokens=40, seed=2,
        extra_body={"response_format": {"type": "json_object"}},
    )  # fmt: skip
    assert isinstance(json.loads(done.choices[0].text), dict)


def test_an_open_integer_ends_within_80_tokens(model_server: str) -> None:
    """Issue 53, point 4: an ``integer`` the schema leaves unbounded. Greedy, the model
    wrote ``"population": 1111...`` for this prompt until ``max_tokens`` ran out (80, 200
    or 500); the default int64 bound (``wire.grammar.bound_numbers``) ends it at 19 digits."""
    schema = OPEN_INTEGER_SCHEMA
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": OPEN_INTEGER_PROMPT}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
        "temperature": 0,
        "max_tokens": 80,
    }
    r = httpx.post(f"{model_server}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    (choice,) = out["choices"]
    assert choice["finish_reason"] == "stop", out
    assert out["usage"]["completion_tokens"] <= 80
    value = json.loads(choice["message"]["content"])
    jsonschema.validate(value, schema)
    assert type(value["population"]) is int and len(str(value["population"])) <= 19


def test_bad_constraints_are_400_and_nothing_is_queued(model_server: str) -> None:
    before = httpx.get(f"{model_server}/metrics", timeout=10).text
    cases = [
        ({"text": "x", "sampling_params": {"json_schema": '{"type": "nope"}'}}, "/generate"),
        ({"text": "x", "sampling_params": {"regex": "(a"}}, "/generate"),
        ({"text": "x", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}}, "/generate"),
        (
            {"model": "default", "messages": [{"role": "user", "content": "x"}],
             "response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                 "schema": {"type": "object", "minProperties": "2"}}}},
            "/v1/chat/completions",
        ),
        (
            {"model": "default", "messages": [{"role": "user", "content": "x"}],
             "response_format": {"type": "json_object"}, "regex": "a"},
            "/v1/chat/completions",
        ),
    ]  # fmt: skip
    for body, path in cases:
        r = httpx.post(f"{model_server}{path}", json=body, timeout=10)
        assert r.status_code == 400, (body, r.text)
        message = r.json()["error"]["message"] if "error" in r.json() else r.json()["message"]
        assert message, r.text
    after = httpx.get(f"{model_server}/metrics", timeout=10).text

    def worked(text: str) -> list[str]:  # nothing reached the worker: no prompt was run
        return [ln for ln in text.splitlines() if ln.startswith("lifecycle_prompt_tokens_total")]

    assert worked(after) == worked(before)
