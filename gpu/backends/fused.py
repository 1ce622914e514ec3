"""A step's decoder layers in one native call (``gpu/kernels/csrc/fused_trunk.c``).

With quantized weights on the CPU, a decode step at small batch spent about as long in
dispatch (some 20 torch ops and 5 ctypes calls a layer, 30 layers) as in its matmuls.
``FusedTrunk`` hands the whole trunk to C: the same q_linear and paged attention kernels
the torch path calls, with the norms, RoPE, the cache write and SwiGLU between them
written in C, and what other architectures add to the layer (sliding windows, soft
caps, GeGLU, post-norms, per-layer RoPE tables), as the model's spec says
(``modelfile/layer_spec.py``: the ``native`` backend's row). It applies
when every projection is a ``QuantLinear``, the cache is fp32
on the CPU with the native attention kernel (stored as fp32, fp16, q8_0 or q4_0: the C
code writes each new K/V row in the cache's element, q8_0 and q4_0 quantized once as it is
written);
every row of the step then attends as one query (``PagedKVCache.row_queries``: decodes
and prompt tokens alike, so a token's result does not depend on what else its step
holds, how its prompt was chunked or what the prefix cache held: docs/determinism.md). Anything else takes the torch path, unchanged.

The layer table (weight, norm and cache pointers) is built once per (model, cache);
a step passes its rows, positions and block tables.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch
from torch import Tensor

from gpu.cache.kv_cache import PagedKVCache
from gpu.kernels.native import NativeKernels
from gpu.model.decoder import LlamaWeights
from gpu.model.quant import QuantLinear
from modelfile.config import ModelConfig
from modelfile.layer_spec import ModelSpec, refusal

__all__ = ["FusedTrunk"]

_p, _i32 = ctypes.c_void_p, ctypes.c_int32
_ACT_SILU, _ACT_GELU_TANH = 0, 1  # fused_trunk.c's act
# the layer's fp32 vectors the C code reads in place (None: the architecture has none)
_FP32 = ("attn_norm", "ffn_norm", "bqkv", "q_norm", "k_norm", "post_attn_norm", "post_ffn_norm")


class _Layer(ctypes.Structure):
    """``trunk_layer`` in fused_trunk.c."""

    _fields_ = [
        ("attn_norm", _p), ("ffn_norm", _p),
        ("wqkv", _p), ("wo", _p), ("wgu", _p), ("wdown", _p),
        ("t_qkv", _i32), ("t_o", _i32), ("t_gu", _i32), ("t_down", _i32),
        ("kc", _p), ("vc", _p),
        ("bqkv", _p), ("q_norm", _p), ("k_norm", _p), ("post_attn_norm", _p), ("post_ffn_norm", _p),
        ("cos", _p), ("sin", _p),
        ("window", _i32), ("residual_scale", ctypes.c_float), ("qk_whole", _i32),
    ]  # fmt: skip


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class FusedTrunk:
    """The trunk of a step for one model on one cache."""

    def __init__(self, config: ModelConfig, spec: ModelSpec, layers: Sequence[LlamaWeights],
                 rope: Sequence[tuple[Tensor, Tensor] | None], cache: PagedKVCache,
                 kernels: NativeKernels) -> None:  # fmt: skip
        """``rope``: each layer's cos, sin tables ``[context, head_dim]`` fp32 (None: the
        layer rotates nothing)."""
        c = config
        self.kernels = kernels
        self.config = c
        self.rope = rope  # kept alive: the table points at them
        table = (_Layer * c.n_layers)()
        for i, layer in enumerate(layers):
            lins = (layer.qkv, layer.o, layer.gate_up, layer.down)
            assert all(isinstance(w, QuantLinear) for w in lins)
            qkv, o, gu, down = (w for w in lins if isinstance(w, QuantLinear))
            table[i] = _Layer(
                _ptr(layer.attn_norm), _ptr(layer.ffn_norm),
                qkv.ptr, o.ptr, gu.ptr, down.ptr, qkv.qtype, o.qtype, gu.qtype, down.qtype,
                cache.k[i].data_ptr(), cache.v[i].data_ptr(), _ptr(layer.bqkv),
                _ptr(layer.q_norm), _ptr(layer.k_norm), _ptr(layer.post_attn_norm),
                _ptr(layer.post_ffn_norm), *(_ptr(t) for t in rope[i] or (None, None)),
                spec.layers[i].window, spec.layers[i].residual_scale,
                int(spec.layers[i].qk_norm_whole),
            )  # fmt: skip
        self.table = table
        # one activation and one score cap for every layer (``refusal`` otherwise)
        self.act = _ACT_GELU_TANH if spec.layers[0].act == "gelu_tanh" else _ACT_SILU
        self.softcap = spec.layers[0].attn_softcap
        self.scale = cache.scale
        self.rows = cache.k.shape[2]
        self.block_size = cache.block_size
        kind = cache.kv_element.kind  # fp32 0, fp16 1, q8_0 2, q4_0 3 (paged_attention.c)
        assert kind is not None  # ``applies``
        self.kv_kind = kind

    @staticmethod
    def applies(
        config: ModelConfig, spec: ModelSpec, layers: Sequence[LlamaWeights], cache: object
    ) -> bool:
        """Whether these layers and attention backend can take the fused step at all: the
        native backend runs every feature of the model's spec (modelfile/layer_spec.py)."""
        if not isinstance(cache, PagedKVCache) or cache.kernels is None:
            return False
        if refusal("native", spec) is not None or config.head_dim > 512:
            return False
        if cache.dtype != torch.float32 or cache.kv_element.kind is None:
            return False
        return all(
            isinstance(w, QuantLinear)
            for layer in layers
            for w in (layer.qkv, layer.o, layer.gate_up, layer.down)
        ) and all(
            n.dtype == torch.float32 and n.is_contiguous() and n.device.type == "cpu"
            for layer in layers
            for n in (getattr(layer, name) for name in _FP32)
            if n is not None
        )

    def __call__(self, x: Tensor, positions: Tensor, slots: Tensor, tables: Tensor,
                 lens: Tensor) -> Tensor:  # fmt: skip
        """The last layer's output ``[T, hidden]`` for embedded rows ``x [T, hidden]``."""
        c = self.config
        x = x.to(torch.float32).contiguous()  # a fresh tensor (the embedding's): written in place
        positions = positions.to(torch.int64).contiguous()
        slots, tables, lens = slots.contiguous(), tables.contiguous(), lens.contiguous()
        rc = self.kernels.trunk_layers(
            x.data_ptr(), x.shape[0], positions.data_ptr(), ctypes.addressof(self.table),
            c.n_layers, c.hidden, c.ffn, c.n_heads, c.n_kv_heads, c.head_dim, c.rms_eps,
            slots.data_ptr(), tables.data_ptr(), lens.data_ptr(), tables.shape[1], self.rows,
            self.block_size, self.kv_kind, self.scale, self.act, self.softcap,
            torch.get_num_threads(),
        )  # fmt: skip
        if rc == -1:
            raise MemoryError("trunk_layers: scratch allocation failed")
        if rc != 0:
            raise ValueError(f"trunk_layers refused the step ({rc})")
        return x
