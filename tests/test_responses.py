"""``POST /v1/responses`` with the official ``openai`` client against the real model: the
same text as ``/v1/chat/completions`` for the same conversation, the typed stream events
in order, and the 400s for what is not supported."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

GREEDY = {"temperature": 0}
ORDER_HEAD = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
ORDER_TAIL = ["response.output_text.done", "response.content_part.done",
              "response.output_item.done"]  # fmt: skip


@pytest.fixture(scope="module")
def client(model_server: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=model_server + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def _chat_text(client: openai.OpenAI, messages: list[dict], max_tokens: int) -> tuple[str, str]:
    r = client.chat.completions.create(model="default", messages=messages,  # type: ignore[arg-type]
                                       max_tokens=max_tokens, **GREEDY)  # fmt: skip
    return r.choices[0].message.content or "", r.choices[0].finish_reason


def test_unary_is_the_chat_completion(client: openai.OpenAI) -> None:
    r = client.responses.create(model="default", input="What is the capital of France?",
                                instructions="Answer in one word.", max_output_tokens=24,
                                **GREEDY)  # fmt: skip
    text, finish = _chat_text(client, [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "What is the capital of France?"}], 24)  # fmt: skip
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == text and text
    assert r.status == ("incomplete" if finish == "length" else "completed")
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.usage is not None and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == "Answer in one word." and r.max_output_tokens == 24


def test_cut_by_max_output_tokens_is_incomplete(client: openai.OpenAI) -> None:
    r = client.responses.create(model="default", input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Tell me a long story about a dragon."}]}],
        max_output_tokens=5, **GREEDY)  # fmt: skip
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage is not None and r.usage.output_tokens == 5


def test_stream_sends_the_typed_events_in_order(client: openai.OpenAI) -> None:
    question = "Name three colours."
    unary = client.responses.create(model="default", input=question, max_output_tokens=20,
                                    **GREEDY)  # fmt: skip
    events = list(client.responses.create(model="default", input=question,
                                          max_output_tokens=20, stream=True, **GREEDY))  # fmt: skip
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds[:4] == ORDER_HEAD and deltas
    assert kinds[4 : 4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert kinds[4 + len(deltas) : -1] == ORDER_TAIL
    # cut by max_output_tokens or not, the stream ends response.completed (docs/api.md);
    # the response it carries has the unary reply's status
    assert kinds[-1] == "response.completed"
    assert events[-1].response.status == unary.status  # type: ignore[union-attr]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(d.delta for d in deltas)
    assert text == unary.output_text
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == text
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == text and final.id == events[0].response.id  # type: ignore[union-attr]
    item_ids = {getattr(e, "item_id", None) for e in events} - {None}
    assert len(item_ids) == 1


def test_text_format_json_schema_shapes_the_output(model_server: str) -> None:
    import json

    import jsonschema

    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
              "required": ["colour"], "additionalProperties": False}  # fmt: skip
    fmt = {"type": "json_schema", "name": "pick", "schema": schema, "strict": True}
    body = {"model": "default", "input": "Pick a colour.", "text": {"format": fmt},
            "max_output_tokens": 30}  # fmt: skip
    r = httpx.post(model_server + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 200, r.text
    text = r.json()["output"][0]["content"][0]["text"]
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": 3}, "input"),
        ({"input": []}, "input"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        (
            {"input": "hi", "text": {"format": {"type": "xml"}}},
            "text.format",
        ),  # fmt: skip
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]}, "input"),
        ({"input": [{"type": "file_search_call", "id": "x"}]}, "input"),
        ({"input": "hi", "temperature": -1}, None),
        ({"input": "hi", "max_output_tokens": 0}, None),
    ],
)
def test_bad_requests_are_400_in_openais_shape(
    model_server: str, body: dict, param: str | None
) -> None:
    r = httpx.post(model_server + "/v1/responses", json={"model": "default", **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param is not None:
        assert err["param"] == param
