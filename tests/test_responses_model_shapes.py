"""Issue 40 on the real model, through the official ``openai`` client: a response cut by
``max_output_tokens`` works with ``responses.stream()`` (its final response says
``incomplete``), Responses usage carries SGLang's ``prompt_tokens`` /
``completion_tokens``, a ``tool_choice: required`` reply cut by ``max_tokens`` leaves no
call markup in ``content``, and ``/v1/score`` errors carry OpenAI's ``type``."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

GREEDY = {"temperature": 0}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def client(model_server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=model_server + "/v1", api_key="none", max_retries=0)


def test_stream_helper_gives_the_final_response_of_a_cut_response(client: openai.OpenAI) -> None:
    """The helper raised "Didn't receive a `response.completed` event" on a response
    that reached max_output_tokens: the stream now ends response.completed, and the
    response it carries says incomplete (docs/api.md)."""
    with client.responses.stream(model="default", input="Tell me a long story.",
                                 max_output_tokens=5, **GREEDY) as stream:  # fmt: skip
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == "incomplete" and final.incomplete_details is not None
    assert final.incomplete_details.reason == "max_output_tokens"
    assert final.output_text == text and text
    assert final.usage is not None and final.usage.output_tokens == 5
    unary = client.responses.create(model="default", input="Tell me a long story.",
                                    max_output_tokens=5, **GREEDY)  # fmt: skip
    assert unary.status == "incomplete" and unary.output_text == text


def test_responses_usage_has_sglangs_names_too(model_server: str) -> None:
    body = {"model": "default", "input": "Hi", "max_output_tokens": 4, **GREEDY}
    unary = httpx.post(model_server + "/v1/responses", json=body, timeout=60).json()
    u = unary["usage"]
    assert u["prompt_tokens"] == u["input_tokens"] > 0
    assert u["completion_tokens"] == u["output_tokens"] == 4
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    with httpx.stream("POST", model_server + "/v1/responses", json={**body, "stream": True},
                      timeout=60) as s:  # fmt: skip
        last = [line for line in s.iter_lines() if line.startswith("data: ")][-1]
    final = json.loads(last[6:])
    assert final["type"] == "response.completed"
    assert final["response"]["usage"]["prompt_tokens"] == u["prompt_tokens"]
    assert final["response"]["usage"]["completion_tokens"] == 4


def test_required_tool_call_cut_by_max_tokens_leaves_no_markup(client: openai.OpenAI) -> None:
    """A forced call the length limit cut is no call and no content: finish_reason
    ``length``, ``content`` null, no ``tool_calls`` (OpenAI's and SGLang's reading of a
    cut call: the markup is never shown as text)."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = {
        "model": "default",
        "messages": messages,
        "tools": [WEATHER],
        "tool_choice": "required",
        "max_tokens": 9,
        **GREEDY,
    }  # cut inside the call's JSON
    choice = client.chat.completions.create(**kw).choices[0]  # type: ignore[call-overload]
    assert choice.finish_reason == "length", choice
    assert not choice.message.tool_calls and not choice.message.content, choice.message
    chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]  # type: ignore[call-overload]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    assert not any(c.choices[0].delta.tool_calls for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"query": "a", "items": ["b"], "label_token_ids": []}, 400, "label_token_ids"),
        ({"query": "a", "items": [1], "label_token_ids": [5]}, 400, "items"),
        ({"query": "a " * 9000, "items": ["b"], "label_token_ids": [5]}, 400, "items"),
        ({"query": "a", "items": ["b"], "label_token_ids": [5], "rid": 7}, 400, None),
    ],
)
def test_score_errors_carry_the_openai_type(
    model_server: str, body: dict, status: int, param: str | None
) -> None:
    r = httpx.post(model_server + "/v1/score", json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"], err
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
    bad_json = httpx.post(model_server + "/v1/score", content=b"{not json", timeout=10)
    assert (
        bad_json.status_code == 400 and bad_json.json()["error"]["type"] == "invalid_request_error"
    )
