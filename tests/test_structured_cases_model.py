"""Issue 21's acceptance on the real model and server: every case of
``tests/structured_cases.py`` comes out in shape.

- 20 JSON schemas, each asked once with ``n`` = 5 at temperature 1.0 (five seeds: the
  samples of a seeded request draw with seed, seed + 1, ...): all 100 outputs parse and
  validate with ``jsonschema``, and each ended because its grammar did.
- 10 regexes, ``n`` = 2: every output matches the whole pattern.
- The EBNF grammar, streamed with ``n`` = 3: each sample's streamed text obeys it.
"""

from __future__ import annotations

import json
import re
from typing import Any

import anyio
import httpx
import jsonschema
import pytest

from tests.structured_cases import (
    EBNF_GRAMMAR,
    EBNF_MAX_TOKENS,
    REGEX_CASES,
    SCHEMA_CASES,
    ebnf_matches,
)

pytestmark = pytest.mark.timeout(900)


async def _all(base: str, bodies: list[dict[str, Any]]) -> list[Any]:
    out: list[Any] = [None] * len(bodies)
    async with httpx.AsyncClient(base_url=base, timeout=600) as http:

        async def one(i: int) -> None:
            r = await http.post("/generate", json=bodies[i])
            assert r.status_code == 200, r.text
            out[i] = r.json()

        async with anyio.create_task_group() as tg:
            for i in range(len(bodies)):
                tg.start_soon(one, i)
    return out


def test_twenty_schemas_five_seeds_each_validate(model_server: str) -> None:
    assert len(SCHEMA_CASES) == 20
    bodies = [
        {
            "text": f"Write one JSON value ({case.name}): ",
            "sampling_params": {
                "json_schema": json.dumps(case.schema),
                "temperature": 1.0,
                "n": 5,
                "seed": 100 + i,
                "max_new_tokens": case.max_tokens,
            },
        }  # fmt: skip
        for i, case in enumerate(SCHEMA_CASES)
    ]
    results = anyio.run(_all, model_server, bodies)
    for case, items in zip(SCHEMA_CASES, results, strict=True):
        assert len(items) == 5
        for item in items:
            assert item["meta_info"]["finish_reason"]["type"] == "stop", (case.name, item)
            jsonschema.validate(json.loads(item["text"]), case.schema)


def test_ten_regexes_fully_match(model_server: str) -> None:
    assert len(REGEX_CASES) == 10
    bodies = [
        {
            "text": f"{case.name}: ",
            "sampling_params": {
                "regex": case.pattern,
                "temperature": 1.0,
                "n": 2,
                "seed": 7 + i,
                "max_new_tokens": case.max_tokens,
            },
        }  # fmt: skip
        for i, case in enumerate(REGEX_CASES)
    ]
    results = anyio.run(_all, model_server, bodies)
    for case, items in zip(REGEX_CASES, results, strict=True):
        for item in items:
            assert re.fullmatch(case.pattern, item["text"]), (case.name, item["text"])


def test_ebnf_grammar_streamed_with_three_samples(model_server: str) -> None:
    body = {
        "text": "A record about a person:\n",
        "stream": True,
        "sampling_params": {"ebnf": EBNF_GRAMMAR, "temperature": 1.0, "n": 3, "seed": 5,
                            "max_new_tokens": EBNF_MAX_TOKENS},
    }  # fmt: skip
    texts: dict[int, str] = {}
    with httpx.stream("POST", f"{model_server}/generate", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                texts[chunk.get("index", 0)] = chunk["text"]
    assert sorted(texts) == [0, 1, 2]
    for text in texts.values():
        assert ebnf_matches(text), text
