"""``POST /v1/score`` on the real model: each item's label probabilities are those the
model gives after ``query + item`` (held against ``/generate``'s logprobs of the same
prompt), softmax sums to 1, ``item_first`` and token ids as SGLang defines them."""

from __future__ import annotations

import math

import httpx
import pytest

QUERY = "Is Paris the capital of France? Answer:"
ITEMS = [" Yes", " No, it is"]


def _ids(base: str, text: str) -> list[int]:
    r = httpx.post(base + "/tokenize", json={"prompt": text, "add_special_tokens": False})
    return r.json()["tokens"]


def _labels(base: str) -> list[int]:
    return [_ids(base, " yes")[0], _ids(base, " no")[0], _ids(base, " maybe")[0]]


def _next_logprobs(base: str, body: dict, labels: list[int]) -> list[float]:
    r = httpx.post(base + "/generate", json={**body, "return_logprob": True,
                   "token_ids_logprob": labels, "sampling_params": {"max_new_tokens": 1,
                   "temperature": 0}}, timeout=60)  # fmt: skip
    given = {t: lp for lp, t, _ in r.json()["meta_info"]["output_token_ids_logprobs"][0]}
    return [given[t] for t in labels]


# The later of two runs of one prompt takes all but its last token from the prefix
# cache, so that token's logits come from the decode attention instead of the prefill's:
# the same sums in another order, up to ~2e-5 apart (relative) in fp32.
REL = 1e-4


def _score(base: str, **body: object) -> httpx.Response:
    return httpx.post(base + "/v1/score", json=body, timeout=60)


def test_scores_are_the_models_next_token_probabilities(model_server: str) -> None:
    labels = _labels(model_server)
    r = _score(model_server, query=QUERY, items=ITEMS, label_token_ids=labels)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "scoring" and len(body["scores"]) == 2
    for item, got in zip(ITEMS, body["scores"], strict=True):
        want = [math.exp(lp) for lp in _next_logprobs(model_server, {"text": QUERY + item},
                                                       labels)]  # fmt: skip
        assert got == pytest.approx(want, rel=REL, abs=1e-9)
        assert sum(got) < 1.0
    assert body["usage"]["prompt_tokens"] > 0 and body["usage"]["completion_tokens"] == 0

    soft = _score(model_server, query=QUERY, items=ITEMS, label_token_ids=labels,
                  apply_softmax=True).json()["scores"]  # fmt: skip
    for raw, s in zip(body["scores"], soft, strict=True):
        assert sum(s) == pytest.approx(1.0, abs=1e-6)
        assert s == pytest.approx([p / sum(raw) for p in raw], rel=REL)


def test_item_first_and_token_ids(model_server: str) -> None:
    labels = _labels(model_server)
    first = _score(model_server, query=" Answer:", items=["Paris is in France."],
                   label_token_ids=labels, item_first=True).json()["scores"][0]  # fmt: skip
    want = [math.exp(lp) for lp in _next_logprobs(
        model_server, {"text": "Paris is in France. Answer:"}, labels)]  # fmt: skip
    assert first == pytest.approx(want, rel=REL, abs=1e-9)
    q, items = _ids(model_server, QUERY), [_ids(model_server, i) for i in ITEMS]
    by_ids = _score(model_server, query=q, items=items, label_token_ids=labels).json()
    want_ids = [math.exp(lp) for lp in _next_logprobs(model_server, {"input_ids": q + items[0]},
                                                       labels)]  # fmt: skip
    assert by_ids["scores"][0] == pytest.approx(want_ids, rel=REL, abs=1e-9)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"query": "q", "items": ["a"]}, "label_token_ids"),
        ({"query": "q", "items": ["a"], "label_token_ids": []}, "label_token_ids"),
        ({"query": "q", "items": ["a"], "label_token_ids": [10**9]}, "label_token_ids"),
        ({"query": "q", "items": [[1, 2]], "label_token_ids": [1]}, "items"),
        ({"query": [1], "items": ["a"], "label_token_ids": [1]}, "items"),
        ({"query": "q", "items": [], "label_token_ids": [1]}, "items"),
        (
            {"query": "q", "items": ["a"], "label_token_ids": [1], "apply_softmax": "yes"},
            "apply_softmax",
        ),  # fmt: skip
    ],
)
def test_bad_requests_are_400(model_server: str, body: dict, param: str) -> None:
    r = _score(model_server, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_too_long_is_the_context_error(model_server: str) -> None:
    r = _score(model_server, query=[1] * 9000, items=[[2]], label_token_ids=[3])
    assert r.status_code == 400
    assert "context length" in r.json()["error"]["message"]
