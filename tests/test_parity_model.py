"""Issue 22 on the real model over HTTP: prompt logprobs with ``max_new_tokens`` 0, the
prefix cache to the token, and ``stop_regex`` (native and OpenAI extension)."""

from __future__ import annotations

import random
import re
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.model

CHAT = "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n"
PROMPT = "The quick brown fox jumps over the lazy dog."


def _post(url: str, path: str, body: dict[str, Any], status: int = 200) -> dict[str, Any]:
    r = httpx.post(url + path, json=body, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


def test_max_new_tokens_0_returns_the_prompt_logprobs(model_server: str) -> None:
    lp = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
          "token_ids_logprob": [11, 12]}  # fmt: skip
    zero = _post(model_server, "/generate", {"text": PROMPT, **lp,
                 "sampling_params": {"max_new_tokens": 0}})  # fmt: skip
    one = _post(model_server, "/generate", {"text": PROMPT, **lp,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0}})  # fmt: skip
    meta = zero["meta_info"]
    assert zero["output_ids"] == [] and zero["text"] == ""
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    n = meta["prompt_tokens"]
    got = meta["input_token_logprobs"]
    assert len(got) == n > 5 and got[0][0] is None and all(e[0] < 0 for e in got[1:])
    want = one["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in got] == [e[1] for e in want]
    assert [e[0] for e in got[1:]] == pytest.approx([e[0] for e in want[1:]], abs=1e-4)
    assert len(meta["input_top_logprobs"]) == len(meta["input_token_ids_logprobs"]) == n
    assert meta["output_token_logprobs"] == []


def test_completions_echo_with_max_tokens_0_scores_the_prompt(model_server: str) -> None:
    out = _post(model_server, "/v1/completions",
                {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 0})  # fmt: skip
    (choice,) = out["choices"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    lps = choice["logprobs"]["token_logprobs"]
    assert lps[0] is None and len(lps) == out["usage"]["prompt_tokens"] > 5
    assert out["usage"]["completion_tokens"] == 0
    bad = _post(model_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, 400)
    assert bad["error"]["param"] == "max_tokens"


def test_a_repeated_100_token_prompt_reports_99_cached_tokens(model_server: str) -> None:
    """99, not 100: the last prompt token is fed again, because its logits give the first
    output token (SGLang's match stops there too). 96 of them are six whole shared
    blocks, 3 rows are copied from the seventh; the output is that of the cold run."""
    ids = random.Random(2201).sample(range(1000, 40000), 100)
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    cold = _post(model_server, "/generate", body)
    warm = _post(model_server, "/generate", body)
    assert cold["meta_info"]["cached_tokens"] == 0
    assert warm["meta_info"]["cached_tokens"] == 99
    assert warm["output_ids"] == cold["output_ids"]


def _gen(url: str, **sp: Any) -> dict[str, Any]:
    body = {"text": CHAT, "sampling_params": {"max_new_tokens": 16, "temperature": 0, **sp}}
    return _post(url, "/generate", body)


def test_stop_regex_ends_trims_and_reports_the_match(model_server: str) -> None:
    full = _gen(model_server, ignore_eos=True)["text"]
    pattern = re.escape(full.split()[1]) + r"\W"  # the second word and what follows it
    m = re.search(pattern, full)
    assert m is not None
    trimmed = _gen(model_server, stop_regex=pattern)
    # the finish names the pattern that matched, as SGLang's does (not the matched text)
    assert trimmed["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    assert trimmed["text"] == full[: m.start()]
    kept = _gen(model_server, stop_regex=[r"\d{7}", pattern], no_stop_trim=True)
    assert kept["text"] == full[: m.end()]
    assert kept["meta_info"]["finish_reason"]["matched"] == pattern  # of the two, the one
    chat = _post(model_server, "/v1/completions", {"prompt": CHAT, "max_tokens": 16,
                 "temperature": 0, "stop_regex": pattern})  # fmt: skip
    assert chat["choices"][0]["finish_reason"] == "stop"
    assert chat["choices"][0]["matched_stop"] == pattern
    assert chat["choices"][0]["text"] == full[: m.start()]


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/generate", {"text": "x", "sampling_params": {"stop_regex": "(a"}},
         "stop_regex '(a' is not a valid regular expression"),
        ("/v1/completions", {"prompt": "x", "stop_regex": ["(a+)+"]}, "repeats a repeated part"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
         "stop_regex": "a" * 300}, "at most 256 characters"),
    ],
)  # fmt: skip
def test_bad_stop_regex_is_a_400_that_says_why(
    model_server: str, path: str, body: dict[str, Any], message: str
) -> None:
    out = _post(model_server, path, body, 400)
    text = (
        out["error"]["message"] if "error" in out and isinstance(out["error"], dict) else str(out)
    )
    assert message in text
