"""A SentencePiece-style GGUF vocabulary (``tokenizer.ggml.model`` "llama") end to end: the
tiny model with ``spm_vocab`` loads, encodes by piece score with the dummy prefix and byte
fallback, decodes and stream-decodes exactly, and a served model's streamed output equals
its unary output."""

from __future__ import annotations

import pathlib

import openai
import pytest

from modelfile.check import check_model
from modelfile.tokenizer import Tokenizer
from modelfile.vocab import load_tokenizer
from tests.scripted import lifecycle_server
from tests.tiny_gguf import TinyModel, TinySpec, write_tiny_gguf


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    path = tmp_path_factory.mktemp("spm") / "tiny-spm.gguf"
    return write_tiny_gguf(path, TinySpec(tokenizer_model="llama"))


@pytest.fixture(scope="module")
def spm(spm_model: TinyModel) -> tuple[Tokenizer, list[str]]:
    tok, _, _ = load_tokenizer(spm_model.path)
    return tok, spm_model.tokens


def test_pieces_by_score_with_the_dummy_prefix(spm: tuple[Tokenizer, list[str]]) -> None:
    tok, tokens = spm
    assert [tokens[i] for i in tok.encode("hello world")] == ["\u2581hello", "\u2581world"]
    # a space of the text's own after the prefix's: two "▁", the second starting "▁hello"
    assert [tokens[i] for i in tok.encode(" hello")] == ["\u2581", "\u2581hello"]
    assert tok.decode(tok.encode(" hello")) == " hello"
    # the prefix again after a control token, as llama.cpp adds it after each special token
    ids = tok.encode("<|im_start|>hello")
    assert ids == [1, tokens.index("\u2581hello")]


def test_byte_fallback_and_stream_decode(spm: tuple[Tokenizer, list[str]]) -> None:
    tok, tokens = spm
    text = "héllo 世界 🙂!"
    ids = tok.encode(text)
    assert tokens.index("<0xC3>") in ids and tokens.index("<0xF0>") in ids
    assert tok.decode(ids) == text
    stream = tok.decode_stream()
    pieces = [stream.step(i) for i in ids]
    assert "".join(pieces) + stream.flush() == text
    assert "\ufffd" not in "".join(pieces)
    emoji = tok.encode("🙂")  # "▁" then the 4 bytes of the emoji
    s2 = tok.decode_stream()
    assert [s2.step(i) for i in emoji] == ["", "", "", "", "🙂"]


def test_token_text_keeps_the_space(spm: tuple[Tokenizer, list[str]]) -> None:
    tok, tokens = spm
    assert tok.token_text(tokens.index("\u2581hello")) == " hello"
    assert tok.decode([tokens.index("\u2581hello")]) == "hello"
    assert tok.token_text(2) == "<|im_end|>"
    assert tok.special_ids == frozenset({0, 1, 2, 3})


def test_check_model_accepts_it(spm_model: TinyModel) -> None:
    checked = check_model(spm_model.path)
    assert checked.tokenizer.encode("hello") == [spm_model.tokens.index("\u2581hello")]


@pytest.mark.timeout(180)
def test_served_stream_equals_unary(spm_model: TinyModel, tmp_path: pathlib.Path) -> None:
    with lifecycle_server("--model", str(spm_model.path), "--device", "cpu") as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
        body = {"model": "default", "prompt": "hello world é", "max_tokens": 24, "temperature": 0}
        unary = client.completions.create(**body)
        text = unary.choices[0].text
        assert unary.usage is not None and unary.usage.completion_tokens > 0
        streamed = "".join(
            c.choices[0].text for c in client.completions.create(**body, stream=True) if c.choices
        )
        assert streamed == text
        chat = {"model": "default", "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 24, "temperature": 0}  # fmt: skip
        reply = client.chat.completions.create(**chat).choices[0].message.content
        parts = client.chat.completions.create(**chat, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in parts if c.choices) == reply


def test_stream_survives_bytes_that_are_not_utf8(spm: tuple[Tokenizer, list[str]]) -> None:
    """Regression: tokenizers' DecodeStream raised "Invalid prefix encountered" when a
    sampled run of byte tokens was not UTF-8 ("0" then stray bytes turned the decoded "0"
    into U+FFFD); the stream now equals the whole decode, one U+FFFD per bad sequence."""
    tok, tokens = spm
    ids = [tokens.index(t) for t in ("<0x30>", "<0xE2>", "<0xFF>", "\u2581w", "or", "<0xE2>")]
    stream = tok.decode_stream()
    text = "".join(stream.step(i) for i in ids) + stream.flush()
    assert text == tok.decode(ids) == "0\ufffd\ufffd wor\ufffd"


def test_logprob_bytes_are_the_tokens_bytes(spm: tuple[Tokenizer, list[str]]) -> None:
    """OpenAI logprobs' ``bytes`` of a byte-fallback token are its byte, and its token
    string OpenAI's ``bytes:\\xNN``; a piece's are its text's, "▁" a space."""
    from lifecycle.faces.openai_outputs import TokenTexts

    tok, tokens = spm
    texts = TokenTexts(tok)
    assert texts.get(tokens.index("<0xE2>")) == ("bytes:\\xe2", [0xE2])
    assert texts.get(tokens.index("<0x30>")) == ("0", [0x30])
    assert texts.get(tokens.index("\u2581w")) == (" w", [0x20, ord("w")])


def test_a_folders_byte_pieces_are_their_bytes() -> None:
    """A tokenizer.json with SentencePiece byte fallback (Llama 2, Mistral folders):
    ``<0xE2>`` is the byte 0xE2 in logprobs too, not the six characters of its name."""
    import tokenizers
    from tokenizers import models

    from lifecycle.faces.openai_outputs import TokenTexts

    vocab = {"<unk>": 0, "<0xE2>": 1, "\u2581hi": 2, "<0x41>": 3}
    inner = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tok = Tokenizer(inner, bos_id=None, eos_id=0, eog_ids=(0,), special_ids=[0])
    assert tok.token_bytes(1) == b"\xe2" and tok.token_bytes(3) == b"A"
    assert TokenTexts(tok).get(1) == ("bytes:\\xe2", [0xE2])
