"""Decoding from each token's bytes: for vocabularies with byte-fallback tokens
(SentencePiece-style "llama" and "gemma4") each token is a run of UTF-8 bytes ("▁" a
space, ``<0xXX>`` one byte); for byte-level BPE ("gpt2") each character of a token stands
for one byte (GPT-2's alphabet), and a token with a character outside it (an added
token's text) is its own UTF-8, as ``tokenizers``' ByteLevel decoder reads it. The text
is their concatenation decoded with U+FFFD for what is not UTF-8, as llama.cpp's
``token_to_piece`` bytes are.

Streaming this way costs a dict-free table read and Python's incremental UTF-8 decoder
per token, about a tenth of ``tokenizers``' ``DecodeStream`` (which decodes a window of
ids twice per step): the frontend detokenises every streamed token.

``tokenizers``' ByteFallback decoder instead turns every byte of a run that is not valid
UTF-8 into its own U+FFFD, valid bytes of the run included, so a later token can change text
already decoded and ``DecodeStream`` fails ("Invalid prefix encountered"); a model's
sampled output meets that. Here the stream runs Python's incremental UTF-8 decoder, whose
output joined is always the whole decode's.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass

from modelfile.vocab_models import SPACE, TOKEN_TYPE_BYTE

__all__ = [
    "GPT2_BYTES",
    "ByteDecoding",
    "ByteStreamDecoder",
    "byte_level_bytes",
    "piece_byte",
    "token_bytes",
]


def piece_byte(text: str) -> bytes | None:
    """The byte a byte-fallback piece (``<0xE2>``) stands for; None for any other piece."""
    if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        try:
            return bytes([int(text[3:5], 16)])
        except ValueError:
            return None
    return None


def token_bytes(tokens: Sequence[str], token_types: Sequence[int]) -> tuple[bytes, ...]:
    """Each token's bytes: a byte token's one byte, any other's text with "▁" a space."""
    out = []
    for text, kind in zip(tokens, token_types, strict=True):
        byte = piece_byte(text) if kind == TOKEN_TYPE_BYTE else None
        out.append(byte if byte is not None else text.replace(SPACE, " ").encode())
    return tuple(out)


def _gpt2_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: vocabulary character -> byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


GPT2_BYTES = _gpt2_alphabet()


def byte_level_bytes(tokens: Sequence[str]) -> tuple[bytes, ...]:
    """Each byte-level BPE token's bytes: its characters through GPT-2's alphabet, or its
    text's UTF-8 when one character is outside it (``tokenizers``' ByteLevel decoder)."""
    out = []
    for text in tokens:
        try:
            out.append(bytes([GPT2_BYTES[c] for c in text]))
        except KeyError:
            out.append(text.encode())
    return tuple(out)


@dataclass(frozen=True, slots=True)
class ByteDecoding:
    """``pieces``: each id's bytes; ``strip_space``: drop one space from the text's start
    (the dummy prefix the encoder added, as llama.cpp and transformers drop it)."""

    pieces: tuple[bytes, ...]
    special_ids: frozenset[int]
    strip_space: bool

    def piece(self, token_id: int) -> bytes:
        """The token's bytes; none for an id past the vocabulary (a padded output row)."""
        return self.pieces[token_id] if 0 <= token_id < len(self.pieces) else b""

    def raw(self, ids: Sequence[int], skip_special_tokens: bool) -> bytes:
        skip = self.special_ids if skip_special_tokens else frozenset()
        return b"".join(self.piece(i) for i in ids if i not in skip)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        text = self.raw(ids, skip_special_tokens).decode("utf-8", "replace")
        return text[1:] if self.strip_space and text.startswith(" ") else text

    def stream(self, skip_special_tokens: bool) -> ByteStreamDecoder:
        return ByteStreamDecoder(self, skip_special_tokens)


class ByteStreamDecoder:
    """Incremental detokenisation: text is released only once its UTF-8 is complete; the
    pieces joined with ``flush()`` equal ``ByteDecoding.decode`` of the same ids."""

    __slots__ = ("_at_start", "_decoder", "_decoding", "_skip")

    def __init__(self, decoding: ByteDecoding, skip_special_tokens: bool) -> None:
        self._decoding = decoding
        self._skip = decoding.special_ids if skip_special_tokens else frozenset()
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._at_start = decoding.strip_space

    def step(self, token_id: int) -> str:
        """New text ready after this token ("" while a character is incomplete)."""
        if token_id in self._skip:
            return ""
        return self._start(self._decoder.decode(self._decoding.piece(token_id)))

    def flush(self) -> str:
        """Held-back bytes at the end of the stream, as U+FFFD."""
        text = self._start(self._decoder.decode(b"", final=True))
        self._decoder.reset()
        return text

    def _start(self, text: str) -> str:
        if self._at_start and text:
            self._at_start = False
            return text[1:] if text.startswith(" ") else text
        return text
