"""The tokenizer models other than byte-level BPE, as ``tokenizers`` pipelines built from
GGUF metadata: SentencePiece-style vocabularies (``tokenizer.ggml.model`` "llama": Llama 1-2,
Mistral, Phi-3, Gemma 1-3; "gemma4") and WordPiece ("bert").

Each follows llama.cpp's tokenizer for that model (src/llama-vocab.cpp) and gives its ids on
every case of llama.cpp's ``ggml-vocab-*`` tests (docs/model.md). Each builder returns the
pipeline without added tokens (``modelfile.tokenizer`` adds the control and user-defined
ones); its decoder is transformers' for the same model (``Tokenizer`` decodes the
byte-fallback vocabularies itself: ``modelfile.byte_decode``).
"""

from __future__ import annotations

from collections.abc import Sequence

import tokenizers
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers

__all__ = [
    "SPACE",
    "TOKEN_TYPE_BYTE",
    "TOKEN_TYPE_CONTROL",
    "TOKEN_TYPE_UNKNOWN",
    "TOKEN_TYPE_USER_DEFINED",
    "gemma4_pipeline",
    "merges_by_score",
    "spm_pipeline",
    "wordpiece_pipeline",
]

SPACE = "\u2581"  # "▁": SentencePiece's escaped space
# GGUF token types (llama.cpp's llama_token_type).
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_BYTE = 6


def merges_by_score(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """BPE merges that replay SentencePiece's score-driven merging.

    llama.cpp's ``llm_tokenizer_spm`` merges, at each step, the adjacent pair whose joined
    text is the token of highest score. A BPE whose merges are every split of every token
    into two tokens, ranked by the joined token's score, takes the same steps; the order is
    transformers' ``generate_merges`` (convert_slow_tokenizer's Llama and Gemma converters).
    """
    vocab = {t: i for i, t in enumerate(tokens)}
    found: list[tuple[str, str, float]] = []
    for piece, score in zip(tokens, scores, strict=True):
        local = [
            (piece[:k], piece[k:], score)
            for k in range(1, len(piece))
            if piece[:k] in vocab and piece[k:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        found.extend(local)
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _spm_decoder(strip_prefix: bool) -> decoders.Decoder:
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if strip_prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    return decoders.Sequence(steps)


def spm_pipeline(
    tokens: Sequence[str],
    scores: Sequence[float],
    *,
    unk: str | None,
    add_space_prefix: bool,
) -> tokenizers.Tokenizer:
    """llama.cpp's ``llm_tokenizer_spm``: a space before the text (the dummy prefix, when
    ``tokenizer.ggml.add_space_prefix``, llama.cpp's default), spaces as "▁", merges by
    score, characters no token holds as their UTF-8 bytes (``<0xXX>`` tokens). Decoding
    drops the dummy prefix's space from the start of the text."""
    bpe = models.BPE(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=merges_by_score(tokens, scores),
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,
    )
    inner = tokenizers.Tokenizer(bpe)
    steps: list[normalizers.Normalizer] = [normalizers.Replace(" ", SPACE)]
    if add_space_prefix:
        # Prepend runs on each stretch of text between added tokens: llama.cpp's prefix
        # after every special token (is_prev_special).
        steps.insert(0, normalizers.Prepend(SPACE))
    inner.normalizer = normalizers.Sequence(steps)
    inner.decoder = _spm_decoder(strip_prefix=add_space_prefix)
    return inner


def gemma4_pipeline(
    tokens: Sequence[str], merges: Sequence[tuple[str, str]]
) -> tokenizers.Tokenizer:
    """llama.cpp's GEMMA4 BPE: spaces as "▁", the text split only into runs of newlines and
    runs of anything else, merges by rank on raw UTF-8 (no GPT-2 byte mapping), characters
    no token holds as ``<0xXX>`` byte tokens; no dummy prefix."""
    bpe = models.BPE(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=list(merges),
        unk_token=None,
        fuse_unk=False,
        byte_fallback=True,
    )
    inner = tokenizers.Tokenizer(bpe)
    inner.normalizer = normalizers.Replace(" ", SPACE)
    inner.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|[\n]+"), behavior="isolated")
    inner.decoder = _spm_decoder(strip_prefix=False)
    return inner


def wordpiece_pipeline(
    tokens: Sequence[str], token_types: Sequence[int], *, unk: str
) -> tokenizers.Tokenizer:
    """llama.cpp's ``llm_tokenizer_wpm`` (BERT): lower case, accents stripped, split at
    whitespace, punctuation and CJK characters, then the longest vocabulary match from the
    left, a word no match covers becoming the unknown token.

    GGUF writes a word-initial piece as "▁piece" and a continuation as "piece" where
    Hugging Face's WordPiece has "piece" and "##piece": the vocabulary is renamed to that
    form (control tokens keep their text)."""
    vocab: dict[str, int] = {}
    for i, (text, kind) in enumerate(zip(tokens, token_types, strict=True)):
        if kind in (TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL):  # their text kept as is
            name = text
        else:
            name = text[1:] if text.startswith(SPACE) else "##" + text
        vocab.setdefault(name, i)
    inner = tokenizers.Tokenizer(
        models.WordPiece(vocab, unk_token=unk, max_input_chars_per_word=100)
    )
    inner.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=True, lowercase=True
    )
    inner.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    inner.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    return inner
