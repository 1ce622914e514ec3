"""The byte-level BPE pre-tokenizers, by ``tokenizer.ggml.pre``: llama.cpp's regex lists
(``llm_tokenizer_bpe``'s constructor in src/llama-vocab.cpp) as ``tokenizers`` pieces.

llama.cpp applies a list of regexes one after another, each splitting the pieces the
previous one left, text between matches kept as pieces of its own: a ``Split`` with
behaviour "isolated" per regex, then the GPT-2 byte mapping. Every table entry gives
llama.cpp's ids on every case of its ``ggml-vocab-*`` test (docs/model.md).
"""

from __future__ import annotations

from collections.abc import Callable

from tokenizers import Regex, pre_tokenizers

__all__ = ["IGNORE_MERGES", "SUPPORTED_PRE_TOKENIZERS"]

# llama.cpp's LLAMA3 regex, same as HF's llama-3 split.
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# QWEN2: LLAMA3's with every digit on its own.
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
# QWEN35: QWEN2's with combining marks (\p{M}) kept with the letters.
_QWEN35 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+"
    r"|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GPT-2's regex; llama.cpp's custom splitter for it also ends in HF's "|\s+".
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# DEEPSEEK_LLM's letter class, written with escapes: the source's literal characters
# include some (U+1F7D, U+1FD3, U+1FDB) that Unicode normalisation would turn into others.
_DEEPSEEK_LETTERS = (
    "A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1"
    "\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5"
    "\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a"
    "\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b"
    "\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc"
    "\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4"
    "\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787"
    "\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a"
    "\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb"
    "\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
    "\U0001e900-\U0001e943"
)
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"


def _byte_level(*regexes: str) -> Callable[[], pre_tokenizers.PreTokenizer]:
    def make() -> pre_tokenizers.PreTokenizer:
        splits = [
            pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in regexes
        ]
        bytes_ = pre_tokenizers.ByteLevel(
            add_prefix_space=False, trim_offsets=True, use_regex=False
        )
        return pre_tokenizers.Sequence([*splits, bytes_])

    return make


def _gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
    # llama.cpp: ["\p{N}", GPT-2's regex]: every digit isolated, then the GPT-2 split.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2()])


SUPPORTED_PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    "smollm": _digits_then_gpt2,
    "starcoder": _digits_then_gpt2,
    "refact": _digits_then_gpt2,
    "command-r": _digits_then_gpt2,
    "gpt-2": _gpt2,
    "mpt": _gpt2,
    "llama-bpe": _byte_level(_LLAMA3),
    "llama3": _byte_level(_LLAMA3),
    "qwen2": _byte_level(_QWEN2),
    "qwen35": _byte_level(_QWEN35),
    "falcon": _byte_level(r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"),
    "deepseek-llm": _byte_level(
        r"[\r\n]",
        "\\s?[" + _DEEPSEEK_LETTERS + "]+",
        "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
        r"\s+$",
        _CJK,
        r"\p{N}+",
    ),
    "deepseek-coder": _byte_level(r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"),
}

# Pre-tokenizers after which llama.cpp takes a piece that is a whole token as that token,
# without merging (llama_vocab::get_ignore_merges; HF's "ignore_merges" in Llama 3's
# tokenizer.json).
IGNORE_MERGES = frozenset({"llama-bpe", "llama3"})
