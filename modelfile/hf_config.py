"""A Hugging Face ``config.json`` read as the ``ModelConfig`` the GGUF of the same model
gives (``modelfile/config.py``), so one decoder runs both.

What ``convert_hf_to_gguf`` would write, read from the source instead: the
architecture from ``architectures[0]`` (else ``model_type``), the sizes, RoPE's base and
scaling from ``rope_scaling`` (transformers 4) or ``rope_parameters`` (transformers 5),
Llama 3's scaling as the per-frequency factors the converter computes
(``llama3_rope_factors``). What the decoder does not compute is refused by name:
another activation, partial rotary, sliding-window attention, o_proj or MLP biases,
other RoPE scalings. q/k rows are HF's rotate-half layout (``rope_permuted=False``).
"""

from __future__ import annotations

import math
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from modelfile.config import ModelConfig, RopeScaling, derive_eog_ids
from modelfile.gguf_meta import ModelFileError

__all__ = ["HF_ARCHITECTURES", "config_from_hf", "hf_architecture", "llama3_rope_factors"]

# config.json's architectures[0] -> the GGUF architecture the decoder knows it as
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_MODEL_TYPES = {arch: arch for arch in HF_ARCHITECTURES.values()}
_ROPE_TYPES = ("default", "linear", "yarn", "llama3")


def hf_architecture(path: pathlib.Path, cfg: dict[str, Any]) -> str:
    """``llama``, ``qwen2`` or ``qwen3``; anything else is refused."""
    names = cfg.get("architectures") or []
    if names:
        arch = HF_ARCHITECTURES.get(str(names[0]))
        shown = repr(names[0])
    else:
        arch = _MODEL_TYPES.get(str(cfg.get("model_type")))
        shown = f"model_type {cfg.get('model_type')!r}"
    if arch is None:
        raise ModelFileError(
            path, f"unsupported architecture {shown} (supported: {', '.join(HF_ARCHITECTURES)})"
        )
    return arch


def _rope(cfg: dict[str, Any]) -> dict[str, Any]:
    """RoPE's parameters, wherever this config's transformers version put them."""
    rope = {**(cfg.get("rope_parameters") or {}), **(cfg.get("rope_scaling") or {})}
    rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    rope["rope_type"] = rope.get("rope_type") or rope.get("type") or "default"
    return rope


def _f32(value: Any) -> float:
    """A float as the GGUF of the same model stores it (float32), so both give one config."""
    return float(np.float32(float(value)))


def _rope_scaling(path: pathlib.Path, cfg: dict[str, Any]) -> RopeScaling:
    rope = _rope(cfg)
    kind = str(rope["rope_type"])
    if kind not in _ROPE_TYPES:
        raise ModelFileError(
            path, f"RoPE scaling {kind!r} unsupported (supported: {', '.join(_ROPE_TYPES)})"
        )
    factor = _f32(rope.get("factor", 1.0))
    if kind in ("default", "llama3") or factor == 1.0:
        return RopeScaling()
    if factor <= 0:
        raise ModelFileError(path, f"RoPE scaling factor must be positive, got {factor}")
    if kind == "linear":
        return RopeScaling(kind="linear", factor=factor)
    unmodelled = [k for k in ("mscale", "mscale_all_dim") if rope.get(k)]
    if rope.get("truncate") is False:
        unmodelled.append("truncate")
    if unmodelled:
        raise ModelFileError(path, f"yarn RoPE with {', '.join(unmodelled)} unsupported")
    attn = rope.get("attention_factor")
    return RopeScaling(
        kind="yarn",
        factor=factor,
        original_context=int(
            rope.get("original_max_position_embeddings") or cfg["max_position_embeddings"]
        ),
        beta_fast=_f32(rope.get("beta_fast") or 32.0),
        beta_slow=_f32(rope.get("beta_slow") or 1.0),
        attn_factor=None if attn is None else _f32(attn),
    )


def llama3_rope_factors(cfg: dict[str, Any], head_dim: int) -> np.ndarray:
    """The ``rope_freqs`` factors ``convert_hf_to_gguf`` writes for ``llama3`` scaling
    (LlamaModel.generate_extra_tensors): 1 for short wavelengths, ``factor`` for long
    ones, a smooth blend between, frequencies in float32 as the converter has them."""
    rope = _rope(cfg)
    base = np.float32(rope["rope_theta"])
    freqs = np.float32(1.0) / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
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


def _refuse_unmodelled(path: pathlib.Path, cfg: dict[str, Any], arch: str,
                       n_heads: int, n_kv: int, head_dim: int) -> None:  # fmt: skip
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ModelFileError(path, f"hidden_act {act!r} unsupported (supported: 'silu')")
    if n_kv <= 0 or n_heads % n_kv:
        raise ModelFileError(path, f"{n_heads} heads not divisible by {n_kv} kv heads")
    partial = float(cfg.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ModelFileError(path, f"partial rotary ({partial} of {head_dim} dims) unsupported")
    if cfg.get("use_sliding_window"):
        raise ModelFileError(path, "sliding-window attention (use_sliding_window) unsupported")
    if arch != "qwen2" and cfg.get("attention_bias"):
        raise ModelFileError(path, "attention_bias (biases on q/k/v and o_proj) unsupported")
    if cfg.get("mlp_bias"):
        raise ModelFileError(path, "mlp_bias unsupported")


def config_from_hf(
    path: pathlib.Path,
    cfg: dict[str, Any],
    *,
    tokens: Sequence[str],
    bos_id: int | None,
    eos_id: int,
    extra_eog: Sequence[int],
    add_bos: bool,
    name: str,
) -> ModelConfig:
    """``cfg`` (config.json, at ``path``) and the tokenizer's facts as a ``ModelConfig``."""
    arch = hf_architecture(path, cfg)
    try:
        hidden, n_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        n_kv = int(cfg.get("num_key_value_heads") or n_heads)
        head_dim = int(cfg.get("head_dim") or hidden // n_heads)
        _refuse_unmodelled(path, cfg, arch, n_heads, n_kv, head_dim)
        rope = _rope(cfg)
        if rope["rope_type"] == "llama3":
            llama3_rope_factors(cfg, head_dim)  # its keys present and numbers
        return ModelConfig(
            arch=arch,
            n_layers=int(cfg["num_hidden_layers"]),
            hidden=hidden,
            ffn=int(cfg["intermediate_size"]),
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            rope_theta=_f32(rope["rope_theta"]),
            rms_eps=_f32(cfg.get("rms_norm_eps", 1e-6)),
            context_length=int(cfg.get("max_position_embeddings", 2048)),
            vocab_size=int(cfg["vocab_size"]),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_id=bos_id,
            eos_id=eos_id,
            eog_ids=derive_eog_ids(tokens, eos_id, extra_eog),
            add_bos=add_bos,
            name=name,
            qkv_bias=arch == "qwen2",
            qk_norm=arch == "qwen3",
            rope_permuted=False,
            rope_scaling=_rope_scaling(path, cfg),
            rope_freq_factors=rope["rope_type"] == "llama3",
        )
    except KeyError as exc:
        raise ModelFileError(path, f"required key {exc.args[0]!r} is missing") from None
    except (TypeError, ValueError) as exc:
        raise ModelFileError(path, f"bad value: {exc}") from None
