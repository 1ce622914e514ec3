"""Error bodies both SGLang's and OpenAI's clients read (issue 56, point 6).

On the OpenAI-compatible routes an error carries SGLang's flat ``ErrorResponse``
(``object: "error"``, ``message``, ``type`` as SGLang names it, ``param``, ``code``: the
status) beside OpenAI's nested ``error`` object, which the official SDK reads. SGLang's
own ``/v1/score`` test (an out-of-vocabulary ``label_token_ids``) reads the top-level
``type`` and ``message``; it passes here as written there. A real server process with
the scripted worker, and the official ``openai`` client."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from lifecycle.core.states import Cause
from lifecycle.faces.openai_errors import OpenAIError, sglang_error_type

from .scripted import lifecycle_server

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with lifecycle_server("--scripted-worker", "--strict-model-name") as base:
        yield base


def _both_shapes(r: httpx.Response) -> dict[str, Any]:
    """The body, checked to carry the flat and the nested shape, which agree."""
    body = r.json()
    assert set(body) == {"object", "message", "type", "param", "code", "error"}, body
    assert body["object"] == "error" and body["code"] == r.status_code
    assert body["type"] == sglang_error_type(r.status_code)
    nested = body["error"]
    assert set(nested) == {"message", "type", "param", "code"}
    assert nested["message"] == body["message"] and nested["param"] == body["param"]
    return body


def test_the_body_has_both_shapes() -> None:
    body = OpenAIError("bad top_p", 400, param="top_p").body()
    assert body == {
        "object": "error",
        "message": "bad top_p",
        "type": "BadRequestError",
        "param": "top_p",
        "code": 400,
        "error": {
            "message": "bad top_p",
            "type": "invalid_request_error",
            "param": "top_p",
            "code": None,
        },
    }
    busy = OpenAIError.from_cause(Cause.OVERLOADED, "busy").body()
    assert (busy["type"], busy["code"], busy["error"]["type"]) == (
        "ServiceUnavailableError",
        503,
        "server_error",
    )
    assert sglang_error_type(404) == "NotFoundError"
    assert sglang_error_type(500) == "InternalServerError"
    assert sglang_error_type(504) == "GatewayTimeoutError"


def test_sglangs_score_error_test_passes(url: str) -> None:
    """SGLang's ``test_score_error_handling``, its request and its assertions."""
    r = httpx.post(
        url + "/v1/score",
        headers={"Authorization": "Bearer unused", "Content-Type": "application/json"},
        json={
            "model": "any",
            "query": "The capital of France is",
            "items": ["Paris", "London", "Berlin"],
            "label_token_ids": [999999],
            "apply_softmax": True,
        },
    )
    assert r.status_code == 400
    error_response = r.json()
    assert error_response["type"] == "BadRequestError"
    assert "Token ID 999999 is out of vocabulary" in error_response["message"]
    body = _both_shapes(r)
    assert body["param"] == "label_token_ids"
    assert body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/v1/chat/completions", {**CHAT, "top_p": 5}, 400),
        ("/v1/chat/completions", {**CHAT, "model": "no-such-model"}, 404),
        ("/v1/chat/completions", [1, 2], 400),
        ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400),
        ("/v1/completions", {"prompt": "hi", "suffix": "x"}, 400),
        ("/v1/embeddings", {"input": 5}, 400),
        ("/v1/responses", {"input": "hi", "previous_response_id": "r1"}, 400),
        ("/v1/score", {"query": "q", "items": [1], "label_token_ids": [1]}, 400),
    ],
)
def test_every_openai_route_answers_both_shapes(
    url: str, path: str, body: Any, status: int
) -> None:
    r = httpx.post(url + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    _both_shapes(r)


def test_invalid_json_and_unknown_models_too(url: str) -> None:
    r = httpx.post(url + "/v1/chat/completions", content=b"{", timeout=30)
    assert r.status_code == 400
    _both_shapes(r)
    r = httpx.get(url + "/v1/models/no-such-model", timeout=30)
    assert r.status_code == 404
    assert _both_shapes(r)["type"] == "NotFoundError"


def test_the_official_sdk_still_reads_the_nested_error(url: str) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="SmolLM2-135M-Instruct.Q4_1",
            messages=[{"role": "user", "content": "hi"}],
            top_p=5,
        )
    err = info.value
    assert err.type == "invalid_request_error" and err.param == "top_p"
    assert "top_p must be in (0, 1], got 5." in err.message
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no-such-model")
    assert missing.value.code == "model_not_found"
