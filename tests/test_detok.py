"""Tokenize batching and incremental detokenization with the real SmolLM2 tokenizer."""

from __future__ import annotations

import anyio
import pytest

from lifecycle.core.detok import SampleText, TextCodec
from modelfile.vocab import load_tokenizer


@pytest.fixture(scope="module")
def tok():  # type: ignore[no-untyped-def]
    return load_tokenizer()[0]


def test_stream_text_equals_whole_decode(tok) -> None:  # type: ignore[no-untyped-def]
    ids = tok.encode("Héllo wörld — ünïcode ✓ and emoji 🎉 too", add_special_tokens=False)
    st = SampleText(tok)
    shown = ""
    for i in ids:
        st.feed([i])
        new = st.visible(len(shown))
        assert new.startswith(shown)
        shown = new
    assert st.final({"type": "length", "length": len(ids)}, len(shown)) == tok.decode(ids)


def test_stop_string_held_back_then_trimmed(tok) -> None:  # type: ignore[no-untyped-def]
    ids = tok.encode("one two three four", add_special_tokens=False)
    st = SampleText(tok, stops=(" three",))
    shown = ""
    for i in ids[:-1]:  # up to and including " three"
        st.feed([i])
        shown = st.visible(len(shown))
        assert " thr" not in shown
    assert st.final({"type": "stop", "matched": " three"}, len(shown)) == "one two"
    kept = SampleText(tok, stops=(" three",), no_stop_trim=True)
    kept.feed(ids[:-1])
    assert kept.final({"type": "stop", "matched": " three"}, 0) == "one two three"


def test_stop_regex_match_is_trimmed_at_its_last_occurrence(tok) -> None:  # type: ignore[no-untyped-def]
    """A regex match is the text's last occurrence of the matched text (the worker found
    it in the last tokens), even when the same text appears earlier; no_stop_trim keeps it."""
    ids = tok.encode("call 12. then call 34. done", add_special_tokens=False)
    st = SampleText(tok, stops=("zz",))
    st.feed(ids)
    assert st.final({"type": "stop", "matched": "call", "regex": 0}, 0) == "call 12. then "
    kept = SampleText(tok, no_stop_trim=True)
    kept.feed(ids)
    assert kept.final({"type": "stop", "matched": "call", "regex": 0}, 0) == tok.decode(ids)


def test_stop_token_text_is_trimmed(tok) -> None:  # type: ignore[no-untyped-def]
    ids = tok.encode("alpha beta", add_special_tokens=False)
    st = SampleText(tok, skip_special_tokens=True)
    st.feed(ids)
    assert st.final({"type": "stop", "matched": ids[-1]}, 0) == tok.decode(ids[:-1])


@pytest.mark.anyio
async def test_concurrent_encodes_share_one_batch(tok) -> None:  # type: ignore[no-untyped-def]
    codec = TextCodec(tok)
    results: dict[int, list[list[int]]] = {}

    async def one(i: int) -> None:
        results[i] = await codec.encode([f"prompt number {i}"], True)

    async with anyio.create_task_group() as tg:
        for i in range(8):
            tg.start_soon(one, i)
    assert codec.batches == 1
    for i in range(8):
        assert results[i] == [tok.encode(f"prompt number {i}")]
    long = "word " * 2000  # over the inline limit: encoded in a worker thread
    assert await codec.encode([long], False) == [tok.encode(long, add_special_tokens=False)]
