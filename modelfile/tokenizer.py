"""A byte-level BPE tokenizer built only from GGUF metadata, with streaming decode.

The pipeline mirrors llama.cpp's ``llm_tokenizer_bpe`` for the pre-tokenizer named by
``tokenizer.ggml.pre``; for SmolLM2 it matched llama.cpp on 284/284 reference strings
(docs/model.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers.decoders import DecodeStream

from modelfile.gguf_meta import GGUFMetadata, ModelFileError

__all__ = [
    "SUPPORTED_PRE_TOKENIZERS",
    "StreamDecoder",
    "Tokenizer",
    "build_tokenizer",
    "tokenizer_from_gguf",
]

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# llama.cpp's LLAMA3 pre-tokenizer regex (src/llama-vocab.cpp), same as HF's llama-3 split.
_LLAMA3_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


# llama.cpp's QWEN2 regex: LLAMA3's with every digit on its own.
_QWEN2_REGEX = _LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
    # llama.cpp: regex list ["\p{N}", GPT-2 regex]: every digit isolated, then the GPT-2 split.
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )


def _gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)


def _split_then_bytes(regex: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )


def _llama3() -> pre_tokenizers.PreTokenizer:
    return _split_then_bytes(_LLAMA3_REGEX)


def _qwen2() -> pre_tokenizers.PreTokenizer:
    return _split_then_bytes(_QWEN2_REGEX)


SUPPORTED_PRE_TOKENIZERS = {
    "smollm": _digits_then_gpt2,
    "starcoder": _digits_then_gpt2,
    "refact": _digits_then_gpt2,
    "command-r": _digits_then_gpt2,
    "gpt-2": _gpt2,
    "llama-bpe": _llama3,
    "llama3": _llama3,
    "qwen2": _qwen2,
}


# Pre-tokenizers after which llama.cpp takes a piece that is a whole token as that token,
# without merging (llama_vocab::get_ignore_merges; HF's "ignore_merges" in Llama 3's
# tokenizer.json).
_IGNORE_MERGES = frozenset({"llama-bpe", "llama3"})


class StreamDecoder:
    """Incremental detokenisation: text is released only once its UTF-8 is complete."""

    __slots__ = ("_inner", "_pending", "_skip_special", "_stream")

    def __init__(self, inner: tokenizers.Tokenizer, skip_special_tokens: bool) -> None:
        self._inner = inner
        self._skip_special = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._pending: list[int] = []

    def step(self, token_id: int) -> str:
        """New text ready after this token ("" while a character is incomplete)."""
        text = self._stream.step(self._inner, token_id)
        if text is None:
            self._pending.append(token_id)
            return ""
        self._pending.clear()
        return text

    def flush(self) -> str:
        """Held-back text at the end of the stream; incomplete bytes become U+FFFD."""
        if not self._pending:
            return ""
        text = self._inner.decode(self._pending, skip_special_tokens=self._skip_special)
        self._pending.clear()
        self._stream = DecodeStream(skip_special_tokens=self._skip_special)
        return text


class Tokenizer:
    """Encode/decode for one model; ids and special sets come from the GGUF."""

    def __init__(
        self,
        inner: tokenizers.Tokenizer,
        *,
        bos_id: int | None,
        eos_id: int,
        eog_ids: Sequence[int],
        special_ids: Sequence[int],
    ) -> None:
        self._inner = inner
        self.vocab_size: int = inner.get_vocab_size(with_added_tokens=True)
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.eog_ids: frozenset[int] = frozenset(eog_ids)
        self.special_ids: frozenset[int] = frozenset(special_ids)
        self._token_text: dict[int, str] = {}

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying ``tokenizers.Tokenizer`` (for batch helpers that need it)."""
        return self._inner

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; control-token text (e.g. ``<|im_start|>``) is always parsed as special.

        ``add_special_tokens`` adds BOS when the model asks for it (``add_bos_token``).
        """
        return self._inner.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        encs = self._inner.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
        return [e.ids for e in encs]

    def decode(
        self,
        ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> str:
        """Text of ``ids``.

        ``spaces_between_special_tokens`` is accepted for API parity; like HF fast
        tokenizers and llama.cpp, byte-level BPE joins special-token text without spaces.
        """
        del spaces_between_special_tokens
        return self._inner.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool = True) -> StreamDecoder:
        return StreamDecoder(self._inner, skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """Decoded text of one token (special tokens included), cached."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._inner.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text

    def token_to_id(self, token: str) -> int | None:
        return self._inner.token_to_id(token)


def build_tokenizer(
    *,
    tokens: Sequence[str],
    token_types: Sequence[int],
    merges: Sequence[str],
    pre: str,
    bos_id: int | None,
    eos_id: int,
    eog_ids: Sequence[int],
    add_bos: bool,
) -> Tokenizer:
    """A byte-level BPE ``Tokenizer`` from the GGUF vocabulary arrays.

    Raises ``ValueError`` for an unknown pre-tokenizer (the loader names the file).
    """
    make_pre = SUPPORTED_PRE_TOKENIZERS.get(pre)
    if make_pre is None:
        supported = ", ".join(sorted(SUPPORTED_PRE_TOKENIZERS))
        raise ValueError(f"unsupported tokenizer.ggml.pre {pre!r} (supported: {supported})")
    vocab = {text: i for i, text in enumerate(tokens)}
    pairs = [_split_merge(m) for m in merges]
    bpe = models.BPE(
        vocab=vocab,
        merges=pairs,
        unk_token=None,
        fuse_unk=False,
        byte_fallback=False,
        ignore_merges=pre in _IGNORE_MERGES,
    )
    inner = tokenizers.Tokenizer(bpe)
    inner.pre_tokenizer = make_pre()
    inner.decoder = decoders.ByteLevel()
    special = [i for i, t in enumerate(token_types) if t == TOKEN_TYPE_CONTROL]
    user = [i for i, t in enumerate(token_types) if t == TOKEN_TYPE_USER_DEFINED]
    inner.add_special_tokens([_added(tokens[i], special=True) for i in special])
    if user:
        inner.add_tokens([_added(tokens[i], special=False) for i in user])
    if add_bos and bos_id is not None:
        bos = tokens[bos_id]
        inner.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    return Tokenizer(inner, bos_id=bos_id, eos_id=eos_id, eog_ids=eog_ids, special_ids=special)


def tokenizer_from_gguf(f: GGUFMetadata, *, eog_ids: Sequence[int]) -> Tokenizer:
    """The tokenizer described by ``f``'s ``tokenizer.ggml.*`` keys."""
    model = f.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ModelFileError(
            f.path, f"unsupported tokenizer.ggml.model {model!r} (supported: 'gpt2' byte-level BPE)"
        )
    tokens = f.strings("tokenizer.ggml.tokens")
    types = f.array("tokenizer.ggml.token_type")
    bos = f.get("tokenizer.ggml.bos_token_id")
    try:
        return build_tokenizer(
            tokens=tokens,
            token_types=[] if types is None else types.tolist(),
            merges=f.strings("tokenizer.ggml.merges"),
            pre=str(f.get("tokenizer.ggml.pre", "default")),
            bos_id=None if bos is None else int(bos),
            eos_id=int(f.require("tokenizer.ggml.eos_token_id")),
            eog_ids=eog_ids,
            add_bos=bool(f.get("tokenizer.ggml.add_bos_token", False)),
        )
    except ValueError as exc:
        raise ModelFileError(f.path, str(exc)) from None


def _split_merge(merge: str) -> tuple[str, str]:
    left, _, right = merge.partition(" ")
    return left, right


def _added(text: str, *, special: bool) -> Any:
    return AddedToken(text, special=special, normalized=False, lstrip=False, rstrip=False)
