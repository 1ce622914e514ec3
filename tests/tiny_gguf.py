"""Tiny GGUF files written with ``gguf.GGUFWriter`` for loader, tokenizer and model tests.

The vocabulary is a real byte-level BPE (every byte plus a handful of merges) so any
text round-trips, or with ``tokenizer_model="llama"`` a SentencePiece-style one (the same
control tokens, the 256 ``<0xXX>`` byte tokens, a few scored pieces); weights are random, written the way convert_hf_to_gguf writes them
(q/k rows permuted for llama.cpp's RoPE), and the HF-layout originals are returned so a
test can check the loader undid the permutation.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass, field

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

__all__ = [
    "CHATML",
    "TinySpec",
    "TinyModel",
    "byte_level_alphabet",
    "hf_permute",
    "spm_vocab",
    "tiny_vocab",
    "write_tiny_gguf",
]

CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<reponame>"]
# SentencePiece pieces, best score first: the merges above with "▁" for "Ġ".
SPM_PIECES = ["\u2581", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "hell", "hello",
              "\u2581h", "\u2581hello", "\u2581w", "or", "\u2581wor", "\u2581worl",
              "\u2581world"]  # fmt: skip
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d"]
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are tiny.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_level_alphabet() -> list[str]:
    """GPT-2's byte -> printable character map, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def hf_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's ``LlamaModel.permute`` (HF rotate-half rows -> llama.cpp rows)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


@dataclass(frozen=True, slots=True)
class TinySpec:
    arch: str = "llama"
    n_layers: int = 2
    hidden: int = 64
    ffn: int = 128
    n_heads: int = 4
    n_kv_heads: int = 2
    context_length: int = 256
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    tokenizer_model: str = "gpt2"
    pre: str = "smollm"
    add_bos: bool = False
    chat_template: str | None = CHATML
    quant: dict[str, Q] = field(
        default_factory=lambda: {
            "token_embd": Q.Q8_0,
            "attn_q": Q.Q4_1,
            "attn_k": Q.Q4_1,
            "ffn_up": Q.Q4_1,
        }
    )
    untied: bool = False
    omit_tensors: tuple[str, ...] = ()
    seed: int = 0


@dataclass(frozen=True)
class TinyModel:
    path: pathlib.Path
    spec: TinySpec
    tokens: list[str]
    weights: dict[str, np.ndarray]  # HF layout, already through the file's quantisation


def tiny_vocab() -> tuple[list[str], list[int]]:
    """The tokens and their GGUF token types (control first, then bytes and merges)."""
    merged = ["".join(m.split(" ")) for m in MERGES]
    tokens = CONTROL + byte_level_alphabet() + merged
    types = [3] * len(CONTROL) + [1] * (len(tokens) - len(CONTROL))
    return tokens, types


def spm_vocab() -> tuple[list[str], list[int], list[float]]:
    """Tokens, GGUF token types and scores of the SentencePiece-style vocabulary: control
    tokens first (the same ids as ``tiny_vocab``'s), byte tokens (type 6), then pieces
    scored by their order."""
    tokens = CONTROL + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES
    types = [3] * len(CONTROL) + [6] * 256 + [1] * len(SPM_PIECES)
    scores = [0.0] * (len(CONTROL) + 256) + [-float(i) for i in range(len(SPM_PIECES))]
    return tokens, types, scores


def _roundtrip(w: np.ndarray, qtype: Q | None) -> tuple[np.ndarray, np.ndarray]:
    """(bytes or floats to write, what a reader dequantises them to)."""
    if qtype is None:
        return w, w
    if qtype == Q.F64:  # a plain type gguf-py writes but cannot dequantise
        return w.astype(np.float64), w
    data = gguf.quants.quantize(w, qtype)
    return data, gguf.quants.dequantize(data, qtype).reshape(w.shape)


def _tensors(spec: TinySpec, vocab_size: int) -> dict[str, tuple[np.ndarray, str]]:
    """name -> (HF-layout float32 weight, role) for every tensor of the model."""
    rng = np.random.default_rng(spec.seed)
    head_dim = spec.hidden // spec.n_heads

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * 0.2).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(spec.hidden)).astype(np.float32)

    out: dict[str, tuple[np.ndarray, str]] = {
        "token_embd.weight": (mat(vocab_size, spec.hidden), "token_embd")
    }
    for i in range(spec.n_layers):
        p = f"blk.{i}."
        out[p + "attn_norm.weight"] = (norm(), "attn_norm")
        out[p + "attn_q.weight"] = (mat(spec.n_heads * head_dim, spec.hidden), "attn_q")
        out[p + "attn_k.weight"] = (mat(spec.n_kv_heads * head_dim, spec.hidden), "attn_k")
        out[p + "attn_v.weight"] = (mat(spec.n_kv_heads * head_dim, spec.hidden), "attn_v")
        out[p + "attn_output.weight"] = (mat(spec.hidden, spec.n_heads * head_dim), "attn_output")
        out[p + "ffn_norm.weight"] = (norm(), "ffn_norm")
        out[p + "ffn_gate.weight"] = (mat(spec.ffn, spec.hidden), "ffn_gate")
        out[p + "ffn_up.weight"] = (mat(spec.ffn, spec.hidden), "ffn_up")
        out[p + "ffn_down.weight"] = (mat(spec.hidden, spec.ffn), "ffn_down")
    out["output_norm.weight"] = (norm(), "output_norm")
    if spec.untied:
        out["output.weight"] = (mat(vocab_size, spec.hidden), "output")
    return out


def write_tiny_gguf(path: pathlib.Path, spec: TinySpec = TinySpec()) -> TinyModel:
    spm = spec.tokenizer_model == "llama"
    tokens, types = tiny_vocab()
    if spm:
        tokens, types, scores = spm_vocab()
    w = gguf.GGUFWriter(str(path), spec.arch)
    w.add_name("tiny-test-llama")
    w.add_block_count(spec.n_layers)
    w.add_context_length(spec.context_length)
    w.add_embedding_length(spec.hidden)
    w.add_feed_forward_length(spec.ffn)
    w.add_head_count(spec.n_heads)
    w.add_head_count_kv(spec.n_kv_heads)
    w.add_rope_dimension_count(spec.hidden // spec.n_heads)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_layer_norm_rms_eps(spec.rms_eps)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model(spec.tokenizer_model)
    w.add_tokenizer_pre("default" if spm else spec.pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if spm:
        w.add_token_scores(scores)
    else:
        w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(spec.add_bos)
    if spec.chat_template is not None:
        w.add_chat_template(spec.chat_template)
    weights: dict[str, np.ndarray] = {}
    for name, (hf, role) in _tensors(spec, len(tokens)).items():
        if name in spec.omit_tensors:
            continue
        data, seen = _roundtrip(hf, spec.quant.get(role))
        weights[name] = seen
        # Permuting whole rows commutes with row-block quantisation, so permute the bytes.
        if role == "attn_q":
            data = hf_permute(data, spec.n_heads)
        elif role == "attn_k":
            data = hf_permute(data, spec.n_kv_heads)
        raw = spec.quant.get(role)
        w.add_tensor(name, np.ascontiguousarray(data), raw_dtype=None if raw == Q.F64 else raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return TinyModel(path, spec, tokens, weights)
