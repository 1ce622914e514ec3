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


@pytest.mark.parametrize(
    "text",
    ["Héllo wörld — ünïcode ✓ and emoji 🎉 too, then more", "The capital of France is Paris."],
)
def test_a_stop_string_ending_inside_a_token_is_never_shown_then_taken_back(  # type: ignore[no-untyped-def]
    tok, text: str
) -> None:
    """Issue 54, point 1: every stop string that starts and ends at any character of the
    text, token boundary or not (multi-byte characters included). The worker ends the
    sample on the token whose text completes the stop string; each streamed text must
    extend the one before and be a prefix of the final text, which ends where the stop
    string begins. A hold-back one character short shows a stop string's first
    character, then takes it back: this catches it."""
    ids = tok.encode(text, add_special_tokens=False)
    full = tok.decode(ids)
    checked = 0
    for start in range(1, len(full) - 1):
        for length in (1, 2, 3, 5):
            stop = full[start : start + length]
            if len(stop) < length or full.find(stop) != start:
                continue  # the first occurrence is the one the worker stops at
            st = SampleText(tok, stops=(stop,))
            shown, history = "", []
            for i in ids:
                st.feed([i])
                if stop in st.raw:  # this token completes it: the worker's STOP
                    break
                new = st.visible(len(shown))
                assert new.startswith(shown), (stop, shown, new)
                shown = new
                history.append(shown)
            final = st.final({"type": "stop", "matched": stop}, len(shown))
            assert final == full[:start], (stop, final)
            assert all(final.startswith(h) for h in history), (stop, history[-1], final)
            checked += 1
    assert checked > 50
