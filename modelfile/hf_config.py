"""A Hugging Face ``config.json`` read as the ``ModelConfig`` the GGUF of the same model
gives (``modelfile/config.py``), so one decoder runs both.

The folder's config becomes the metadata keys ``convert_hf_to_gguf`` would write for
it (``converter_keys``: the architecture's ``set_gguf_parameters``), and those go
through ``config_from_gguf``, the one reading of what an architecture is. The
architecture comes from ``architectures[0]`` (else ``model_type``); RoPE's base and
scaling from ``rope_scaling`` (transformers 4) or ``rope_parameters`` (transformers 5,
Gemma 3's per layer type); Llama 3's scaling as the per-frequency factors the converter
computes (``llama3_rope_factors``), Phi-3's LongRoPE factors as its
``rope_factors_long`` / ``rope_factors_short``. Where the folder says more than a GGUF
can, it is kept: Gemma's ``query_pre_attn_scalar``, Mistral's ``sliding_window`` (on
every layer, as transformers reads it). What the decoder does not compute is refused by
name: another activation, partial rotary, Qwen's sliding window, o_proj or MLP biases,
other RoPE scalings. q/k rows are HF's rotate-half layout (``rope_permuted=False``).
"""

from __future__ import annotations

import math
import pathlib
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from modelfile.config import ModelConfig, config_from_gguf, derive_eog_ids
from modelfile.gguf_meta import ModelFileError

__all__ = [
    "HF_ARCHITECTURES",
    "config_from_hf",
    "converter_keys",
    "hf_architecture",
    "llama3_rope_factors",
    "longrope_factors",
    "rope_kind",
    "vocab_rows",
]

# config.json's architectures[0] -> the GGUF architecture the decoder knows it as
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "SmolLM3ForCausalLM": "smollm3",
    "GraniteForCausalLM": "granite",
    "Olmo2ForCausalLM": "olmo2",
}
_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "smollm3": "smollm3",
    "granite": "granite",
    "olmo2": "olmo2",
}
_ROPE_TYPES = ("default", "linear", "yarn", "llama3", "longrope")
_GEMMA = ("gemma2", "gemma3")
# What an architecture's MLP gate is (config.json's hidden_activation / hidden_act).
_ACTIVATIONS = {"gemma2": "gelu_pytorch_tanh", "gemma3": "gelu_pytorch_tanh"}


def hf_architecture(path: pathlib.Path, cfg: dict[str, Any]) -> str:
    """The GGUF architecture of ``cfg``; one not in ``HF_ARCHITECTURES`` is refused."""
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


def _rope_type(rope: dict[str, Any]) -> str:
    kind = str(rope.get("rope_type") or rope.get("type") or "default")
    return "longrope" if kind == "su" else kind  # Phi-3's first name for it


def _rope(cfg: dict[str, Any]) -> dict[str, Any]:
    """RoPE's parameters (the full-attention layers' where they differ by layer type),
    wherever this config's transformers version put them."""
    params = cfg.get("rope_parameters") or {}
    if isinstance(params.get("full_attention"), dict):
        rope = {**params["full_attention"]}
    else:
        rope = {**params, **(cfg.get("rope_scaling") or {})}
    rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    rope["rope_type"] = _rope_type(rope)
    return rope


def rope_kind(cfg: dict[str, Any]) -> str:
    """The RoPE scaling of ``cfg``'s (full-attention) layers: default, linear, ..."""
    return str(_rope(cfg)["rope_type"])


def _window_rope(cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's windowed layers' RoPE: ``rope_parameters.sliding_attention``
    (transformers 5) or ``rope_local_base_freq`` (4), unscaled."""
    params = cfg.get("rope_parameters") or {}
    rope = params.get("sliding_attention")
    if isinstance(rope, dict):
        return {**rope, "rope_type": _rope_type(rope)}
    return {"rope_theta": cfg.get("rope_local_base_freq", 10000.0), "rope_type": "default"}


def _f32(value: Any) -> float:
    """A float as the GGUF of the same model stores it (float32), so both give one config."""
    return float(np.float32(float(value)))


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


def longrope_factors(cfg: dict[str, Any], which: str) -> np.ndarray | None:
    """Phi-3's ``long_factor`` or ``short_factor`` (``which``) as the tensor
    ``rope_factors_{which}`` the converter writes; None without LongRoPE."""
    rope = _rope(cfg)
    if rope["rope_type"] != "longrope" or not rope.get("long_factor"):
        return None
    return np.asarray(rope[f"{which}_factor"], dtype=np.float32)


def _head_dim(cfg: dict[str, Any]) -> int:
    return int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))


def _refuse_unmodelled(path: pathlib.Path, cfg: dict[str, Any], arch: str) -> None:
    want = _ACTIVATIONS.get(arch, "silu")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or want
    if act != want:
        raise ModelFileError(path, f"hidden_act {act!r} unsupported (supported: {want!r})")
    if arch in ("qwen2", "qwen3", "smollm3") and cfg.get("use_sliding_window"):
        raise ModelFileError(path, "sliding-window attention (use_sliding_window) unsupported")
    if arch != "qwen2" and cfg.get("attention_bias"):
        raise ModelFileError(path, "attention_bias (biases on q/k/v and o_proj) unsupported")
    if cfg.get("mlp_bias"):
        raise ModelFileError(path, "mlp_bias unsupported")
    kind = _rope(cfg)["rope_type"]
    if kind not in _ROPE_TYPES or (kind == "longrope" and arch != "phi3"):
        raise ModelFileError(
            path, f"RoPE scaling {kind!r} unsupported (supported: {', '.join(_ROPE_TYPES[:4])}"
            ", and longrope for Phi-3)",
        )  # fmt: skip
    if arch == "gemma3" and _window_rope(cfg)["rope_type"] != "default":
        raise ModelFileError(path, "scaled RoPE on Gemma 3's sliding-window layers unsupported")


def _nope_layers(cfg: dict[str, Any], config: ModelConfig) -> tuple[int, ...]:
    """SmolLM3's layers without RoPE as config.json lists them (``no_rope_layers``: 1 where
    a layer rotates, 0 where not; absent: every fourth, the architecture's step)."""
    flags = cfg.get("no_rope_layers") if config.arch == "smollm3" else None
    if flags is None:
        return config.nope_layers
    if len(flags) != config.n_layers:
        raise ValueError(f"no_rope_layers has {len(flags)} entries for {config.n_layers} layers")
    return tuple(i for i, rotates in enumerate(flags) if not rotates)


def _rope_keys(path: pathlib.Path, cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """``{arch}.rope.*``: the base, and the scaling as the converter writes it."""
    rope, key = _rope(cfg), f"{arch}.rope.scaling"
    keys: dict[str, Any] = {f"{arch}.rope.freq_base": _f32(rope["rope_theta"])}
    kind, factor = rope["rope_type"], _f32(rope.get("factor", 1.0))
    if kind == "linear":
        keys |= {f"{key}.type": "linear", f"{key}.factor": factor}
    elif kind == "yarn":
        unmodelled = [k for k in ("mscale", "mscale_all_dim") if rope.get(k)]
        if rope.get("truncate") is False:
            unmodelled.append("truncate")
        if unmodelled:
            raise ModelFileError(path, f"yarn RoPE with {', '.join(unmodelled)} unsupported")
        original = rope.get("original_max_position_embeddings") or cfg["max_position_embeddings"]
        keys |= {
            f"{key}.type": "yarn",
            f"{key}.factor": factor,
            f"{key}.original_context_length": int(original),
            f"{key}.yarn_beta_fast": _f32(rope.get("beta_fast") or 32.0),
            f"{key}.yarn_beta_slow": _f32(rope.get("beta_slow") or 1.0),
        }
        if rope.get("attention_factor") is not None:
            keys[f"{key}.yarn_attn_factor"] = _f32(rope["attention_factor"])
    elif kind == "llama3":
        llama3_rope_factors(cfg, _head_dim(cfg))  # its keys present and numbers
    if arch == "phi3":  # Phi3MiniModel: set_gguf_parameters, generate_extra_tensors
        original = int(
            rope.get("original_max_position_embeddings")
            or cfg.get("original_max_position_embeddings")
            or cfg["max_position_embeddings"]
        )
        keys[f"{key}.original_context_length"] = original
        if longrope_factors(cfg, "long") is not None:
            scale = int(cfg["max_position_embeddings"]) / original
            attn = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
            keys[f"{key}.attn_factor"] = _f32(attn)
    return keys


def _window_pattern(cfg: dict[str, Any], default: int) -> Any:
    """``attention.sliding_window_pattern``: a flag per layer from ``layer_types``,
    else the period (``sliding_window_pattern``, else the architecture's)."""
    types = cfg.get("layer_types")
    if isinstance(types, list) and types:
        return [t == "sliding_attention" for t in types]
    return int(cfg.get("sliding_window_pattern") or default)


def converter_keys(path: pathlib.Path, cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """The ``{arch}.*`` metadata ``convert_hf_to_gguf`` writes for ``cfg`` (at ``path``)."""
    a = arch
    n_heads = int(cfg["num_attention_heads"])
    head_dim = _head_dim(cfg)
    partial = float(cfg.get("partial_rotary_factor", _rope(cfg).get("partial_rotary_factor", 1.0)))
    default_context = 131072 if arch == "gemma3" else 2048
    keys: dict[str, Any] = {
        f"{a}.block_count": int(cfg["num_hidden_layers"]),
        f"{a}.context_length": int(cfg.get("max_position_embeddings") or default_context),
        f"{a}.embedding_length": int(cfg["hidden_size"]),
        f"{a}.feed_forward_length": int(cfg["intermediate_size"]),
        f"{a}.attention.head_count": n_heads,
        f"{a}.attention.head_count_kv": int(cfg.get("num_key_value_heads") or n_heads),
        f"{a}.attention.key_length": head_dim,
        f"{a}.attention.value_length": head_dim,
        f"{a}.attention.layer_norm_rms_epsilon": _f32(cfg.get("rms_norm_eps", 1e-6)),
        f"{a}.rope.dimension_count": int(partial * head_dim),
        **_rope_keys(path, cfg, arch),
    }
    window = int(cfg.get("sliding_window") or 0)
    if arch == "gemma2":  # Gemma2Model.set_gguf_parameters
        keys[f"{a}.attn_logit_softcapping"] = _f32(cfg.get("attn_logit_softcapping") or 0.0)
        keys[f"{a}.final_logit_softcapping"] = _f32(cfg.get("final_logit_softcapping") or 0.0)
        keys[f"{a}.attention.sliding_window"] = window
        keys[f"{a}.attention.sliding_window_pattern"] = _window_pattern(cfg, 2)
    elif arch == "gemma3":  # Gemma3Model.set_gguf_parameters
        keys[f"{a}.rope.freq_base_swa"] = _f32(_window_rope(cfg)["rope_theta"])
        keys[f"{a}.attn_logit_softcapping"] = _f32(cfg.get("attn_logit_softcapping") or 0.0)
        keys[f"{a}.final_logit_softcapping"] = _f32(cfg.get("final_logit_softcapping") or 0.0)
        pattern = _window_pattern(cfg, 6)
        keys[f"{a}.attention.sliding_window"] = 0 if pattern == 1 else window
        keys[f"{a}.attention.sliding_window_pattern"] = pattern
    elif arch == "phi3":
        keys[f"{a}.attention.sliding_window"] = window
    elif arch == "granite":  # GraniteModel.set_gguf_parameters: the multipliers given
        for key, name in _GRANITE_SCALES.items():
            if value := cfg.get(name):
                keys[f"{a}.{key}"] = _f32(value)
    return keys


# Granite's config.json multipliers and the keys its converter writes them as.
_GRANITE_SCALES = {
    "attention.scale": "attention_multiplier",
    "embedding_scale": "embedding_multiplier",
    "residual_scale": "residual_multiplier",
    "logit_scale": "logits_scaling",
}


class _ConverterKeys:
    """``converter_keys`` and a folder's tensors, read as ``config_from_gguf`` reads a
    GGUF file (``modelfile.config.Keys``)."""

    def __init__(self, path: pathlib.Path, keys: dict[str, Any],
                 has_tensor: Callable[[str], bool]) -> None:  # fmt: skip
        self.path, self._keys, self._has_tensor = path, keys, has_tensor

    def get(self, key: str, default: Any = None) -> Any:
        value = self._keys.get(key)
        return default if value is None else value

    def require(self, key: str) -> Any:
        value = self._keys.get(key)
        if value is None:
            raise ModelFileError(self.path, f"required key for {key!r} is missing")
        return value

    def has_tensor(self, name: str) -> bool:
        return self._has_tensor(name)


def vocab_rows(arch: str, cfg: dict[str, Any], n_tokens: int) -> int:
    """The embedding rows the model uses: config.json's ``vocab_size``, but Gemma 3's
    trimmed to its tokenizer's tokens, as its converter trims them (the rest are never
    a token)."""
    rows = int(cfg["vocab_size"])
    return min(rows, n_tokens) if arch == "gemma3" and n_tokens else rows


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
    has_tensor: Callable[[str], bool],
) -> ModelConfig:
    """``cfg`` (config.json, at ``path``), the tokenizer's facts and the folder's
    tensors (``has_tensor``, by GGUF name) as a ``ModelConfig``."""
    arch = hf_architecture(path, cfg)
    try:
        _refuse_unmodelled(path, cfg, arch)
        keys = converter_keys(path, cfg, arch)
        keys |= {
            "general.architecture": arch,
            "general.name": name,
            "tokenizer.ggml.eos_token_id": eos_id,
            "tokenizer.ggml.bos_token_id": bos_id,
            "tokenizer.ggml.add_bos_token": add_bos,
            f"{arch}.vocab_size": vocab_rows(arch, cfg, len(tokens)),
        }
        config = config_from_gguf(_ConverterKeys(path, keys, has_tensor), ())
        head_dim, scalar = config.head_dim, cfg.get("query_pre_attn_scalar")
        window = int(cfg.get("sliding_window") or 0)
        mistral_window = arch == "llama" and 0 < window < config.context_length
        return replace(
            config,
            eog_ids=derive_eog_ids(tokens, eos_id, extra_eog),
            rope_permuted=False,
            tied_embeddings=bool(cfg.get("tie_word_embeddings", arch in _GEMMA)),
            attn_scale=(
                float(scalar) ** -0.5
                if arch in _GEMMA and scalar is not None and scalar != head_dim
                else config.attn_scale
            ),
            sliding_window=window if mistral_window else config.sliding_window,
            window_layers=(
                tuple(range(config.n_layers)) if mistral_window else config.window_layers
            ),
            nope_layers=_nope_layers(cfg, config),
        )
    except KeyError as exc:
        raise ModelFileError(path, f"required key {exc.args[0]!r} is missing") from None
    except (TypeError, ValueError) as exc:
        raise ModelFileError(path, f"bad value: {exc}") from None
