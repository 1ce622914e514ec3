"""Tool calling end to end: the real model (SmolLM2-135M) behind the real server, through
the official ``openai`` client. ``tool_choice`` ``required`` and a named function are
enforced by the worker's grammar, so every call's arguments validate (``jsonschema``)
at temperature 1.0; a 135M model writes almost none of them unconstrained. Kept to a few
short requests (``n`` > 1 batches the samples)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from .test_tools_scripted import requests_seen
from .tool_cases import ADD, TOOLS, WEATHER

pytestmark = [pytest.mark.model, pytest.mark.timeout(600)]

SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED_WEATHER: Any = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def client(model_server: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=model_server + "/v1", api_key="unused", max_retries=0, timeout=300
    )


def _valid(call: Any) -> tuple[str, dict[str, Any]]:
    assert call.type == "function" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return call.function.name, args


def _ask(client: openai.OpenAI, **kw: Any) -> Any:
    body: dict[str, Any] = {"model": "default", "messages": ASK, "tools": TOOLS,
                            "max_tokens": 100, **kw}  # fmt: skip
    return client.chat.completions.create(**body)


def test_required_one_call_validates_for_every_sample(client: openai.OpenAI) -> None:
    r = _ask(client, tool_choice="required", parallel_tool_calls=False, temperature=1.0,
             seed=1, n=3)  # fmt: skip
    assert len(r.choices) == 3
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        (call,) = choice.message.tool_calls or []
        _valid(call)


def test_required_parallel_calls_all_validate(client: openai.OpenAI) -> None:
    r = _ask(client, tool_choice="required", temperature=1.0, seed=2, n=2, max_tokens=80)
    for choice in r.choices:
        calls = choice.message.tool_calls or []
        assert calls, choice
        for call in calls:
            _valid(call)
        # the model may keep calling until max_tokens: the cut call is content then
        assert choice.finish_reason in ("tool_calls", "length")


def test_a_named_function_is_called_once(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "add"}}
    r = _ask(client, tool_choice=named, temperature=1.0, seed=3, n=3)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls or []
        assert _valid(call)[0] == "add"


@pytest.fixture(scope="module")
def weather_call(client: openai.OpenAI) -> Any:
    """A greedy named call of get_weather (unary)."""
    return _ask(client, tool_choice=NAMED_WEATHER, temperature=0, seed=7)


def test_streamed_call_reassembles_to_the_unary_one(
    client: openai.OpenAI, weather_call: Any
) -> None:
    unary = weather_call.choices[0]
    state = ChatCompletionStreamState()
    stream = _ask(client, tool_choice=NAMED_WEATHER, temperature=0, seed=7, stream=True)
    deltas = []
    for chunk in stream:
        state.handle_chunk(chunk)
        deltas += [tc for c in chunk.choices for tc in c.delta.tool_calls or ()]
    streamed = state.get_final_completion().choices[0]
    assert streamed.finish_reason == unary.finish_reason == "tool_calls"
    (u,), (s,) = unary.message.tool_calls or [], streamed.message.tool_calls or []
    assert (s.function.name, s.function.arguments) == (u.function.name, u.function.arguments)
    _valid(s)
    # OpenAI's shape: the head (id, type, name, empty arguments), then the arguments
    assert deltas[0].id == s.id and deltas[0].function.arguments == ""
    assert deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments or "" for d in deltas) == s.function.arguments


def test_two_turns_with_a_tool_message(client: openai.OpenAI, weather_call: Any) -> None:
    first = weather_call.choices[0].message
    (call,) = first.tool_calls or []
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 18, "sky": "clear"}'},
    ]
    r = client.chat.completions.create(
        model="default", messages=history, tools=TOOLS, temperature=0, max_tokens=40
    )
    choice = r.choices[0]
    assert choice.message.content or choice.message.tool_calls
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert r.usage is not None and weather_call.usage is not None
    # the call and its response are in the prompt, not dropped
    assert r.usage.prompt_tokens > weather_call.usage.prompt_tokens + 20


def test_unknown_tool_name_is_400_and_nothing_is_queued(
    client: openai.OpenAI, model_server: str
) -> None:
    ran, refused = requests_seen(model_server)
    with pytest.raises(openai.BadRequestError) as info:
        _ask(client, tool_choice={"type": "function", "function": {"name": "send_email"}})
    err = info.value.body
    assert isinstance(err, dict) and err["param"] == "tool_choice", err
    assert "'send_email', which is not in tools (get_weather, add)" in err["message"]
    assert requests_seen(model_server) == (ran, refused + 1)  # traced as refused, none ran
