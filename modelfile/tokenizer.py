"""The tokenizer built only from GGUF metadata, with streaming decode.

``tokenizer.ggml.model`` picks llama.cpp's tokenizer: "gpt2" byte-level BPE with the
pre-tokenizer named by ``tokenizer.ggml.pre`` (``modelfile.pretokenizers``), "llama"
SentencePiece-style, "gemma4" and "bert" WordPiece (``modelfile.vocab_models``). Each gives
llama.cpp's ids on every case of llama.cpp's own ``ggml-vocab-*`` tests (docs/model.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tokenizers
from tokenizers import AddedToken, decoders, models, processors
from tokenizers.decoders import DecodeStream

from modelfile.byte_decode import (
    GPT2_BYTES,
    ByteDecoding,
    ByteStreamDecoder,
    byte_level_bytes,
    piece_byte,
    token_bytes,
)
from modelfile.gguf_meta import GGUFMetadata, ModelFileError
from modelfile.pretokenizers import IGNORE_MERGES, SUPPORTED_PRE_TOKENIZERS
from modelfile.vocab_models import (
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_UNKNOWN,
    TOKEN_TYPE_USER_DEFINED,
    gemma4_pipeline,
    spm_pipeline,
    wordpiece_pipeline,
)

__all__ = [
    "SUPPORTED_PRE_TOKENIZERS",
    "TOKENIZER_MODELS",
    "StreamDecoder",
    "Tokenizer",
    "build_tokenizer",
    "tokenizer_from_gguf",
]

TOKENIZER_MODELS = ("bert", "gemma4", "gpt2", "llama")


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
        byte_decoding: ByteDecoding | None = None,
    ) -> None:
        self._inner = inner
        self._bytes = byte_decoding
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
        if self._bytes is not None:
            return self._bytes.decode(ids, skip_special_tokens)
        return self._inner.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool = True) -> StreamDecoder | ByteStreamDecoder:
        if self._bytes is not None:
            return self._bytes.stream(skip_special_tokens)
        return StreamDecoder(self._inner, skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """Decoded text of one token (special tokens included), cached; a SentencePiece
        token keeps its leading space ("▁the" is " the"), which decoding a whole text drops
        from the text's start."""
        text = self._token_text.get(token_id)
        if text is None:
            if self._bytes is not None:
                text = self._bytes.piece(token_id).decode("utf-8", "replace")
            else:
                text = self._inner.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """One token's exact bytes (its part of a character, for a token that holds
        one): a byte-fallback token's ``<0xE2>`` is the byte 0xE2 (GGUF SentencePiece and
        gemma4 vocabularies, or a folder's tokenizer.json), a byte-level BPE piece maps
        back through GPT-2's alphabet, any other token is its text's UTF-8."""
        if self._bytes is not None:
            return self._bytes.piece(token_id)
        piece = self._inner.id_to_token(token_id) or ""
        byte = piece_byte(piece)
        if byte is not None:
            return byte
        text = self.token_text(token_id)
        if "\ufffd" in text and piece and all(c in GPT2_BYTES for c in piece):
            return bytes(GPT2_BYTES[c] for c in piece)
        return text.encode()

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
    bpe = models.BPE(
        vocab={text: i for i, text in enumerate(tokens)},
        merges=[_split_merge(m) for m in merges],
        unk_token=None,
        fuse_unk=False,
        byte_fallback=False,
        ignore_merges=pre in IGNORE_MERGES,
    )
    inner = tokenizers.Tokenizer(bpe)
    inner.pre_tokenizer = make_pre()
    inner.decoder = decoders.ByteLevel()
    return _assemble(
        inner, tokens, token_types, bos=bos_id if add_bos else None, eos=None,
        bos_id=bos_id, eos_id=eos_id, eog_ids=eog_ids, pieces=byte_level_bytes(tokens),
    )  # fmt: skip


def tokenizer_from_gguf(f: GGUFMetadata, *, eog_ids: Sequence[int]) -> Tokenizer:
    """The tokenizer described by ``f``'s ``tokenizer.ggml.*`` keys."""
    model = f.get("tokenizer.ggml.model")
    if model not in TOKENIZER_MODELS:
        supported = ", ".join(repr(m) for m in TOKENIZER_MODELS)
        raise ModelFileError(
            f.path, f"unsupported tokenizer.ggml.model {model!r} (supported: {supported})"
        )
    tokens = f.strings("tokenizer.ggml.tokens")
    types_ = f.array("tokenizer.ggml.token_type")
    types = [1] * len(tokens) if types_ is None else types_.tolist()
    try:
        if model == "gpt2":
            return build_tokenizer(
                tokens=tokens,
                token_types=types,
                merges=f.strings("tokenizer.ggml.merges"),
                pre=str(f.get("tokenizer.ggml.pre", "default")),
                bos_id=_token_id(f, "bos", None),
                eos_id=int(f.require("tokenizer.ggml.eos_token_id")),
                eog_ids=eog_ids,
                add_bos=bool(f.get("tokenizer.ggml.add_bos_token", False)),
            )
        return _from_gguf(f, str(model), tokens, types, eog_ids)
    except ValueError as exc:
        raise ModelFileError(f.path, str(exc)) from None


def _from_gguf(
    f: GGUFMetadata, model: str, tokens: list[str], types: list[int], eog_ids: Sequence[int]
) -> Tokenizer:
    """The "llama", "gemma4" and "bert" models, with llama.cpp's defaults for their special
    ids and flags (llama_vocab::impl::load)."""
    strip_space: bool | None = None  # None: decode with the pipeline's decoder
    if model == "llama":
        bos, eos, unk = _token_id(f, "bos", 1), _token_id(f, "eos", 2), _token_id(f, "unknown", 0)
        scores = f.array("tokenizer.ggml.scores")
        strip_space = bool(f.get("tokenizer.ggml.add_space_prefix", True))
        inner = spm_pipeline(
            tokens,
            [0.0] * len(tokens) if scores is None else scores.tolist(),
            unk=None if unk is None else tokens[unk],
            add_space_prefix=strip_space,
        )
        add_bos = bool(f.get("tokenizer.ggml.add_bos_token", True))
    elif model == "gemma4":
        bos, eos = _token_id(f, "bos", None), _token_id(f, "eos", None)
        merges = [_split_merge(m) for m in f.strings("tokenizer.ggml.merges")]
        inner, strip_space = gemma4_pipeline(tokens, merges), False
        add_bos = bool(f.get("tokenizer.ggml.add_bos_token", False))
    else:  # bert: [CLS] text [SEP]
        bos, eos, unk = (
            _token_id(f, "cls", 101),
            _token_id(f, "seperator", 102),
            _token_id(f, "unknown", 100),
        )
        inner = wordpiece_pipeline(tokens, types, unk=tokens[unk or 0])
        add_bos = True
    if eos is None:
        raise ValueError("tokenizer.ggml.eos_token_id is missing")
    add_eos = bool(f.get("tokenizer.ggml.add_eos_token", model == "bert"))
    return _assemble(
        inner, tokens, types, bos=bos if add_bos else None, eos=eos if add_eos else None,
        bos_id=bos, eos_id=eos, eog_ids=eog_ids, strip_space=strip_space,
    )  # fmt: skip


def _assemble(
    inner: tokenizers.Tokenizer,
    tokens: Sequence[str],
    types: Sequence[int],
    *,
    bos: int | None,
    eos: int | None,
    bos_id: int | None,
    eos_id: int,
    eog_ids: Sequence[int],
    strip_space: bool | None = None,
    pieces: Sequence[bytes] | None = None,
) -> Tokenizer:
    """Control and unknown tokens become special added tokens (parsed in text, skipped
    when decoding skips specials), user-defined ones plain added tokens (always parsed,
    as llama.cpp does); ``bos`` / ``eos`` are added around the text when given.
    ``strip_space`` not None: a byte-fallback vocabulary, decoded from its tokens' bytes;
    ``pieces``: a byte-level vocabulary's tokens' bytes, decoded from them."""
    special = [i for i, t in enumerate(types) if t in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN)]
    user = [i for i, t in enumerate(types) if t == TOKEN_TYPE_USER_DEFINED]
    inner.add_special_tokens([_added(tokens[i], special=True) for i in special])
    if user:
        inner.add_tokens([_added(tokens[i], special=False) for i in user])
    if bos is not None or eos is not None:
        ends = list({tokens[i]: i for i in (bos, eos) if i is not None}.items())
        head = f"{tokens[bos]} " if bos is not None else ""
        tail = f" {tokens[eos]}" if eos is not None else ""
        inner.post_processor = processors.TemplateProcessing(
            single=f"{head}$A{tail}", pair=f"{head}$A{tail} {head}$B{tail}", special_tokens=ends
        )
    decoding = None
    if strip_space is not None:
        decoding = ByteDecoding(token_bytes(tokens, types), frozenset(special), strip_space)
    elif pieces is not None:
        decoding = ByteDecoding(tuple(pieces), frozenset(special), False)
    return Tokenizer(
        inner, bos_id=bos_id, eos_id=eos_id, eog_ids=eog_ids, special_ids=special,
        byte_decoding=decoding,
    )  # fmt: skip


def _token_id(f: GGUFMetadata, name: str, default: int | None) -> int | None:
    value = f.get(f"tokenizer.ggml.{name}_token_id")
    return default if value is None else int(value)


def _split_merge(merge: str) -> tuple[str, str]:
    left, _, right = merge.partition(" ")
    return left, right


def _added(text: str, *, special: bool) -> Any:
    return AddedToken(text, special=special, normalized=False, lstrip=False, rstrip=False)
