"""What a model computes, layer by layer: the one description every backend reads.

``ModelSpec.of(config)`` turns the model's configuration (``modelfile/config.py``: the
file's keys and its architecture's row) into what each layer does: its attention window,
its RoPE table (or none), its q/k norms and biases, its norms after attention and MLP,
its activation, its score cap and query scale, and the model's embedding scale and
final cap. The backends (the torch path ``gpu/model/decoder.py``, the native fused trunk
``gpu/backends/fused.py``, the paged attention ``gpu/cache/kv_cache.py`` and its C and Triton kernels,
the torch path over a tensor-parallel shard ``gpu/model/shard.py``) read the spec and never
the family.

``BACKENDS`` says which backend runs which of the spec's features. A new operation is a
feature here, a field of the spec, and one function per backend that runs it; a backend
that does not is left out of the feature's row, and ``refusal`` names it: the fused
trunk then gives way to the torch path (it is chosen only where it applies), and a
backend asked for by an option (``--kernels triton``, ``--tp``) is refused at start,
before the server listens.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from modelfile.config import ModelConfig

__all__ = ["BACKENDS", "FEATURES", "LayerSpec", "ModelSpec", "refusal", "spec_of"]

# Each feature a model's layers may use beyond Llama's, in words.
FEATURES: dict[str, str] = {
    "qkv_bias": "biases on the q/k/v projections",
    "qk_norm": "per-head RMSNorm of q and k",
    "qk_norm_whole": "RMSNorm of q and k over the whole projection",
    "no_pre_norms": "layers without a norm before attention and MLP",
    "post_norms": "RMSNorm of the attention's and the MLP's outputs",
    "gelu_tanh": "GeGLU (GELU's tanh form) in the MLP",
    "sliding_window": "sliding-window attention",
    "window_rope": "windowed layers with RoPE tables of their own",
    "nope_layers": "layers without RoPE",
    "attn_softcap": "soft-capped attention scores",
    "final_softcap": "soft-capped logits",
    "embed_scale": "scaled embeddings",
    "residual_scale": "scaled residual branches",
    "logit_scale": "scaled logits",
    # What the backends take once for every layer (their kernels' arguments), when the
    # layers differ: no backend runs these today.
    "layer_activations": "layers of different activations",
    "layer_attention": "layers of different query scales or score caps",
    "layer_windows": "layers of different window widths",
}

# Which backend runs which feature. ``torch``: the model's torch path (gpu/model/decoder.py);
# ``native``: the fused trunk (gpu/backends/fused.py, gpu/kernels/csrc/fused_trunk.c) and the CPU's paged
# attention kernel; ``triton``: the fused Triton kernels (gpu/kernels/triton_ops.py); ``tp``:
# a tensor-parallel shard (gpu/model/shard.py, linear.py); ``graphs``: captured steps (gpu/backends/graphs.py,
# gpu/backends/piecewise.py), which replay the torch path.
_ALL = frozenset(FEATURES) - {"layer_activations", "layer_attention", "layer_windows"}
BACKENDS: dict[str, frozenset[str]] = {
    "torch": _ALL,
    "native": _ALL,
    "triton": _ALL,
    # a shard holds some of the heads: a norm over the whole projection sums over all
    "tp": _ALL - {"qk_norm_whole"},
    "graphs": _ALL,
}


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """One decoder layer: what it computes around its attention and MLP."""

    window: int  # keys it attends to, its own included; 0: every key
    rope_table: int | None  # the model's RoPE table it rotates q and k with; None: none
    qkv_bias: bool
    qk_norm: bool  # RMSNorm of q and k before RoPE: per head, or
    qk_norm_whole: bool  # over the whole projection (OLMo 2)
    pre_norms: bool  # RMSNorm before attention and MLP (OLMo 2: none)
    post_norms: bool  # RMSNorm of the attention's and the MLP's outputs
    act: str  # the MLP gate's activation: silu (SwiGLU) or gelu_tanh (GeGLU)
    attn_softcap: float  # scores capped at +-this (cap tanh(s / cap)); 0: uncapped
    query_scale: float  # what scores are multiplied by before the softmax
    # The same scale as SDPA is given it: None where it is SDPA's own 1/sqrt(head_dim)
    # (SDPA computes that value itself, to its own last bit).
    sdpa_scale: float | None
    residual_scale: float  # the attention's and the MLP's outputs times this (1.0: none)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Every layer's spec, and what comes before and after the layers."""

    layers: tuple[LayerSpec, ...]
    embed_scale: float  # embeddings times this (1.0: none)
    final_softcap: float  # logits capped the same way (0: uncapped)
    logit_scale: float  # logits divided by this (1.0: none)
    # The RoPE tables, by index: (base, scaled by the file's rope scaling)
    rope_tables: tuple[tuple[float, bool], ...]

    @classmethod
    def of(cls, c: ModelConfig) -> ModelSpec:
        tables = [(c.rope_theta, True)]
        if c.window_rope_theta is not None:  # Gemma 3's windowed layers: their own, unscaled
            tables.append((c.window_rope_theta, False))
        layers = tuple(
            LayerSpec(
                window=c.window(i),
                rope_table=None if i in c.nope_layers else int(len(tables) > 1 and c.window(i) > 0),
                qkv_bias=c.qkv_bias,
                qk_norm=c.qk_norm,
                qk_norm_whole=c.qk_norm_whole,
                pre_norms=c.pre_norms,
                post_norms=c.post_norms,
                act=c.act,
                attn_softcap=c.attn_softcap,
                query_scale=c.query_scale,
                sdpa_scale=c.attn_scale,
                residual_scale=c.residual_scale,
            )
            for i in range(c.n_layers)
        )
        return cls(layers, c.embed_scale, c.final_softcap, c.logit_scale, tuple(tables))

    @property
    def features(self) -> frozenset[str]:
        """The features of ``FEATURES`` the model uses."""
        used = {
            name
            for layer in self.layers
            for name, on in (
                ("qkv_bias", layer.qkv_bias),
                ("qk_norm", layer.qk_norm and not layer.qk_norm_whole),
                ("qk_norm_whole", layer.qk_norm_whole),
                ("no_pre_norms", not layer.pre_norms),
                ("post_norms", layer.post_norms),
                ("gelu_tanh", layer.act == "gelu_tanh"),
                ("sliding_window", layer.window > 0),
                ("window_rope", bool(layer.rope_table)),
                ("nope_layers", layer.rope_table is None),
                ("residual_scale", layer.residual_scale != 1.0),
                ("attn_softcap", layer.attn_softcap > 0),
            )
            if on
        }
        if len({layer.act for layer in self.layers}) > 1:
            used.add("layer_activations")
        if len({(layer.query_scale, layer.attn_softcap) for layer in self.layers}) > 1:
            used.add("layer_attention")
        if len({w for w in self.windows if w}) > 1:
            used.add("layer_windows")
        if self.final_softcap:
            used.add("final_softcap")
        if self.embed_scale != 1.0:
            used.add("embed_scale")
        if self.logit_scale != 1.0:
            used.add("logit_scale")
        return frozenset(used)

    @property
    def rope_of(self) -> tuple[int | None, ...]:
        """Each layer's RoPE table (None: it rotates nothing)."""
        return tuple(layer.rope_table for layer in self.layers)

    @property
    def windows(self) -> tuple[int, ...]:
        """Each layer's attention window (0: none)."""
        return tuple(layer.window for layer in self.layers)

    @property
    def widest_window(self) -> int:
        """The largest window of any layer (0: no layer has one)."""
        return max(self.windows, default=0)


@cache
def spec_of(config: ModelConfig) -> ModelSpec:
    """``ModelSpec.of(config)``, made once per configuration."""
    return ModelSpec.of(config)


def refusal(backend: str, spec: ModelSpec) -> str | None:
    """Why ``backend`` cannot run a model of ``spec``, naming the backend and the first
    feature it lacks; None when it runs every one the model uses."""
    missing = sorted(spec.features - BACKENDS[backend])
    if not missing:
        return None
    f = missing[0]
    return f"the {backend} backend does not run {FEATURES[f]} ({f}), which this model uses"
