"""Unknown body fields (issue 40): accepted and ignored by default, logged once per field
and counted in ``lifecycle_unknown_fields_total``; ``--strict-fields`` refuses them with
the 400 each API has always given. Inside ``sampling_params`` an unknown key is a 400
either way (issue 56, point 5). A real server process with the scripted worker."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from lifecycle.testing.pytest_plugin import LiveServer, start_server

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
# (route, body with one field nobody here knows, the series label, the strict 400's text)
CASES: list[tuple[str, dict[str, Any], str, str]] = [
    ("/generate", {"text": "hi", "cache_prompt": True}, "/generate.cache_prompt",
     "Unknown field in the request body: 'cache_prompt'."),
    ("/v1/chat/completions", {**CHAT, "prompt_cache_key": "k", "safety_identifier": "u1"},
     "/v1/chat/completions.prompt_cache_key",
     "Unrecognized request argument supplied: prompt_cache_key"),
    ("/v1/chat/completions", {**CHAT, "verbosity": "low"},
     "/v1/chat/completions.verbosity", "Unrecognized request argument supplied: verbosity"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "cache_prompt": True},
     "/v1/completions.cache_prompt", "Unrecognized request argument supplied: cache_prompt"),
    ("/v1/embeddings", {"input": "hi", "suffix": "x"}, "/v1/embeddings.suffix",
     "Unrecognized request argument supplied: suffix"),
    ("/encode", {"text": "hi", "truncate": True}, "/encode.truncate",
     "Unknown field in the request body: 'truncate'."),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "frobnicate": 1},
     "/v1/responses.frobnicate", "Unrecognized request argument supplied: frobnicate"),
    ("/v1/score", {"query": "q", "items": ["a"], "label_token_ids": [1], "top_k": 3},
     "/v1/score.top_k", "Unrecognized request argument supplied: top_k"),
    ("/v1/messages", {**CHAT, "user_profile_id": "u1"}, "/v1/messages.user_profile_id",
     "user_profile_id: Extra inputs are not permitted"),
]  # fmt: skip


@pytest.fixture(scope="module")
def lenient() -> Iterator[LiveServer]:
    with start_server("--scripted-worker") as srv:
        yield srv


def _error_message(r: httpx.Response) -> str:
    return str(r.json()["error"]["message"])


def _unknown_counts(srv: LiveServer) -> dict[str, float]:
    text = httpx.get(srv.url + "/metrics").text
    found = re.findall(r'^lifecycle_unknown_fields_total\{field="([^"]+)"\} (\S+)$', text, re.M)
    return {name: float(v) for name, v in found}


def test_unknown_fields_are_ignored_logged_once_and_counted(lenient: LiveServer) -> None:
    for route, body, label, _ in CASES:
        first = httpx.post(lenient.url + route, json=body, timeout=30)
        again = httpx.post(lenient.url + route, json=body, timeout=30)
        assert first.status_code == again.status_code == 200, (route, first.text)
        assert _unknown_counts(lenient).get(label) == 2.0, (label, _unknown_counts(lenient))
    # An ignored field changes nothing: the same output as without it.
    plain = httpx.post(lenient.url + "/generate", json={"input_ids": [5, 6]}).json()
    extra = httpx.post(lenient.url + "/generate", json={"input_ids": [5, 6], "x_y": 1}).json()
    assert plain["output_ids"] == extra["output_ids"]


def test_the_default_model_id_is_the_files_name(lenient: LiveServer) -> None:
    """Issue 40: the served id has no spaces: the bundled file's name without .gguf."""
    (model,) = httpx.get(lenient.url + "/v1/models").json()["data"]
    assert model["id"] == "SmolLM2-135M-Instruct.Q4_1"
    info = httpx.get(lenient.url + "/model_info").json()
    assert info["served_model_name"] == model["id"]
    chat = httpx.post(lenient.url + "/v1/chat/completions", json=CHAT).json()
    assert chat["model"] == model["id"]


def test_known_but_unsupported_fields_stay_400(lenient: LiveServer) -> None:
    """A field we know whose effect would be lost is refused whatever the policy."""
    r = httpx.post(lenient.url + "/v1/completions", json={"prompt": "hi", "suffix": "x"})
    assert r.status_code == 400 and "suffix" in _error_message(r)
    r = httpx.post(lenient.url + "/encode", json={"text": "hi", "stream": True})
    assert r.status_code == 400 and "stream" in _error_message(r)


def test_an_unknown_sampling_key_is_400_without_strict_fields(lenient: LiveServer) -> None:
    """Issue 56, point 5: inside ``sampling_params`` every key changes the output, so an
    unknown one is refused (as SGLang refuses it), never counted and ignored."""
    for sp, message in [
        ({"max_new_tokens": 2, "mirostat": 0}, "Unknown sampling parameter: 'mirostat'."),
        ({"max_new_token": 8}, "Unknown sampling parameter: 'max_new_token'. "
                               "Did you mean 'max_new_tokens'?"),
    ]:  # fmt: skip
        r = httpx.post(lenient.url + "/generate", json={"text": "hi", "sampling_params": sp})
        assert r.status_code == 400 and _error_message(r) == message, r.text
    assert not any(k.startswith("sampling_params.") for k in _unknown_counts(lenient))


def test_strict_fields_refuses_every_unknown_field() -> None:
    with start_server("--scripted-worker", "--strict-fields") as srv:
        for route, body, _, message in CASES:
            r = httpx.post(srv.url + route, json=body, timeout=30)
            assert r.status_code == 400, (route, r.text)
            assert _error_message(r) == message
        assert _unknown_counts(srv) == {}
