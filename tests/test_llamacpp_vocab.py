"""Our GGUF tokenizer against llama.cpp's own tokenizer tests: the ``models/ggml-vocab-*.gguf``
files with their ``.inp`` (texts, ``__ggml_vocab_test__`` between them) and ``.out`` (llama.cpp's
ids, one line a text) in the llama.cpp tree. Each vocabulary must give llama.cpp's ids for
every case (a tokenizer model or pre-tokenizer we do not build is listed as skipped with the
reason), decode them back to the text (WordPiece excepted: it lower-cases and strips
accents) and stream-decode them to the same text. The tree is the one ``make bench-peer``
unpacks; where it is absent, ``llamacpp_vocab_dir`` unpacks only these files from the
pinned llama-cpp-python sdist (tests/llamacpp_vocab.py), or the module skips with the reason.
"""

from __future__ import annotations

import pathlib

import pytest

from modelfile.gguf_meta import GGUFMetadata
from modelfile.tokenizer import SUPPORTED_PRE_TOKENIZERS, TOKENIZER_MODELS, tokenizer_from_gguf
from tests.llamacpp_vocab import VOCABS, vocab_cases, vocab_dir
from tests.test_tokenizer import assert_byte_level_decoding_equals_tokenizers

# One test per vocabulary llama.cpp ships cases for (names from the pinned sdist).
pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def models_dir() -> pathlib.Path:
    found, reason = vocab_dir()
    if found is None:
        pytest.skip(reason)
    return found


@pytest.mark.parametrize("name", VOCABS)
def test_llamacpp_vocab_cases(name: str, models_dir: pathlib.Path) -> None:
    path = models_dir / f"ggml-vocab-{name}.gguf"
    f = GGUFMetadata(path)
    model, pre = f.get("tokenizer.ggml.model"), f.get("tokenizer.ggml.pre", "default")
    if model not in TOKENIZER_MODELS or (model == "gpt2" and pre not in SUPPORTED_PRE_TOKENIZERS):
        pytest.skip(f"tokenizer {model!r} with pre-tokenizer {pre!r} not supported yet")
    tok = tokenizer_from_gguf(f, eog_ids=())
    cases = vocab_cases(path)
    wrong = [
        (text, got, want)
        for text, want in cases
        if (got := tok.encode(text, add_special_tokens=False)) != want
    ]
    assert not wrong, "\n".join(f"{t!r}: ours {g}, llama.cpp {w}" for t, g, w in wrong[:5])
    for text, ids in cases:
        whole = tok.decode(ids, skip_special_tokens=False)
        assert model == "bert" or whole == text
        stream = tok.decode_stream(skip_special_tokens=False)
        assert "".join(stream.step(i) for i in ids) + stream.flush() == whole, text
    if model == "gpt2":  # decoded from its tokens' bytes: exactly as tokenizers decodes
        assert_byte_level_decoding_equals_tokenizers(tok, 1, 2000)
