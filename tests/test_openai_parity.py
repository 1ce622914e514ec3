"""What SGLang and OpenAI clients read that we now send as they do (issue 22): the role
alone in a chat stream's first chunk, ``matched_stop`` always present, usage in every
chunk with ``continuous_usage_stats``, ``continue_final_message``, the ``/get_server_info``
keys SGLang clients read, and any model name served; over HTTP on the real model
(``model_server``), and ``--strict-model-name`` on a scripted-worker server."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from .scripted import lifecycle_server


@pytest.fixture(scope="module")
def url(model_server: str) -> str:
    return model_server


def _events(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    with httpx.stream("POST", url + path, json=body, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                out.append(json.loads(line[6:]))
    return out


def test_chat_stream_sends_the_role_alone_first(url: str) -> None:
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "n": 2,
            "stream": True, "ignore_eos": True}  # fmt: skip
    events = _events(url, "/v1/chat/completions", body)
    firsts = events[:2]
    assert [c["choices"][0]["index"] for c in firsts] == [0, 1]
    for c in firsts:
        assert c["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert c["choices"][0]["finish_reason"] is None
    for c in events[2:]:
        assert "role" not in c["choices"][0]["delta"]
    text = {0: "", 1: ""}
    for c in events[2:]:
        text[c["choices"][0]["index"]] += c["choices"][0]["delta"]["content"]
    assert all(text.values())


def test_matched_stop_is_always_there(url: str) -> None:
    # ignore_eos: sampled at the default temperature, the model may end its reply within
    # three tokens (then finish_reason is "stop" and matched_stop its end token)
    chat = httpx.post(url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
        "ignore_eos": True}).json()  # fmt: skip
    assert chat["choices"][0]["finish_reason"] == "length"
    assert "matched_stop" in chat["choices"][0] and chat["choices"][0]["matched_stop"] is None
    comp = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2,
                                                     "ignore_eos": True}).json()  # fmt: skip
    assert comp["choices"][0]["matched_stop"] is None
    greedy = httpx.post(url + "/v1/completions", json={
        "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0,
        "logprobs": 0, "ignore_eos": True}).json()  # fmt: skip
    second = httpx.post(url + "/tokenize", json={"prompt": greedy["choices"][0]["text"],
                        "add_special_tokens": False}).json()["tokens"]  # fmt: skip
    stopped = httpx.post(url + "/v1/completions", json={  # stop on the 2nd greedy token
        "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0,
        "stop_token_ids": [second[1]]}).json()  # fmt: skip
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["choices"][0]["matched_stop"] == second[1]
    last = _events(url, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": True})
    assert last[-1]["choices"][0]["matched_stop"] is None


def test_continuous_usage_stats_put_usage_in_every_chunk(url: str) -> None:
    body = {"prompt": [11, 12, 13], "max_tokens": 5, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    events = _events(url, "/v1/completions", body)
    with_choices = [e for e in events if e["choices"]]
    assert with_choices and all(e["usage"] is not None for e in events)
    done = [e["usage"]["completion_tokens"] for e in with_choices]
    assert done == sorted(done) and done[-1] == 5
    assert all(e["usage"]["prompt_tokens"] == 3 for e in events)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5
    plain = _events(url, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert all(e["usage"] is None for e in plain if e["choices"])


def test_server_info_has_the_keys_sglang_clients_read(url: str) -> None:
    for path in ("/get_server_info", "/server_info"):
        info = httpx.get(url + path).json()
        state = info["internal_states"][0]
        cap = state["capacity"]
        assert info["max_total_num_tokens"] == cap["kv_blocks"] * cap["block_size"]
        assert info["max_running_requests"] == cap["max_running"] == 8  # model_server's
        assert info["page_size"] == cap["block_size"]
        assert info["context_length"] > 0 and info["version"] and info["model_path"]


def test_continue_final_message_leaves_the_last_turn_open(url: str) -> None:
    convo = [{"role": "user", "content": "Write a haiku."},
             {"role": "assistant", "content": "Autumn moonlight,"}]  # fmt: skip
    cont = httpx.post(url + "/v1/chat/completions", json={
        "messages": convo, "max_tokens": 2, "continue_final_message": True}).json()  # fmt: skip
    closed = httpx.post(url + "/v1/chat/completions", json={
        "messages": convo, "max_tokens": 2}).json()  # fmt: skip
    # the open turn is the closed one without its end of turn and the next turn's header
    assert 0 < cont["usage"]["prompt_tokens"] < closed["usage"]["prompt_tokens"]
    r = httpx.post(url + "/v1/chat/completions", json={
        "messages": convo[:1], "continue_final_message": True})  # fmt: skip
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "continue_final_message"


def test_strict_model_name_keeps_the_404() -> None:
    with lifecycle_server("--scripted-worker", "--strict-model-name") as base:
        for path, body in (
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ("/v1/completions", {"prompt": "hi"}),
            ("/v1/embeddings", {"input": "hi"}),
        ):
            r = httpx.post(base + path, json={**body, "model": "gpt-x", "max_tokens": 2}
                           if "embeddings" not in path else {**body, "model": "gpt-x"})  # fmt: skip
            assert r.status_code == 404, (path, r.text)
            assert r.json()["error"]["code"] == "model_not_found"
            ok = httpx.post(base + path, json={**body, "model": "default"})
            assert ok.status_code == 200, (path, ok.text)
