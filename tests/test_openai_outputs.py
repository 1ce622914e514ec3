"""Output shaping below the HTTP layer: logprob entries matched to their own step's ids,
and OpenAI's token strings and bytes."""

from __future__ import annotations

from typing import Any

import pytest

from lifecycle.core.buffers import Chunk
from lifecycle.core.outputs import OutputOptions, SampleOutput
from lifecycle.core.sampling import SamplingRequest
from lifecycle.faces.openai_outputs import TokenTexts
from modelfile.gguf_file import default_model_path
from modelfile.vocab import load_tokenizer
from wire import RequestOptions, SamplingParams, pack_f32s


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer(str(default_model_path()))[0]


def test_regression_coalesced_steps_keep_their_own_logprob_ids(tok: Any) -> None:
    """A chunk holding several steps used to pair every step's logprobs with the chunk's
    last ids, so all entries named the same token."""
    sample = SampleOutput(tok, OutputOptions(RequestOptions(return_logprob=True)), [1, 2], "r")
    extras = [{"logprobs": pack_f32s([-float(k)])} for k in (1, 2, 3)]
    sample.consume(Chunk([500, 600, 700], extras))
    sample.consume(Chunk([800], [{"logprobs": pack_f32s([-4.0])}]))
    entries = sample.lp["output_token_logprobs"]
    assert [(e[0], e[1]) for e in entries] == [(-1.0, 500), (-2.0, 600), (-3.0, 700), (-4.0, 800)]


def test_token_texts_and_bytes(tok: Any) -> None:
    texts = TokenTexts(tok)
    ids = tok.encode("héllo 日本", add_special_tokens=False)
    pieces = [texts.get(i) for i in ids]
    assert b"".join(bytes(b) for _, b in pieces).decode() == "héllo 日本"
    partial = [t for t, b in pieces if t.startswith("bytes:")]
    assert partial and all("\ufffd" not in t for t, _ in pieces)
    assert texts.get(2) == ("<|im_end|>", list(b"<|im_end|>"))


def test_a_stop_regex_finish_names_the_pattern_the_worker_matched(tok: Any) -> None:
    """The worker's finish carries the index of the pattern that matched; the name comes
    from it. The frontend used to guess the pattern from the matched text (a full match,
    then a search): here the first pattern fully matches "foo" but never matched in the
    output (its ``\\b`` needs a word boundary the text lacks), so the guess named it."""
    from lifecycle.core.submission import finish_reason

    patterns = (r"\bfoo", "foo")
    by_regex = OutputOptions(sampling=SamplingRequest(SamplingParams(stop_regex=patterns)))
    ids = tok.encode("xfoo bar", add_special_tokens=False)
    sample = SampleOutput(tok, by_regex, [1, 2], "r")
    sample.consume(Chunk(ids, []))
    sample.end(finish_reason(["stop", "foo", 1]))
    assert sample.finish == {"type": "stop", "matched": "foo"}
    assert sample.final_text == "x"  # trimmed at the match
    bad = SampleOutput(tok, by_regex, [1, 2], "r")
    with pytest.raises(ValueError, match="pattern 2 of 2"):  # a worker bug, not a guess
        bad.end(finish_reason(["stop", "foo", 2]))
