"""The GGUF-built tokenizer: BPE, specials, digits, decode and streaming decode."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpu.model.loader import LoadedModel
from modelfile.tokenizer import Tokenizer, build_tokenizer
from modelfile.vocab import load_tokenizer
from tests.tiny_gguf import TinyModel


@pytest.fixture(scope="module")
def tiny_tok(tiny_gguf: TinyModel) -> tuple[Tokenizer, list[str]]:
    tok, _, _ = load_tokenizer(tiny_gguf.path)
    return tok, tiny_gguf.tokens


def test_merges_apply(tiny_tok: tuple[Tokenizer, list[str]]) -> None:
    tok, tokens = tiny_tok
    assert tok.encode("hello world") == [tokens.index("hello"), tokens.index("Ġworld")]


def test_control_text_is_special_and_digits_split(tiny_tok: tuple[Tokenizer, list[str]]) -> None:
    tok, tokens = tiny_tok
    ids = tok.encode("<|im_start|>user\n123")
    assert ids[0] == 1
    assert [tokens[i] for i in ids[1:]] == ["u", "s", "e", "r", "Ċ", "1", "2", "3"]
    assert tok.special_ids == frozenset({0, 1, 2, 3})
    assert tok.eog_ids == frozenset({0, 2, 3}) and tok.eos_id == 2 and tok.bos_id == 1


def test_decode_skips_specials_on_request(tiny_tok: tuple[Tokenizer, list[str]]) -> None:
    tok, _ = tiny_tok
    ids = tok.encode("<|im_start|>héllo 世界<|im_end|>")
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>héllo 世界<|im_end|>"
    assert tok.decode(ids) == "héllo 世界"
    assert tok.encode_batch(["hello", "<|im_end|>"]) == [tok.encode("hello"), [2]]
    assert tok.token_text(2) == "<|im_end|>"


def test_add_bos_when_the_file_asks() -> None:
    from tests.tiny_gguf import tiny_vocab

    tokens, types = tiny_vocab()
    tok = build_tokenizer(
        tokens=tokens, token_types=types, merges=[], pre="gpt-2",
        bos_id=1, eos_id=2, eog_ids=[2], add_bos=True,
    )  # fmt: skip
    assert tok.encode("a") == [1, tokens.index("a")]
    assert tok.encode("a", add_special_tokens=False) == [tokens.index("a")]


def test_unknown_pre_tokenizer_is_refused() -> None:
    with pytest.raises(ValueError, match="unsupported tokenizer.ggml.pre 'nope'"):
        build_tokenizer(
            tokens=["a"], token_types=[1], merges=[], pre="nope",
            bos_id=None, eos_id=0, eog_ids=[0], add_bos=False,
        )  # fmt: skip


def test_stream_decoding_holds_split_characters(tiny_tok: tuple[Tokenizer, list[str]]) -> None:
    tok, _ = tiny_tok
    text = "héllo 世界 🙂!"
    ids = tok.encode(text)  # byte-level tokens: multi-byte characters span several ids
    assert len(ids) > len(text)
    stream = tok.decode_stream()
    pieces = [stream.step(i) for i in ids]
    assert "".join(pieces) + stream.flush() == text
    assert "\ufffd" not in "".join(pieces)
    # the 4 byte-tokens of 🙂 release nothing until the last one
    emoji = tok.encode("🙂")
    s2 = tok.decode_stream()
    assert [s2.step(i) for i in emoji] == ["", "", "", "🙂"]


def test_stream_flush_replaces_incomplete_bytes(tiny_tok: tuple[Tokenizer, list[str]]) -> None:
    tok, _ = tiny_tok
    emoji = tok.encode("🙂")
    stream = tok.decode_stream()
    assert [stream.step(i) for i in emoji[:2]] == ["", ""]
    assert stream.flush() == "\ufffd"
    assert stream.flush() == ""


def test_stream_skips_specials(tiny_tok: tuple[Tokenizer, list[str]]) -> None:
    tok, _ = tiny_tok
    ids = tok.encode("hi<|im_end|>")
    skip = tok.decode_stream(skip_special_tokens=True)
    keep = tok.decode_stream(skip_special_tokens=False)
    assert "".join(skip.step(i) for i in ids) == "hi"
    assert "".join(keep.step(i) for i in ids) == "hi<|im_end|>"


# -- the real vocabulary (facts from llama.cpp on the same file) -----------------------


@pytest.mark.model
def test_smollm2_ids_match_llama_cpp(cpu_model: LoadedModel) -> None:
    tok = cpu_model.tokenizer
    assert tok.vocab_size == 49152
    # llama.cpp splits digits one by one (pre "smollm"); transformers' GGUF import does not.
    assert tok.encode("  99 bottles") == [256, 41, 41, 13577]
    assert tok.encode("<|im_start|>user") == [1, 4093]
    assert tok.eog_ids == frozenset({0, 2, 4}) and cpu_model.config.eog_ids == (0, 2, 4)
    assert tok.special_ids == frozenset(range(17))
    # ids 28909 + 6414 are 64 + 16 '=': a token longer than 32 bytes must decode in full.
    assert tok.encode("=" * 80) == [28909, 6414]
    assert tok.decode([28909, 6414]) == "=" * 80


@pytest.mark.model
def test_smollm2_round_trip(cpu_model: LoadedModel) -> None:
    tok = cpu_model.tokenizer
    for text in ["Hello, world!", "naïve café 北京 🙂", "x = [1, 2, 3]\n\tprint(x)", "½ ¼ ¾"]:
        assert tok.decode(tok.encode(text)) == text
        stream = tok.decode_stream()
        assert "".join(stream.step(i) for i in tok.encode(text)) + stream.flush() == text


def assert_byte_level_decoding_equals_tokenizers(tok: Tokenizer, seed: int, ids: int) -> None:
    """Our byte-level decoding (each token's bytes, one incremental UTF-8 decode) gives
    what ``tokenizers``' ByteLevel decoder gives for the same ids: single ids (``ids`` of
    them, every special id among them, both skip modes) and random runs of ids that split
    characters anywhere (the whole decode, and the stream joined)."""
    import random

    inner, rng, vocab = tok.backend, random.Random(seed), tok.vocab_size
    singles = sorted(tok.special_ids) + [rng.randrange(vocab) for _ in range(ids)]
    for skip in (True, False):
        wrong = [
            i
            for i in singles
            if tok.decode([i], skip) != inner.decode([i], skip_special_tokens=skip)
        ]
        assert not wrong, [
            (i, tok.decode([i], skip), inner.decode([i], skip_special_tokens=skip))
            for i in wrong[:3]
        ]
        for _ in range(300):
            run = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
            whole = tok.decode(run, skip)
            assert whole == inner.decode(run, skip_special_tokens=skip), run
            stream = tok.decode_stream(skip)
            assert "".join(stream.step(i) for i in run) + stream.flush() == whole, run


@pytest.mark.model
def test_smollm2_byte_level_decoding_equals_tokenizers(cpu_model: LoadedModel) -> None:
    assert_byte_level_decoding_equals_tokenizers(cpu_model.tokenizer, 0, 5000)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(max_size=40))
def test_round_trip_and_streaming_any_text(
    tiny_tok: tuple[Tokenizer, list[str]], text: str
) -> None:
    tok, _ = tiny_tok
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    stream = tok.decode_stream()
    pieces = [stream.step(i) for i in ids]
    assert "".join(pieces) + stream.flush() == text
