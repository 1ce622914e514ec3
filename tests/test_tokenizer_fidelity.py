"""Our GGUF-built tokenizer against llama.cpp's, on the fixture made by
tools/make_tokenizer_fixture.py (see docs/references.md)."""

from __future__ import annotations

import hashlib
import json
import pathlib
import re

import pytest

from modelfile.gguf_file import default_model_path
from modelfile.tokenizer import Tokenizer
from modelfile.vocab import load_tokenizer

pytestmark = pytest.mark.model

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "tokenizer_llamacpp.json"
MIN_CASES = 300


@pytest.fixture(scope="module")
def reference() -> dict:
    return json.loads(FIXTURE.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer()[0]


def _show(text: str, got: list[int], want: list[int]) -> str:
    return f"{text!r}\n    ours     {got}\n    llama.cpp {want}"


def test_fixture_is_for_the_default_model(reference: dict) -> None:
    digest = hashlib.sha256(default_model_path().read_bytes()).hexdigest()
    assert digest == reference["model_sha256"], (
        "the default model file changed: regenerate tests/fixtures with tools/make_tokenizer_fixture.py"
    )
    assert len(reference["cases"]) >= MIN_CASES


def test_ids_match_llamacpp(tok: Tokenizer, reference: dict) -> None:
    bad = [
        _show(c["text"], got, c["ids"])
        for c in reference["cases"]
        if (got := tok.encode(c["text"], add_special_tokens=False)) != c["ids"]
    ]
    assert not bad, f"{len(bad)}/{len(reference['cases'])} strings differ:\n" + "\n".join(bad[:10])


def test_add_special_tokens_adds_nothing_for_this_model(tok: Tokenizer, reference: dict) -> None:
    # add_bos_token is false in the GGUF, so the default call must give llama.cpp's ids too.
    cases = reference["cases"][:50]
    assert [tok.encode(c["text"]) for c in cases] == [c["ids"] for c in cases]


def test_decode_inverts_encode(tok: Tokenizer, reference: dict) -> None:
    bad = [
        repr(c["text"])
        for c in reference["cases"]
        if tok.decode(tok.encode(c["text"]), skip_special_tokens=False) != c["text"]
    ]
    assert not bad, f"{len(bad)} strings do not round-trip:\n" + "\n".join(bad[:10])


def test_decode_skips_exactly_the_control_tokens(tok: Tokenizer, reference: dict) -> None:
    specials = sorted(tok.decode([i], skip_special_tokens=False) for i in tok.special_ids)
    pattern = re.compile("|".join(re.escape(s) for s in specials))
    with_specials = [c for c in reference["cases"] if set(c["ids"]) & tok.special_ids]
    assert len(with_specials) >= 20
    for c in with_specials:
        assert tok.decode(c["ids"], skip_special_tokens=True) == pattern.sub("", c["text"])
