"""Every sampling parameter of ``/generate``, end to end through real HTTP to the real
worker and model: each test checks an effect the parameter must have on the output.

Greedy references come from the same server, so a parameter that is dropped anywhere
between the HTTP body and the sampler makes its test fail.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.model

CHAT = "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n"
REPEAT = "one two one two one two one two one two"


def _gen(url: str, text: str, **sp: Any) -> dict[str, Any]:
    body = {"text": text, "sampling_params": {"max_new_tokens": 16, **sp}}
    r = httpx.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _ids(url: str, text: str, **sp: Any) -> list[int]:
    return _gen(url, text, **sp)["output_ids"]


@pytest.fixture(scope="module")
def greedy(model_server: str) -> list[int]:
    return _ids(model_server, CHAT, temperature=0, ignore_eos=True)


def test_greedy_forms_agree(model_server: str, greedy: list[int]) -> None:
    # temperature 0, top_k 1, a tiny top_p and min_p 1 all leave only the argmax.
    assert _ids(model_server, CHAT, top_k=1, ignore_eos=True) == greedy
    assert _ids(model_server, CHAT, top_p=1e-6, ignore_eos=True) == greedy
    assert _ids(model_server, CHAT, min_p=1.0, ignore_eos=True) == greedy


def test_seed_makes_sampling_repeatable(model_server: str, greedy: list[int]) -> None:
    runs = [
        tuple(_ids(model_server, CHAT, temperature=1.5, seed=s, ignore_eos=True))
        for s in (7, 7, 8, 9)
    ]
    assert runs[0] == runs[1]
    assert len(set(runs[1:])) > 1 or runs[2] != tuple(greedy)


def test_max_and_min_new_tokens_and_ignore_eos(model_server: str) -> None:
    out = _gen(model_server, CHAT, temperature=0, max_new_tokens=5, ignore_eos=True)
    assert out["meta_info"]["completion_tokens"] == 5
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    natural = _gen(
        model_server,
        "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n",
        temperature=0,
        max_new_tokens=64,
    )
    n = natural["meta_info"]["completion_tokens"]
    assert natural["meta_info"]["finish_reason"]["type"] == "stop" and n < 64
    longer = _gen(
        model_server,
        "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n",
        temperature=0,
        max_new_tokens=64,
        min_new_tokens=n + 5,
    )
    assert longer["meta_info"]["completion_tokens"] >= n + 5


def test_penalties_change_a_repetitive_continuation(model_server: str) -> None:
    base = _ids(model_server, REPEAT, temperature=0, ignore_eos=True)
    for name, value in [
        ("frequency_penalty", 2.0),
        ("presence_penalty", 2.0),
        ("repetition_penalty", 2.0),
    ]:
        out = _ids(model_server, REPEAT, temperature=0, ignore_eos=True, **{name: value})
        assert out != base, name
        assert len(set(out)) >= len(set(base)), name


def test_logit_bias_forces_a_token(model_server: str) -> None:
    token = httpx.post(model_server + "/tokenize", json={"prompt": " blue"}, timeout=30).json()
    (tid,) = token["tokens"]
    out = _ids(
        model_server,
        CHAT,
        temperature=0,
        ignore_eos=True,
        max_new_tokens=4,
        logit_bias={str(tid): 100.0},
    )
    assert out == [tid] * 4


def test_stop_token_ids_end_at_that_token(model_server: str, greedy: list[int]) -> None:
    stop = greedy[3]
    out = _gen(model_server, CHAT, temperature=0, stop_token_ids=[stop])
    first = greedy.index(stop)
    assert out["output_ids"] == greedy[: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_stop_string_trim_and_no_stop_trim(model_server: str) -> None:
    full = _gen(model_server, CHAT, temperature=0, ignore_eos=True)["text"]
    word = full.split()[1]
    trimmed = _gen(model_server, CHAT, temperature=0, stop=[word])
    kept = _gen(model_server, CHAT, temperature=0, stop=[word], no_stop_trim=True)
    assert trimmed["meta_info"]["finish_reason"] == {"type": "stop", "matched": word}
    assert word not in trimmed["text"] and full.startswith(trimmed["text"])
    assert kept["text"].endswith(word) and kept["text"] == trimmed["text"] + word


def test_skip_special_tokens(model_server: str) -> None:
    # <|im_end|> (id 2) forced by a bias; ignore_eos keeps generating past it.
    sp = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 2, "logit_bias": {"2": 100.0}}
    hidden = _gen(model_server, CHAT, **sp)
    shown = _gen(model_server, CHAT, skip_special_tokens=False, **sp)
    assert hidden["output_ids"] == [2, 2] and hidden["text"] == ""
    assert shown["text"] == "<|im_end|><|im_end|>"


def test_batch_and_n_on_the_real_model(model_server: str, greedy: list[int]) -> None:
    body = {
        "text": [CHAT, REPEAT],
        "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True},
    }
    r = httpx.post(model_server + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    first, second = r.json()
    assert first["output_ids"] == greedy
    assert second["output_ids"] == _ids(model_server, REPEAT, temperature=0, ignore_eos=True)
    body = {
        "text": CHAT,
        "sampling_params": {
            "max_new_tokens": 8,
            "temperature": 1.0,
            "n": 3,
            "seed": 5,
            "ignore_eos": True,
        },
    }
    r = httpx.post(model_server + "/generate", json=body, timeout=120)
    samples = r.json()
    assert len(samples) == 3 and all(len(s["output_ids"]) == 8 for s in samples)


@pytest.mark.parametrize(
    ("sp", "message"),
    [
        ({"top_p": -1}, "top_p must be in (0, 1], got -1."),
        ({"temperature": -1}, "temperature must be a non-negative finite number, got -1."),
        ({"min_p": 2}, "min_p must be in [0, 1], got 2."),
        ({"frequency_penalty": 3}, "frequency_penalty must be in [-2, 2], got 3."),
        ({"presence_penalty": -3}, "presence_penalty must be in [-2, 2], got -3."),
        ({"max_new_tokens": -1}, "max_new_tokens must be at least 0, got -1."),
        ({"logit_bias": {"99999": 1.0}}, "logit_bias must has keys in [0, 49151], got 99999."),
        ({"no_such_key": 1}, "Unknown sampling parameter: 'no_such_key'."),
    ],
)
def test_validation_rules_answer_400(model_server: str, sp: dict[str, Any], message: str) -> None:
    r = httpx.post(
        model_server + "/generate", json={"text": "hi", "sampling_params": sp}, timeout=30
    )
    assert r.status_code == 400
    assert r.json()["error"]["message"] == message
