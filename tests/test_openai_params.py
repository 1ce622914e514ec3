"""OpenAI bodies onto native requests, in memory: the mapping, the defaults, and that any
JSON body ends as a request or an OpenAIError, never another exception."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lifecycle.faces.openai_errors import OpenAIError
from lifecycle.faces.openai_params import parse_chat, parse_completion

OPTS: dict[str, Any] = {
    "vocab_size": 100,
    "model_names": frozenset({"m", "default"}),
    "default_model": "m",
}
USER = [{"role": "user", "content": "hi"}]


def test_completion_defaults_and_mapping() -> None:
    r = parse_completion({"prompt": ["a", "b"], "n": 2, "min_tokens": 3, "top_k": 5}, **OPTS)
    assert r.sampling.max_new_tokens == 16 and r.sampling.params.min_new_tokens == 3
    assert (r.sampling.n, r.sampling.params.top_k, r.model) == (2, 5, "m")
    req = r.generate_request()
    assert [i.text for i in req.items] == ["a", "b"] and req.is_batch
    assert not req.items[0].options.return_logprob
    r = parse_completion({"prompt": [1, 2], "logprobs": 3, "echo": True, "rid": "x"}, **OPTS)
    item = r.generate_request().items[0]
    assert item.input_ids == [1, 2] and item.client_rid == "x"
    o = item.options
    assert (o.return_logprob, o.top_logprobs_num, o.logprob_start_len) == (True, 3, 0)


def test_chat_defaults_and_mapping() -> None:
    r, messages = parse_chat({"messages": USER, "temperature": 0}, **OPTS)
    assert r.sampling.max_new_tokens is None and r.sampling.greedy  # up to the context
    assert messages == USER
    r, messages = parse_chat(
        {
            "messages": [{"role": "developer", "content": [{"type": "text", "text": "x"}]}],
            "max_tokens": 5,
            "max_completion_tokens": 7,
            "logprobs": True,
        },
        **OPTS,
    )
    # parts stay parts: the template joins or loops over them (tool_prompt.render_chat)
    assert messages == [{"role": "system", "content": [{"type": "text", "text": "x"}]}]
    assert r.sampling.max_new_tokens == 7 and r.logprobs == 0


@pytest.mark.parametrize(
    ("body", "param", "status"),
    [
        ({"prompt": "a", "min_tokens": 20, "max_tokens": 4}, "min_tokens", 400),
        ({"prompt": "a", "logit_bias": {"999": 1}}, "logit_bias", 400),
        ({"prompt": [1, 200]}, None, 400),
        ({"prompt": "a", "best_of": 3}, "best_of", 400),
        ({"prompt": "a", "rid": 5}, "rid", 400),
    ],
)
def test_completion_refusals(body: dict[str, Any], param: str | None, status: int) -> None:
    with pytest.raises(OpenAIError) as info:
        parse_completion(body, **OPTS)
    assert (info.value.param, info.value.status) == (param, status)


def test_another_model_name_is_ours_unless_strict() -> None:
    assert parse_completion({"prompt": "a", "model": "other"}, **OPTS).model == "m"
    with pytest.raises(OpenAIError) as info:
        parse_completion({"prompt": "a", "model": "other"}, **OPTS, strict_model=True)
    assert (info.value.param, info.value.status, info.value.code) == ("model", 404,
                                                                      "model_not_found")  # fmt: skip
    assert (
        parse_completion({"prompt": "a", "model": "default"}, **OPTS, strict_model=True).model
        == "m"
    )


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_keys = st.sampled_from(
    [
        "prompt",
        "messages",
        "max_tokens",
        "n",
        "stop",
        "logprobs",
        "top_logprobs",
        "echo",
        "stream",
        "stream_options",
        "temperature",
        "logit_bias",
        "seed",
        "model",
        "rid",
    ]
)
_bodies = st.dictionaries(_keys, _json, max_size=6) | _json


@settings(max_examples=300, deadline=None)
@given(_bodies)
def test_any_json_body_is_a_request_or_an_openai_error(body: Any) -> None:
    for parse in (parse_completion, parse_chat):
        try:
            parse(body, **OPTS)
        except OpenAIError as exc:
            assert exc.status in (400, 404) and exc.message


def test_chat_features_we_lack_are_400_unless_null() -> None:
    parse_chat({"messages": USER, "functions": None, "modalities": ["text"]}, **OPTS)
    for name, value in (("functions", [{}]), ("modalities", ["audio"]), ("audio", {})):
        with pytest.raises(OpenAIError) as info:
            parse_chat({"messages": USER, name: value}, **OPTS)
        assert info.value.param == name and "not supported" in info.value.message


@pytest.mark.parametrize("role", [{}, [], None, 3, "robot"])
def test_chat_message_with_a_non_string_role_is_400(role: Any) -> None:
    # Regression: an object as the role raised TypeError (unhashable) -> 500; found by
    # schemathesis against the live server.
    with pytest.raises(OpenAIError) as err:
        parse_chat({"messages": [{"role": role, "content": None}]}, **OPTS)
    assert err.value.status == 400
