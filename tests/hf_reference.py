"""Tiny random-weight models of each supported family, built by transformers (the
reference for the model math), and their GGUF files written the way llama.cpp's
``convert_hf_to_gguf.py`` writes them.

A family is a transformers config scaled down (2 layers, hidden 64, 4 query and 2 KV
heads, the byte-level vocabulary of ``tests/tiny_gguf.py``) with the feature that makes
it that family: Qwen2's q/k/v biases, Qwen3's q/k norms and a head size that is not
hidden / heads, Llama 3's ``llama3`` RoPE scaling (a ``rope_freqs`` tensor in the file),
linear and YaRN scaling. Weights are drawn at a trained model's spread, not
transformers' init (std 0.02 would leave every logit within a rounding error of the
others): matrices N(0, 0.2) at hidden 64 (0.2 sqrt(64 / hidden) wider, the same gain),
norm weights 1 + N(0, 0.1), biases as the matrices, so greedy
choices stand well apart and a wrong sign or a missing term shows.

The GGUF side follows the converter (conversion/base.py, llama.py, qwen.py in the
tree ``make bench-peer`` unpacks): tensor names, the ``llama`` q/k row permutation
(weights and biases), the ``rope_freqs`` factors llama3 scaling becomes, the
``rope.scaling.*`` keys, ``attention.key_length`` when the head size is given. Matrices
are F32 or, with ``qtype``, quantized by gguf-py's reference quantizer (what
``llama-quantize`` computes for the legacy types); ``dequantized_state`` gives the
weights the file then holds, for a transformers model on exactly those values.
"""

from __future__ import annotations

import math
import pathlib
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from tests.kquants import q4_k_m_type, quantize_any
from tests.tiny_gguf import CHATML, MERGES, tiny_vocab

__all__ = ["FAMILIES", "Family", "build_hf", "dequantized_state", "write_family_gguf"]


@dataclass(frozen=True)
class Family:
    """A transformers model class, its config's keyword arguments and the GGUF arch."""

    name: str
    arch: str
    model_class: str
    config: dict[str, Any]

    @property
    def permuted(self) -> bool:
        return self.arch == "llama"


_BASE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
}

FAMILIES = {
    f.name: f
    for f in (
        Family("llama", "llama", "LlamaForCausalLM", {"tie_word_embeddings": False}),
        Family(
            "llama3",
            "llama",
            "LlamaForCausalLM",
            {
                "tie_word_embeddings": True,
                "rope_parameters": {
                    "rope_type": "llama3",
                    "rope_theta": 500000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 32,
                },
            },
        ),
        Family(
            "llama-linear",
            "llama",
            "LlamaForCausalLM",
            {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}},
        ),
        Family("qwen2", "qwen2", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
        # rows of 256: the k-quants apply (at hidden 64 a Q4_K_M file falls back to Q5_0/Q8_0)
        Family(
            "qwen2-wide",
            "qwen2",
            "Qwen2ForCausalLM",
            {"hidden_size": 256, "intermediate_size": 512, "tie_word_embeddings": True},
        ),
        Family(
            "qwen2-yarn",
            "qwen2",
            "Qwen2ForCausalLM",
            {
                "tie_word_embeddings": False,
                "rope_parameters": {
                    "rope_type": "yarn",
                    "rope_theta": 1000000.0,
                    "factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
            },
        ),
        Family("qwen3", "qwen3", "Qwen3ForCausalLM", {"head_dim": 32, "tie_word_embeddings": True}),
    )
}


def build_hf(family: Family, seed: int = 0, dtype: torch.dtype = torch.float64) -> Any:
    """The random transformers model (eval mode, eager attention) in ``dtype``."""
    import transformers

    tokens, _ = tiny_vocab()
    config_class = getattr(transformers, family.model_class.replace("ForCausalLM", "Config"))
    config = config_class(vocab_size=len(tokens), **{**_BASE, **family.config})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, family.model_class)(config)
    gen = torch.Generator().manual_seed(seed)
    std = 0.2 * math.sqrt(64 / config.hidden_size)  # the same gain at every width
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(std * noise)
    return model.to(dtype).eval()


def _gguf_name(hf: str) -> str | None:
    """convert_hf_to_gguf's tensor name for an HF parameter (None: not written)."""
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in fixed:
        return fixed[hf]
    parts = hf.split(".")
    if parts[:2] != ["model", "layers"]:
        return None
    layer, rest = parts[2], ".".join(parts[3:])
    table = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.q_proj.bias": "attn_q.bias",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.k_proj.bias": "attn_k.bias",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.v_proj.bias": "attn_v.bias",
        "self_attn.o_proj.weight": "attn_output.weight",
        "self_attn.q_norm.weight": "attn_q_norm.weight",
        "self_attn.k_norm.weight": "attn_k_norm.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    return f"blk.{layer}.{table[rest]}"


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's ``LlamaModel.permute`` (weights and biases)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _llama3_factors(rope: dict[str, Any], dim: int) -> np.ndarray:
    """The ``rope_freqs`` tensor convert_hf_to_gguf writes for llama3 scaling."""
    base = rope["rope_theta"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


# A file's matrices in one type, or in "Q4_K_M": llama-quantize's plan (tests/kquants.py).
FileType = Q | str | None


def _tensor_type(name: str, w: np.ndarray, file_type: FileType, n_layers: int,
                 tied: bool) -> Q | None:  # fmt: skip
    """The type a tensor is stored in: vectors F32, matrices ``file_type`` (F32 if None)."""
    if file_type is None or w.ndim != 2 or name.endswith("norm.weight"):
        return None
    if file_type == "Q4_K_M":
        layer = int(name.split(".")[1]) if name.startswith("blk.") else None
        return q4_k_m_type(name, w.shape[1], layer, n_layers, tied)
    assert isinstance(file_type, Q)
    return file_type


def _quantized(name: str, w: np.ndarray, qtype: Q | None) -> tuple[np.ndarray, Q | None]:
    """What the file stores for a tensor of type ``qtype`` (None: F32)."""
    if qtype is None:
        return w, None
    return quantize_any(w, qtype), qtype


def write_family_gguf(
    family: Family, model: Any, path: pathlib.Path, qtype: FileType = None
) -> pathlib.Path:
    """``model``'s weights as a GGUF of ``family.arch`` at ``path``, its matrices in
    ``qtype`` (a type, "Q4_K_M", or None for F32)."""
    c = model.config
    tokens, types = tiny_vocab()
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(str(path), family.arch)
    w.add_name(f"tiny-{family.name}")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    if "head_dim" in family.config:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    rope = c.rope_parameters
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    state = {k: v.detach().to(torch.float32).numpy() for k, v in model.state_dict().items()}
    if c.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for hf, value in state.items():
        name = _gguf_name(hf)
        if name is None:
            continue
        if family.permuted and ".attn_q." in name:
            value = _permute(value, c.num_attention_heads)
        elif family.permuted and ".attn_k." in name:
            value = _permute(value, c.num_key_value_heads)
        kind = _tensor_type(name, value, qtype, c.num_hidden_layers, c.tie_word_embeddings)
        data, raw = _quantized(name, np.ascontiguousarray(value), kind)
        w.add_tensor(name, data, raw_dtype=raw)
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_factors(rope, head_dim))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def dequantized_state(model: Any, qtype: FileType) -> dict[str, torch.Tensor]:
    """``model``'s state with every matrix replaced by what the file of ``qtype``
    (``write_family_gguf``) holds, as gguf-py dequantizes it, to load into a
    transformers model."""
    c = model.config
    out = {}
    for name, v in model.state_dict().items():
        arr = v.detach().to(torch.float32).numpy()
        gname = _gguf_name(name)
        if gname == "output.weight" and c.tie_word_embeddings:
            gname = "token_embd.weight"
        kind = None if gname is None else _tensor_type(
            gname, arr, qtype, c.num_hidden_layers, c.tie_word_embeddings
        )  # fmt: skip
        if kind is not None:
            arr = gguf.quants.dequantize(quantize_any(arr, kind), kind).reshape(arr.shape)
        out[name] = torch.from_numpy(np.ascontiguousarray(arr)).to(v.dtype)
    return out
