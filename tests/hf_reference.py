"""Tiny random-weight models of each supported family, built by transformers (the
reference for the model math), and their GGUF files written the way llama.cpp's
``convert_hf_to_gguf.py`` writes them.

A family is a transformers config scaled down (2 layers, hidden 64, 4 query and 2 KV
heads, the byte-level vocabulary of ``tests/tiny_gguf.py``) with the feature that makes
it that family: Qwen2's q/k/v biases, Qwen3's q/k norms and a head size that is not
hidden / heads, Llama 3's ``llama3`` RoPE scaling (a ``rope_freqs`` tensor in the file),
linear and YaRN scaling, Phi-3's fused q/k/v and gate/up, LongRoPE (long factors: the
file's context exceeds the original one) and a sliding window of 16 keys on every layer
(shorter than the tests' 120-token prompt, so the window matters), Gemma 2's scaled
embeddings, GeGLU, post-norms, soft caps and windows on every other layer, Gemma 3's q/k
norms, five windowed layers in six and their own RoPE base, SmolLM3's layers without RoPE
(every fourth), Granite's embedding, attention, residual and logit multipliers, OLMo 2's
norms after attention and MLP (none before) and q/k norms over the whole projection. Weights are drawn at a trained model's spread, not
transformers' init (std 0.02 would leave every logit within a rounding error of the
others): matrices N(0, 0.2) at hidden 64 (0.2 sqrt(64 / hidden) wider, the same gain),
norm weights 1 + N(0, 0.1) (Gemma's, which scale by 1 + w: N(0, 0.1)), biases as the
matrices, so greedy
choices stand well apart and a wrong sign or a missing term shows.

The GGUF side follows the converter (conversion/base.py, llama.py, qwen.py, phi.py,
gemma.py in the tree ``make bench-peer`` unpacks): tensor names (gguf-py's own map, as the converter
looks them up), the ``llama`` q/k row permutation (weights and biases), the
``rope_freqs`` factors llama3 scaling becomes, the ``rope.scaling.*`` keys,
``attention.key_length`` when the head size is given; Phi-3's keys (the original context,
``attention.sliding_window``, ``rope.scaling.attn_factor``) and its
``rope_factors_long`` / ``rope_factors_short`` tensors; Gemma's norm weights plus 1,
Gemma 2's soft caps and window, Gemma 3's window and local RoPE base. Matrices
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
    config_class: str = ""  # transformers' config class; "": the model class's name's

    @property
    def config_class_name(self) -> str:
        return self.config_class or self.model_class.replace("ForCausalLM", "Config")

    @property
    def permuted(self) -> bool:
        """q/k rows permuted by the converter (``LlamaModel.permute``; SmolLM3's is one)."""
        return self.arch in ("llama", "smollm3", "granite")

    @property
    def gemma(self) -> bool:
        """Norm weights stored as the offset from 1 (``Gemma2RMSNorm``: x * (1 + w)),
        which the converter adds back."""
        return self.arch.startswith("gemma")


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
        Family(
            "phi3",
            "phi3",
            "Phi3ForCausalLM",
            {
                "tie_word_embeddings": False,
                "sliding_window": 16,
                "original_max_position_embeddings": 16,
                "rope_parameters": {
                    "rope_type": "longrope",
                    "rope_theta": 10000.0,
                    "original_max_position_embeddings": 16,
                    "long_factor": [1.0, 1.25, 1.5, 2.0, 3.0, 5.0, 8.0, 13.0],
                    "short_factor": [1.0, 1.0, 1.05, 1.1, 1.2, 1.4, 1.7, 2.0],
                },
                "bos_token_id": 1,
                "eos_token_id": 2,
                "pad_token_id": 0,
            },
        ),
        # Layers 0 and 2 windowed; caps small enough to bend the tiny model's scores and
        # logits; query_pre_attn_scalar the head size (2B/9B's: the converter writes no
        # other), which is not hidden / heads here.
        Family(
            "gemma2",
            "gemma2",
            "Gemma2ForCausalLM",
            {
                "num_hidden_layers": 4,
                "head_dim": 32,
                "query_pre_attn_scalar": 32,
                "sliding_window": 16,
                "attn_logit_softcapping": 4.0,
                "final_logit_softcapping": 6.0,
                "tie_word_embeddings": True,
                "bos_token_id": 1,
                "eos_token_id": 2,
                "pad_token_id": 0,
            },
        ),
        # Six layers: Gemma 3's pattern (layers 0-4 windowed, 5 global) as the converter
        # writes it, with no pattern key; the global layer's RoPE linearly scaled (the
        # 4B-27B models' factor 8), the local ones' base 10000 unscaled.
        Family(
            "gemma3",
            "gemma3",
            "Gemma3ForCausalLM",
            {
                "num_hidden_layers": 6,
                "head_dim": 32,
                "query_pre_attn_scalar": 32,
                "sliding_window": 16,
                "rope_parameters": {
                    "full_attention": {
                        "rope_type": "linear",
                        "factor": 8.0,
                        "rope_theta": 1000000.0,
                    },
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                },
                "tie_word_embeddings": True,
                "bos_token_id": 1,
                "eos_token_id": 2,
                "pad_token_id": 0,
            },
            config_class="Gemma3TextConfig",
        ),
        # Four layers: the fourth (layer 3) rotates nothing, as every fourth of SmolLM3's.
        Family(
            "smollm3",
            "smollm3",
            "SmolLM3ForCausalLM",
            {
                "num_hidden_layers": 4,
                "tie_word_embeddings": True,
                "bos_token_id": 1,
                "eos_token_id": 2,
                "pad_token_id": 0,
            },  # fmt: skip
        ),
        # OLMo 2: norms after attention and MLP only, q/k norms over the whole projection
        Family(
            "olmo2",
            "olmo2",
            "Olmo2ForCausalLM",
            {
                "tie_word_embeddings": False,
                "bos_token_id": 1,
                "eos_token_id": 2,
                "pad_token_id": 0,
            },  # fmt: skip
        ),
        # Granite's four multipliers, each far enough from 1 (or from 1/sqrt(head_dim))
        # that a missing one moves every logit.
        Family(
            "granite",
            "granite",
            "GraniteForCausalLM",
            {
                "tie_word_embeddings": True,
                "embedding_multiplier": 3.0,
                "attention_multiplier": 0.125,
                "residual_multiplier": 0.5,
                "logits_scaling": 4.0,
                "bos_token_id": 1,
                "eos_token_id": 2,
                "pad_token_id": 0,
            },
        ),
    )
}


def build_hf(family: Family, seed: int = 0, dtype: torch.dtype = torch.float64) -> Any:
    """The random transformers model (eval mode, eager attention) in ``dtype``."""
    import transformers

    tokens, _ = tiny_vocab()
    config_class = getattr(transformers, family.config_class_name)
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
                p.copy_((0.0 if family.gemma else 1.0) + 0.1 * noise)
            else:
                p.copy_(std * noise)
    return model.to(dtype).eval()


# transformers' model_type -> the GGUF architecture its converter writes
_ARCH_OF_MODEL_TYPE = {"gemma3_text": "gemma3"}


def _arch(config: Any) -> str:
    return _ARCH_OF_MODEL_TYPE.get(config.model_type, config.model_type)


def _gguf_name(hf: str, arch: str, n_layers: int) -> str | None:
    """convert_hf_to_gguf's tensor name for an HF parameter (None: not written): gguf-py's
    tensor map for the architecture, as the converter's ``map_tensor_name`` reads it."""
    names = gguf.get_tensor_name_map(_ARCH_ENUM[arch], n_layers)
    return names.get_name(hf, try_suffixes=(".weight", ".bias"))


_ARCH_ENUM = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}


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
    family: Family, model: Any, path: pathlib.Path, qtype: FileType = None, name: str = ""
) -> pathlib.Path:
    """``model``'s weights as a GGUF of ``family.arch`` at ``path``, its matrices in
    ``qtype`` (a type, "Q4_K_M", or None for F32), named ``name`` (default
    ``tiny-<family>``)."""
    c = model.config
    tokens, types = tiny_vocab()
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    arch = family.arch
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name or f"tiny-{family.name}")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    if "head_dim" in family.config:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    if not family.gemma:  # the Gemma converters write no dimension count
        w.add_rope_dimension_count(head_dim)
    if arch != "gemma2":  # nor Gemma 2 a base: llama.cpp's default applies
        w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if arch == "gemma2":  # Gemma2Model.set_gguf_parameters
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
        w.add_sliding_window(c.sliding_window)
    if arch == "gemma3":  # TextModel's and Gemma3Model's set_gguf_parameters
        w.add_rope_freq_base_swa(c.rope_parameters["sliding_attention"]["rope_theta"])
        if c.final_logit_softcapping:
            w.add_final_logit_softcapping(c.final_logit_softcapping)
        w.add_sliding_window(c.sliding_window)
    if arch == "granite":  # GraniteModel.set_gguf_parameters
        w.add_attention_scale(c.attention_multiplier)
        w.add_embedding_scale(c.embedding_multiplier)
        w.add_residual_scale(c.residual_multiplier)
        w.add_logit_scale(c.logits_scaling)
    if arch == "phi3":  # Phi3MiniModel.set_gguf_parameters / generate_extra_tensors
        original = rope["original_max_position_embeddings"]
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_sliding_window(c.sliding_window or 0)
        if rope.get("long_factor"):
            scale = c.max_position_embeddings / original
            attn = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
            w.add_rope_scaling_attn_factors(attn)
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
        name = _gguf_name(hf, arch, c.num_hidden_layers)
        if name is None:
            continue
        if family.permuted and ".attn_q." in name:
            value = _permute(value, c.num_attention_heads)
        elif family.permuted and ".attn_k." in name:
            value = _permute(value, c.num_key_value_heads)
        elif family.gemma and hf.endswith("norm.weight"):  # GemmaModel.modify_tensors
            value = value + np.float32(1.0)
        kind = _tensor_type(name, value, qtype, c.num_hidden_layers, c.tie_word_embeddings)
        data, raw = _quantized(name, np.ascontiguousarray(value), kind)
        w.add_tensor(name, data, raw_dtype=raw)
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_factors(rope, head_dim))
    if arch == "phi3" and rope.get("long_factor"):
        for kind in ("long", "short"):
            factors = np.array(rope[f"{kind}_factor"], dtype=np.float32)
            w.add_tensor(f"rope_factors_{kind}.weight", factors)
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
        gname = _gguf_name(name, _arch(c), c.num_hidden_layers)
        if gname == "output.weight" and c.tie_word_embeddings:
            gname = "token_embd.weight"
        kind = None if gname is None else _tensor_type(
            gname, arr, qtype, c.num_hidden_layers, c.tie_word_embeddings
        )  # fmt: skip
        if kind is not None:
            arr = gguf.quants.dequantize(quantize_any(arr, kind), kind).reshape(arr.shape)
        out[name] = torch.from_numpy(np.ascontiguousarray(arr)).to(v.dtype)
    return out
