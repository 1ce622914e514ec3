"""Function tools on ``POST /v1/responses`` against the real model: the Responses API's
flat tools become chat tools (rendered, forced by ``tool_choice`` and parsed as on
``/v1/chat/completions``), calls come back as ``function_call`` output items, unary and
streamed, and ``function_call`` / ``function_call_output`` input items carry a second
turn. Forced calls (``required``, a named function) are made by a grammar, so they hold
at any temperature; with ``auto`` SmolLM2 rarely calls, and nothing here relies on it."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest

from .tool_cases import ADD, TOOLS, WEATHER

pytestmark = pytest.mark.model

FLAT = [{"type": "function", **t["function"]} for t in TOOLS]  # the Responses spelling
SCHEMAS = {"get_weather": WEATHER, "add": ADD}


@pytest.fixture(scope="module")
def client(model_server: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=model_server + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def _check_call(item: dict) -> dict:
    assert item["type"] == "function_call" and item["status"] == "completed"
    assert item["id"].startswith("fc_") and item["call_id"].startswith("call_")
    args = json.loads(item["arguments"])
    jsonschema.validate(args, SCHEMAS[item["name"]])
    return args


def test_required_calls_come_back_as_function_call_items(model_server: str) -> None:
    body = {"model": "default", "input": "What is the weather in Paris?", "tools": FLAT,
            "tool_choice": "required", "parallel_tool_calls": False, "temperature": 1.0,
            "seed": 3, "max_output_tokens": 96}  # fmt: skip
    r = httpx.post(model_server + "/v1/responses", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["status"] == "completed"
    calls = [item for item in out["output"] if item["type"] == "function_call"]
    assert len(calls) == 1 and all(item["type"] != "message" for item in out["output"])
    _check_call(calls[0])
    assert [t["name"] for t in out["tools"]] == ["get_weather", "add"]


def test_a_named_function_is_called_and_parsed_by_the_client(client: openai.OpenAI) -> None:
    r = client.responses.create(model="default", input="Add one and two.", tools=FLAT,  # type: ignore[arg-type]
                                tool_choice={"type": "function", "name": "add"},
                                max_output_tokens=64, temperature=0)  # fmt: skip
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and calls[0].name == "add"
    _check_call(calls[0].model_dump())


def test_a_streamed_call_is_the_unary_one(model_server: str) -> None:
    body = {"model": "default", "input": "Weather in Oslo, please.", "tools": FLAT,
            "tool_choice": {"type": "function", "name": "get_weather"}, "temperature": 0,
            "max_output_tokens": 64}  # fmt: skip
    unary = httpx.post(model_server + "/v1/responses", json=body, timeout=120).json()
    events = []
    with httpx.stream("POST", model_server + "/v1/responses", json={**body, "stream": True},
                      timeout=120) as r:  # fmt: skip
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    # The call: its item added at its head, its arguments as they are written (several
    # deltas on a forced call of the real model), then done whole.
    first = kinds.index("response.function_call_arguments.delta")
    end = kinds.index("response.function_call_arguments.done")
    assert kinds[first - 1] == "response.output_item.added"
    assert set(kinds[first:end]) == {"response.function_call_arguments.delta"}
    assert end - first > 1, "the arguments should arrive in several pieces"
    assert kinds[end + 1] == "response.output_item.done"
    added, done = events[first - 1]["item"], events[end + 1]["item"]
    assert added["type"] == "function_call" and added["arguments"] == ""
    assert added["status"] == "in_progress" and added["id"] == done["id"]
    streamed = "".join(e["delta"] for e in events[first:end])
    assert streamed == events[end]["arguments"] == done["arguments"]
    final = events[-1]["response"]["output"]
    strip = [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in final]
    want = [{k: v for k, v in item.items() if k not in ("id", "call_id")}
            for item in unary["output"]]  # fmt: skip
    assert strip == want
    _check_call(done)


def test_a_second_turn_reads_the_call_and_its_output(model_server: str) -> None:
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
            "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}  # fmt: skip
    answer = {"type": "function_call_output", "call_id": "call_1",
              "output": json.dumps({"temperature": 21, "sky": "clear"})}  # fmt: skip
    body = {"model": "default", "tools": FLAT, "tool_choice": "none", "temperature": 0,
            "max_output_tokens": 24, "input": [
                {"role": "user", "content": "What is the weather in Paris?"}, call, answer]}  # fmt: skip
    r = httpx.post(model_server + "/v1/responses", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()["output"]
    assert out[0]["type"] == "message" and out[0]["content"][0]["text"].strip()
    # An answer to a call that was never made is refused, as on chat completions.
    bad = {**body, "input": [body["input"][0], {**answer, "call_id": "call_9"}]}
    r = httpx.post(model_server + "/v1/responses", json=bad, timeout=30)
    assert r.status_code == 400, r.text
