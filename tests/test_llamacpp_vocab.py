"""Our GGUF tokenizer against llama.cpp's own tokenizer tests: the ``models/ggml-vocab-*.gguf``
files with their ``.inp`` (texts, ``__ggml_vocab_test__`` between them) and ``.out`` (llama.cpp's
ids, one line a text) in the llama.cpp tree ``make bench-peer`` unpacks. Each vocabulary
whose tokenizer model and pre-tokenizer we support must give llama.cpp's ids for every
case; the others are listed as skipped with the reason. Without the tree (no `make
bench-peer` on this machine) the module skips.
"""

from __future__ import annotations

import pathlib

import pytest

from bench.llama_server import cache_dir
from modelfile.gguf_meta import GGUFMetadata
from modelfile.tokenizer import SUPPORTED_PRE_TOKENIZERS, tokenizer_from_gguf

MODELS = cache_dir() / "llama.cpp" / "models"
SEPARATOR = "\n__ggml_vocab_test__\n"

pytestmark = pytest.mark.skipif(
    not MODELS.is_dir(), reason=f"llama.cpp's tree is not unpacked ({MODELS}): make bench-peer"
)


def _vocabs() -> list[pathlib.Path]:
    if not MODELS.is_dir():
        return []
    return sorted(
        p for p in MODELS.glob("ggml-vocab-*.gguf") if p.with_suffix(".gguf.out").exists()
    )


def _cases(path: pathlib.Path) -> list[tuple[str, list[int]]]:
    """As llama.cpp's tests/test-tokenizer-0.cpp reads them (a separator at the very end
    opens no case)."""
    raw = path.with_suffix(".gguf.inp").read_bytes().decode("utf-8")
    texts = raw.split(SEPARATOR)
    if raw.endswith(SEPARATOR):
        texts.pop()
    outs = path.with_suffix(".gguf.out").read_text(encoding="utf-8").split("\n")
    outs = outs[: len(texts)]
    assert len(texts) == len(outs), (path.name, len(texts), len(outs))
    return [(t, [int(i) for i in o.split()]) for t, o in zip(texts, outs, strict=True)]


@pytest.mark.parametrize("path", _vocabs(), ids=lambda p: p.name.removeprefix("ggml-vocab-"))
def test_llamacpp_vocab_cases(path: pathlib.Path) -> None:
    f = GGUFMetadata(path)
    model, pre = f.get("tokenizer.ggml.model"), f.get("tokenizer.ggml.pre", "default")
    if model != "gpt2" or pre not in SUPPORTED_PRE_TOKENIZERS:
        pytest.skip(f"tokenizer {model!r} with pre-tokenizer {pre!r} not supported yet")
    tok = tokenizer_from_gguf(f, eog_ids=())
    wrong = [
        (text, got, want)
        for text, want in _cases(path)
        if (got := tok.encode(text, add_special_tokens=False)) != want
    ]
    assert not wrong, "\n".join(f"{t!r}: ours {g}, llama.cpp {w}" for t, g, w in wrong[:5])
