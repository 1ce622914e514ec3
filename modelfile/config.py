"""The model configuration, read from GGUF metadata.

One decoder (``gpu/model/decoder.py``) serves every architecture named here; an architecture
is the few ways it differs from Llama, read from the file's keys and tensors:

- ``llama`` (Llama 1-3, Mistral, SmolLM): q/k rows permuted by the converter for
  llama.cpp's adjacent-pair RoPE (the loader undoes it); optional q/k/v biases; Llama
  3.x's ``rope_freqs`` tensor (the ``llama3`` scaling, as per-frequency divisors).
- ``qwen2``: q/k/v biases; rotate-half RoPE as stored (no permutation).
- ``qwen3``: per-head RMSNorm of q and k before RoPE (``attn_q_norm`` / ``attn_k_norm``).
- ``phi3``: q/k/v in one tensor (``attn_qkv``) and gate/up in one (``ffn_up``, gate
  first); LongRoPE (``rope_factors_long`` / ``rope_factors_short`` and
  ``rope.scaling.attn_factor``); a sliding window on every layer when
  ``attention.sliding_window`` is set (transformers' reading; llama.cpp ignores it).
- ``gemma2``: embeddings times sqrt(hidden); GeGLU (GELU's tanh form) for SwiGLU;
  RMSNorm of the attention's and the MLP's outputs (``post_attention_norm``,
  ``post_ffw_norm``); attention scores and final logits soft-capped
  (``attn_logit_softcapping``, ``final_logit_softcapping``); every other layer (the
  even ones) attends within ``attention.sliding_window`` keys. The converter has already
  added Gemma's 1 to the norm weights.
- ``gemma3`` (text): Gemma 2's layer with per-head q/k norms and no caps; five layers
  in six windowed, which rotate with their own RoPE base (``rope.freq_base_swa``,
  10000 when absent) and no scaling, the others with ``rope.freq_base`` and the file's
  scaling (linear 8 for the 4B to 27B models).
- ``granite``: Llama's layer (q/k rows permuted as Llama's) with four multipliers the file
  stores: ``embedding_scale`` (the embeddings), ``attention.scale`` (the query scale),
  ``residual_scale`` (the attention's and the MLP's outputs before their residual adds)
  and ``logit_scale`` (the logits divided by it).
- ``olmo2``: no norm before attention or MLP, an RMSNorm of each one's output instead
  (``post_attention_norm``, ``post_ffw_norm``: the files have no ``attn_norm`` or
  ``ffn_norm``); RMSNorm of q and k over the whole projection (``attn_q_norm`` of
  heads x head size), not per head; rotate-half RoPE as stored.
- ``smollm3``: Llama's layer (q/k rows permuted as Llama's), but every fourth layer
  (3, 7, ...) rotates nothing: no RoPE on its q and k (llama.cpp's
  ``n_no_rope_layer_step``, which no key stores).

What a file stores decides the rest, whatever its architecture: fused or separate
q/k/v and gate/up tensors, biases, q/k norms, post-norms. What it does not say is the
architecture's row of ``ARCHITECTURES`` (llama.cpp's per-architecture facts). RoPE
scaling from ``{arch}.rope.scaling.*``: ``linear`` and ``yarn`` (transformers'
definitions, ``gpu.model.rope.rope_inv_freq``).
"""

from __future__ import annotations

import math
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np

from modelfile.gguf_meta import ModelFileError

__all__ = [
    "ARCHITECTURES",
    "SUPPORTED_ARCHITECTURES",
    "Architecture",
    "Keys",
    "ModelConfig",
    "RopeScaling",
    "config_from_gguf",
    "derive_eog_ids",
    "with_context",
]


class Keys(Protocol):
    """What ``config_from_gguf`` reads: a GGUF file's metadata (``GGUFMetadata``), or
    the keys and tensors the converter would write for a Hugging Face folder
    (``modelfile/hf_config.py``)."""

    path: pathlib.Path

    def get(self, key: str, default: Any = None) -> Any: ...

    def require(self, key: str) -> Any: ...

    def has_tensor(self, name: str) -> bool: ...


@dataclass(frozen=True, slots=True)
class Architecture:
    """What an architecture's files leave unsaid (llama.cpp's ``src/models/<arch>.cpp``);
    everything else is read from the file's keys and tensors. The defaults are Llama's
    layer in a file that stores HF's rotate-half q/k rows."""

    # The converter permutes q/k rows for llama.cpp's adjacent-pair RoPE
    # (convert_hf_to_gguf.py, LlamaModel.permute); the loader undoes it.
    rope_permuted: bool = False
    act: str = "silu"  # the MLP gate's activation: "silu" or "gelu_tanh" (GeGLU)
    embed_scale: bool = False  # embeddings times sqrt(hidden), rounded to fp32
    # Which layers ``attention.sliding_window`` applies to: layer i when i % n < n - 1
    # (llama.cpp's pattern n; 0: every layer), unless the file's
    # ``attention.sliding_window_pattern`` says otherwise; None: the key is not read.
    window_pattern: int | None = None
    window_default: int = 0  # the window when the file has no key
    attn_softcap: float = 0.0  # {arch}.attn_logit_softcapping when absent (0: uncapped)
    final_softcap: float = 0.0  # {arch}.final_logit_softcapping when absent
    # Query scale 1/sqrt(hidden / heads) at these layer counts (Gemma's 27B models, as
    # llama.cpp recognises them), else 1/sqrt(head size).
    hidden_scale_layers: frozenset[int] = frozenset()
    # The windowed layers' RoPE base when the file has no ``rope.freq_base_swa`` (they
    # then rotate unscaled); None: they share the other layers' tables.
    window_rope_base: float | None = None
    # Layer i rotates nothing when (i + 1) % n == 0 (SmolLM3: 4); 0: every layer rotates.
    no_rope_step: int = 0
    # q/k norms over the whole projection (OLMo 2), not per head (Qwen3, Gemma 3).
    qk_norm_whole: bool = False


ARCHITECTURES = {
    "llama": Architecture(rope_permuted=True),
    "qwen2": Architecture(),
    "qwen3": Architecture(),
    "phi3": Architecture(window_pattern=0),
    "gemma2": Architecture(
        act="gelu_tanh",
        embed_scale=True,
        window_pattern=2,
        window_default=4096,
        attn_softcap=50.0,
        final_softcap=30.0,
        hidden_scale_layers=frozenset({46}),
    ),
    "gemma3": Architecture(
        act="gelu_tanh",
        embed_scale=True,
        window_pattern=6,
        hidden_scale_layers=frozenset({62}),
        window_rope_base=10000.0,
    ),
    "smollm3": Architecture(rope_permuted=True, no_rope_step=4),
    "granite": Architecture(rope_permuted=True),
    "olmo2": Architecture(qk_norm_whole=True),
}
SUPPORTED_ARCHITECTURES = frozenset(ARCHITECTURES)
_ROPE_SCALINGS = ("none", "linear", "yarn")

# Token texts llama.cpp (src/llama-vocab.cpp) treats as end-of-generation whatever their
# role, plus the FIM "pad"/"repo"/"sep" texts it auto-detects and also adds to its EOG set.
# SmolLM2's `<reponame>` (id 4) is in llama.cpp's EOG set for this reason; `<repo_name>`
# (id 3) and `<file_sep>` (id 5) are not, as measured with llama_vocab_is_eog.
_EOG_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<｜end▁of▁sentence｜>",
    }
)
_FIM_EOG_TEXTS = frozenset(
    {
        # fim pad
        "<|fim_pad|>",
        "<fim-pad>",
        "<fim_pad>",
        "<PAD>",
        # fim repo
        "<|fim_repo|>",
        "<|repo_name|>",
        "<fim-repo>",
        "<REPO>",
        "<reponame>",
        # fim file separator
        "<|file_sep|>",
    }
)
_EOG_ID_KEYS = (
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
    "tokenizer.ggml.fim_pad_token_id",
    "tokenizer.ggml.fim_rep_token_id",
    "tokenizer.ggml.fim_sep_token_id",
)


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """``{arch}.rope.scaling.*``: ``kind`` none, linear (positions / factor), yarn
    (frequencies blended between interpolation and extrapolation, cos/sin scaled) or
    longrope (Phi-3: per-frequency factors from the file's ``rope_factors_long`` tensor
    when the served context exceeds ``original_context``, else ``rope_factors_short``;
    cos/sin times ``attn_factor``)."""

    kind: str = "none"
    factor: float = 1.0
    original_context: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attn_factor: float | None = None  # yarn: None is 0.1 ln(factor) + 1; longrope: 1

    def long_factors(self, context: int) -> bool:
        """longrope: whether a context of ``context`` tokens reads the long factors
        (llama.cpp's rule: the context exceeds the original one)."""
        return self.kind == "longrope" and context > self.original_context


@dataclass(frozen=True, slots=True)
class ModelConfig:
    arch: str
    n_layers: int
    hidden: int
    ffn: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    context_length: int
    vocab_size: int
    tied_embeddings: bool
    bos_id: int | None
    eos_id: int
    eog_ids: tuple[int, ...]
    add_bos: bool
    name: str
    # What an architecture changes (module docstring); the defaults are Llama's.
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_permuted: bool = True
    rope_scaling: RopeScaling = RopeScaling()
    rope_freq_factors: bool = False  # a rope_freqs tensor divides the frequencies
    fused_qkv: bool = False  # attn_qkv holds q, k and v (Phi-3)
    fused_gate_up: bool = False  # ffn_up holds gate then up, no ffn_gate (Phi-3)
    sliding_window: int = 0  # keys a windowed layer attends to, its own included
    window_layers: tuple[int, ...] = ()  # the layers with the window
    act: str = "silu"  # the MLP gate's activation: silu (SwiGLU) or gelu_tanh (GeGLU)
    embed_scale: float = 1.0  # embeddings times this (Gemma: sqrt(hidden) in fp32)
    attn_scale: float | None = None  # the query scale; None: 1/sqrt(head_dim)
    attn_softcap: float = 0.0  # attention scores capped at +-this (cap tanh(s / cap))
    final_softcap: float = 0.0  # the logits capped the same way
    post_norms: bool = False  # RMSNorm of the attention's and the MLP's outputs
    # The windowed layers' RoPE base, unscaled (Gemma 3's local layers); None: theirs
    # are the other layers' tables.
    window_rope_theta: float | None = None
    nope_layers: tuple[int, ...] = ()  # the layers that rotate nothing (SmolLM3's)
    # Each layer's attention and MLP outputs times this before their residual adds, and
    # the logits divided by ``logit_scale`` (Granite's ``residual_scale`` and ``logit_scale``)
    residual_scale: float = 1.0
    logit_scale: float = 1.0
    pre_norms: bool = True  # RMSNorm before attention and MLP (OLMo 2 has none)
    qk_norm_whole: bool = False  # q/k norms over the whole projection, not per head

    def window(self, layer: int) -> int:
        """Layer ``layer``'s attention window in keys (its own key included); 0: none."""
        return self.sliding_window if layer in self.window_layers else 0

    @property
    def query_scale(self) -> float:
        """What attention scores are multiplied by before the softmax."""
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5


def derive_eog_ids(
    tokens: Sequence[str], eos_id: int, extra_ids: Sequence[int] = ()
) -> tuple[int, ...]:
    """End-of-generation ids, mirroring llama.cpp's text-based auto-detection.

    ``extra_ids`` are ids the file names explicitly (eot, eom, fim pad/rep/sep).
    """
    eog = {eos_id, *extra_ids}
    for i, text in enumerate(tokens):
        if text in _EOG_TEXTS or text in _FIM_EOG_TEXTS:
            eog.add(i)
    return tuple(sorted(i for i in eog if 0 <= i < len(tokens)))


def config_from_gguf(f: Keys, tokens: Sequence[str]) -> ModelConfig:
    """Read the hyper-parameters; refuse what the model cannot run."""
    arch = f.require("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelFileError(
            f.path,
            f"unsupported architecture {arch!r} (supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})",
        )
    hidden = int(f.require(f"{arch}.embedding_length"))
    n_heads = int(f.require(f"{arch}.attention.head_count"))
    n_kv_heads = int(f.get(f"{arch}.attention.head_count_kv", n_heads))
    head_dim = int(f.get(f"{arch}.attention.key_length", hidden // n_heads))
    _check_shape_support(f, arch, n_heads, n_kv_heads, head_dim)
    vocab_size = len(tokens) or int(f.require(f"{arch}.vocab_size"))
    eos_id = int(f.require("tokenizer.ggml.eos_token_id"))
    bos = f.get("tokenizer.ggml.bos_token_id")
    extra = [int(v) for k in _EOG_ID_KEYS if (v := f.get(k)) is not None]
    n_layers = int(f.require(f"{arch}.block_count"))
    a = ARCHITECTURES[arch]
    window, window_layers = _sliding_window(f, arch, a, n_layers)
    return ModelConfig(
        arch=arch,
        n_layers=n_layers,
        hidden=hidden,
        ffn=int(f.require(f"{arch}.feed_forward_length")),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        rope_theta=float(f.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_eps=float(f.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        context_length=int(f.get(f"{arch}.context_length", 2048)),
        vocab_size=vocab_size,
        tied_embeddings=not f.has_tensor("output.weight"),
        bos_id=None if bos is None else int(bos),
        eos_id=eos_id,
        eog_ids=derive_eog_ids(tokens, eos_id, extra),
        add_bos=bool(f.get("tokenizer.ggml.add_bos_token", False)),
        name=str(f.get("general.name", f.path.stem)),
        qkv_bias=f.has_tensor("blk.0.attn_q.bias"),
        qk_norm=f.has_tensor("blk.0.attn_q_norm.weight"),
        rope_permuted=a.rope_permuted,
        rope_scaling=_rope_scaling(f, arch),
        rope_freq_factors=f.has_tensor("rope_freqs.weight"),
        fused_qkv=f.has_tensor("blk.0.attn_qkv.weight"),
        fused_gate_up=not f.has_tensor("blk.0.ffn_gate.weight")
        and f.has_tensor("blk.0.ffn_up.weight"),
        sliding_window=window,
        window_layers=window_layers,
        act=a.act,
        embed_scale=_scale(f, f"{arch}.embedding_scale")
        or (float(np.float32(math.sqrt(hidden))) if a.embed_scale else 1.0),
        attn_scale=_scale(f, f"{arch}.attention.scale")
        or ((hidden / n_heads) ** -0.5 if n_layers in a.hidden_scale_layers else None),
        attn_softcap=float(f.get(f"{arch}.attn_logit_softcapping", a.attn_softcap) or 0.0),
        final_softcap=float(f.get(f"{arch}.final_logit_softcapping", a.final_softcap) or 0.0),
        post_norms=f.has_tensor("blk.0.post_attention_norm.weight"),
        window_rope_theta=_window_rope_theta(f, arch, a) if window_layers else None,
        residual_scale=_scale(f, f"{arch}.residual_scale") or 1.0,
        pre_norms=f.has_tensor("blk.0.attn_norm.weight"),
        qk_norm_whole=a.qk_norm_whole and f.has_tensor("blk.0.attn_q_norm.weight"),
        logit_scale=_scale(f, f"{arch}.logit_scale") or 1.0,
        nope_layers=tuple(
            i for i in range(n_layers) if a.no_rope_step and (i + 1) % a.no_rope_step == 0
        ),
    )


def _scale(f: Keys, key: str) -> float | None:
    """A multiplier the file stores (Granite's), or None where it has none (0 is none,
    as llama.cpp reads it)."""
    value = f.get(key)
    return float(value) if value else None


def _window_rope_theta(f: Keys, arch: str, a: Architecture) -> float | None:
    theta = f.get(f"{arch}.rope.freq_base_swa", a.window_rope_base)
    return None if theta is None else float(theta)


def _sliding_window(f: Keys, arch: str, a: Architecture,
                    n_layers: int) -> tuple[int, tuple[int, ...]]:  # fmt: skip
    """``attention.sliding_window`` and the layers it applies to (none: ``(0, ())``):
    llama.cpp's ``load_swa_pattern``, the file's ``attention.sliding_window_pattern``
    (a period, or a flag per layer) over the architecture's."""
    if a.window_pattern is None:
        return 0, ()
    window = int(f.get(f"{arch}.attention.sliding_window", a.window_default) or 0)
    if window <= 0:
        return 0, ()
    pattern = f.get(f"{arch}.attention.sliding_window_pattern", a.window_pattern)
    if isinstance(pattern, list):
        if len(pattern) < n_layers:
            raise ModelFileError(
                f.path, f"{arch}.attention.sliding_window_pattern has {len(pattern)} of "
                f"{n_layers} layers",
            )  # fmt: skip
        return window, tuple(i for i in range(n_layers) if pattern[i])
    n = int(pattern)
    return window, tuple(i for i in range(n_layers) if n == 0 or i % n < n - 1)


def _rope_scaling(f: Keys, arch: str) -> RopeScaling:
    key = f"{arch}.rope.scaling"
    if f.has_tensor("rope_factors_long.weight"):  # Phi-3's LongRoPE: no scaling.type key
        attn = f.get(f"{key}.attn_factor")
        return RopeScaling(
            kind="longrope",
            original_context=int(f.require(f"{key}.original_context_length")),
            attn_factor=None if attn is None else float(attn),
        )
    kind = str(f.get(f"{key}.type", "none"))
    if kind not in _ROPE_SCALINGS:
        raise ModelFileError(
            f.path,
            f"{key}.type {kind!r} unsupported (supported: {', '.join(_ROPE_SCALINGS)})",
        )
    factor = float(f.get(f"{key}.factor", 1.0))
    if kind == "none" or factor == 1.0:
        return RopeScaling()
    if factor <= 0:
        raise ModelFileError(f.path, f"{key}.factor must be positive, got {factor}")
    attn = f.get(f"{key}.yarn_attn_factor")
    return RopeScaling(
        kind=kind,
        factor=factor,
        original_context=int(f.get(f"{key}.original_context_length", 0)),
        beta_fast=float(f.get(f"{key}.yarn_beta_fast", 32.0)),
        beta_slow=float(f.get(f"{key}.yarn_beta_slow", 1.0)),
        attn_factor=None if attn is None else float(attn),
    )


def _check_shape_support(f: Keys, arch: str, n_heads: int, n_kv_heads: int, head_dim: int) -> None:
    if n_heads % n_kv_heads:
        raise ModelFileError(f.path, f"{n_heads} heads not divisible by {n_kv_heads} kv heads")
    rope_dims = int(f.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ModelFileError(f.path, f"partial rotary ({rope_dims} of {head_dim} dims) unsupported")
    if f.has_tensor("blk.0.attn_q_norm.weight") != f.has_tensor("blk.0.attn_k_norm.weight"):
        raise ModelFileError(f.path, "attn_q_norm without attn_k_norm (or the reverse)")


def with_context(config: ModelConfig, context: int | None, path: str = "") -> ModelConfig:
    """``config`` serving ``context`` tokens (``--context-length``; None: the model's own).
    Lower is always allowed; higher only with RoPE scaling in the file (linear, yarn or
    Llama 3's factors), which is what lets positions past the trained context make
    sense. Raises ``ModelFileError`` otherwise."""
    if context is None or context == config.context_length:
        return config
    if context < 1:
        raise ModelFileError(path, f"--context-length must be positive, got {context}")
    scaled = config.rope_scaling.kind != "none" or config.rope_freq_factors
    if context > config.context_length and not scaled:
        raise ModelFileError(
            path,
            f"--context-length {context} exceeds the model's {config.context_length} tokens "
            "and the file has no RoPE scaling to stretch it",
        )
    return replace(config, context_length=context)
