"""The decoder in plain torch: RMSNorm, RoPE (rotate-half), GQA, SwiGLU, and what the
other architectures add to Llama's layer, as the model's spec says layer by layer
(``modelfile/layer_spec.py``, never the family): q/k/v biases (Qwen2), per-head q/k RMSNorm
(Qwen3), scaled RoPE frequencies (``gpu/model/rope.py``: linear, yarn, Llama 3's factors,
Phi-3's LongRoPE), norms after attention and MLP, GeGLU, capped logits (Gemma),
sliding-window layers (the attention backend's).

Weights arrive in the HF layout (a llama file's q/k rows un-permuted by the loader,
``gpu.model.rope.unpermute_rope_rows``), so RoPE is the rotate-half form. Attention goes
through an ``AttentionBackend`` that owns the KV cache; the model itself is stateless
between steps.

Per-step op count matters on CPU (~2 us of dispatch per op, 30 layers), hence fused
QKV and gate/up projections, one ``addcmul`` for RoPE on q and k together, and a
precomputed cos/sin table indexed once per step.

Every projection and the LM head is a ``PackedLinear`` (``gpu/model/linear.py``) or, where
the loader keeps the GGUF's quantized blocks (``gpu/model/quant.py``), a ``QuantLinear``:
one copy of each weight, no fp32 shadow. Under ``--tp`` (a ``ShardPlan``,
``gpu/model/shard.py``) the decoder holds one rank's heads, MLP slice and vocabulary rows,
through the parallel linears of ``gpu/model/linear.py``.
"""

from __future__ import annotations

from types import ModuleType
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gpu.kernels.native import NativeKernels, load_kernels
from gpu.model.linear import PackedLinear, RowParallelLinear, VocabParallelHead, vocab_parallel_rows
from gpu.model.quant import QuantLinear, QuantWeight
from gpu.model.rope import rope_inv_freq, rope_tables
from gpu.model.shard import ShardPlan
from modelfile.config import ModelConfig
from modelfile.layer_spec import spec_of

__all__ = ["AttentionBackend", "Linear", "Llama", "LlamaWeights", "Ops", "PackedLinear"]

# The fused Triton kernels a torch-path step launches (``--kernels triton``:
# ``gpu/kernels/triton_ops.py``), or None: torch's own ops. RoPE through them needs a
# power-of-two head.
Ops = ModuleType | None


class AttentionBackend(Protocol):
    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Store k/v, return causal attention output ``[T, n_heads, head_dim]``.

        q ``[T, n_heads, head_dim]``, k/v ``[T, n_kv_heads, head_dim]`` (RoPE applied);
        T is every token of the step, sequences laid out as the backend was told.
        """
        ...


Linear = PackedLinear | QuantLinear


def _kernels() -> NativeKernels:
    kernels = load_kernels()
    if kernels is None:
        raise RuntimeError("quantized weights need the native CPU kernels (LIFECYCLE_NATIVE=0?)")
    return kernels


class LlamaWeights(nn.Module):
    """One decoder layer's parameters, in the HF layout, q/k/v and gate/up fused. Each
    projection is an fp32 matrix (a parameter) or a ``QuantWeight`` (its blocks a buffer
    under the same name). ``attn_norm`` / ``ffn_norm`` (RMSNorm before attention and
    MLP: OLMo 2 has none), ``bqkv`` (the q/k/v biases, joined), ``q_norm`` / ``k_norm``
    (RMSNorm weights ``[head_dim]`` per head, or over the whole projection: OLMo 2's) and
    ``post_attn_norm`` / ``post_ffn_norm`` (RMSNorm of the attention's and the MLP's
    outputs before their residual adds, ``[hidden]``: Gemma 2/3, OLMo 2) are None where
    the architecture has none."""

    wqkv: Tensor
    wo: Tensor
    w_gate_up: Tensor
    w_down: Tensor

    def __init__(
        self,
        attn_norm: Tensor | None,
        wqkv: Tensor | QuantWeight | list[QuantWeight],
        wo: Tensor | QuantWeight | list[QuantWeight],
        ffn_norm: Tensor | None,
        w_gate_up: Tensor | QuantWeight | list[QuantWeight],
        w_down: Tensor | QuantWeight | list[QuantWeight],
        bqkv: Tensor | None = None,
        q_norm: Tensor | None = None,
        k_norm: Tensor | None = None,
        post_attn_norm: Tensor | None = None,
        post_ffn_norm: Tensor | None = None,
        reduce: bool = False,
    ) -> None:
        """``reduce``: a tensor-parallel rank's, whose o and down hold its columns only
        (``RowParallelLinear``)."""
        super().__init__()
        self.attn_norm, self.ffn_norm = _param(attn_norm), _param(ffn_norm)
        self.bqkv, self.q_norm, self.k_norm = _param(bqkv), _param(q_norm), _param(k_norm)
        self.post_attn_norm, self.post_ffn_norm = _param(post_attn_norm), _param(post_ffn_norm)
        self.qkv = self._linear("wqkv", wqkv)
        self.o = self._linear("wo", wo, reduce)
        self.gate_up = self._linear("w_gate_up", w_gate_up)
        self.down = self._linear("w_down", w_down, reduce)

    def _linear(
        self, name: str, w: Tensor | QuantWeight | list[QuantWeight], reduce: bool = False
    ) -> Linear:
        if isinstance(w, QuantWeight | list):
            lin = QuantLinear(w, _kernels())
            for i, blocks in enumerate(lin.blocks):  # one per part: each read where it lies
                self.register_buffer(name if i == 0 else f"{name}_{i}", blocks, persistent=False)
            return lin
        setattr(self, name, nn.Parameter(w, requires_grad=False))
        return (RowParallelLinear if reduce else PackedLinear)(getattr(self, name))


class Llama(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        embed: Tensor | QuantWeight,
        layers: list[LlamaWeights],
        norm: Tensor,
        lm_head: Tensor | QuantWeight | None = None,
        rope_freqs: Tensor | None = None,
        plan: ShardPlan | None = None,
    ) -> None:
        """``plan``: a tensor-parallel rank's (``config`` its own heads and MLP width,
        ``embed`` and ``lm_head`` its vocabulary rows); None at world 1."""
        super().__init__()
        self.config = config
        self.plan = plan
        # Quantized, the embedding looks rows up in its blocks (``embed`` is then the
        # uint8 blocks buffer; ``embed_q`` says how to read them).
        self.embed_q = embed if isinstance(embed, QuantWeight) else None
        if isinstance(embed, QuantWeight):
            self.register_buffer("embed", embed.blocks, persistent=False)
        else:
            self.embed = nn.Parameter(embed, requires_grad=False)
        self.layers = nn.ModuleList(layers)
        self._weights = list(layers)  # the same, without ModuleList's indexing per call
        self.norm = nn.Parameter(norm, requires_grad=False)
        # Tied embeddings share the tensor: no second 49152x576 copy.
        if lm_head is None:
            self.lm_head = self.embed
        elif isinstance(lm_head, QuantWeight):
            self.register_buffer("lm_head", lm_head.blocks, persistent=False)
        else:
            self.lm_head = nn.Parameter(lm_head, requires_grad=False)
        self.head = _head(embed if lm_head is None else lm_head, self.lm_head, plan, config)
        device = self.embed.device
        # What every layer computes (modelfile/layer_spec.py): the torch path reads it here.
        self.spec = spec = spec_of(config)
        # The spec's RoPE tables (cos, sin) ``[context, head_dim]`` fp32: the first with
        # the file's scaling; another (Gemma 3's windowed layers) its own base, unscaled.
        self._rope: list[tuple[Tensor, Tensor]] = []
        for theta, scaled in spec.rope_tables:
            scaling = (config.rope_scaling, rope_freqs) if scaled else ()
            inv_freq, attention = rope_inv_freq(config.head_dim, theta, *scaling)
            self._rope.append(rope_tables(inv_freq, config.context_length, attention, device))
        # Gemma's sqrt(hidden), rounded to the compute dtype as transformers rounds it
        # (``Gemma2TextScaledWordEmbedding``: the scale cast to the weights' dtype).
        dtype = torch.float32 if isinstance(embed, QuantWeight) else embed.dtype
        self.embed_scale: Tensor | None = None
        if spec.embed_scale != 1.0:
            self.embed_scale = torch.tensor(spec.embed_scale, dtype=dtype, device=device)
        self._qk_dim = (config.n_heads + config.n_kv_heads) * config.head_dim
        self._shape = (config.hidden,)
        # The native kernels the quantized linears hold (None without any): the final
        # norm, the softcap and the embedding's lookups use the same, looked up once.
        self._native = next(
            (lin.kernels for lin in self.linears() if isinstance(lin, QuantLinear)), None
        )

    def weight_bytes(self) -> int:
        """Bytes of every tensor the model holds for its weights, each byte counted once:
        the parameters and buffers, and the extra copies the linear layers keep (a packed
        or interleaved fp32 copy, quantized blocks). A contiguous tensor counts its own
        bytes (packed weights are carved side by side from shared chunks, whose unused
        tails are never touched: ``gpu/kernels/arena.py``), another its whole storage."""
        tensors = [*self.parameters(), *self.buffers()]
        for lin in self.linears():
            for name in (n for cls in type(lin).__mro__ for n in getattr(cls, "__slots__", ())):
                value = getattr(lin, name, None)
                for t in value if isinstance(value, tuple) else (value,):
                    if isinstance(t, Tensor):
                        tensors.append(t)
        opaque: dict[int, int] = {}
        spans: list[tuple[int, int]] = []
        for t in tensors:
            if t.layout == torch._mkldnn:  # type: ignore[attr-defined]  # opaque: no storage
                opaque[id(t)] = t.numel() * t.element_size()
            elif t.is_contiguous():  # its bytes (packed weights share arena chunks)
                spans.append((t.data_ptr(), t.data_ptr() + t.nbytes))
            else:
                st = t.untyped_storage()
                spans.append((st.data_ptr(), st.data_ptr() + st.nbytes()))
        return sum(opaque.values()) + _union_bytes(spans)

    def quantized(self) -> bool:
        """Whether any weight is kept as quantized blocks."""
        return self._native is not None

    def linears(self) -> list[Linear]:
        """Every projection of the model, the LM head last."""
        return [*(lin for w in self._weights for lin in (w.qkv, w.o, w.gate_up, w.down)), self.head]

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        attn: AttentionBackend,
        logits_indices: Tensor | None = None,
        return_hidden: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Logits (fp32) ``[K, vocab]`` for rows ``logits_indices`` (all rows if None),
        through the torch ops; the LM head, the model's largest matmul, runs on those only."""
        return self.logits(self.trunk(input_ids, positions, attn), logits_indices, return_hidden)

    def trunk(
        self, input_ids: Tensor, positions: Tensor, attn: AttentionBackend, ops: Ops = None
    ) -> Tensor:
        """Every row's last-layer output ``[T, hidden]``, before the final norm, through
        the torch ops or the fused Triton kernels ``ops`` (the runner's choice, made once:
        ``gpu/runtime/runner.py``, which also chooses the native fused trunk where it applies)."""
        return self.run_layers(self.embed_rows(input_ids), positions, attn, ops)

    def embed_rows(self, input_ids: Tensor) -> Tensor:
        """The embedded rows ``[T, hidden]`` the first layer reads."""
        if self.embed_q is not None:
            x = self.embed_q.rows(input_ids, self._native)
        elif self.plan is not None:
            x = vocab_parallel_rows(self.embed, input_ids, self.plan.vocab)
        else:
            x = F.embedding(input_ids, self.embed)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        return x

    def run_layers(
        self, x: Tensor, positions: Tensor, attn: AttentionBackend, ops: Ops = None
    ) -> Tensor:
        """The torch path's layers over embedded rows ``x``."""
        rope = self.rope_rows(positions, x.dtype)
        for i in range(len(self.layers)):
            q, k, v = self.attention_in(i, x, rope[i], ops)
            x = self.attention_out(i, x, attn(i, q, k, v), ops)
        return x

    def rope_rows(
        self, positions: Tensor, dtype: torch.dtype
    ) -> list[tuple[Tensor, Tensor] | None]:
        """Each layer's RoPE (cos, sin) ``[T, 1, head_dim]`` at ``positions`` (None: the
        layer rotates nothing); layers that share a table share its rows. The tables stay
        fp32 (as HF computes them) and are cast once per step, not per layer."""
        rows = [
            (cos[positions].unsqueeze(1).to(dtype), sin[positions].unsqueeze(1).to(dtype))
            for cos, sin in self._rope
        ]
        return [None if t is None else rows[t] for t in self.spec.rope_of]

    def rope_table(self, layer: int) -> tuple[Tensor, Tensor] | None:
        """Layer ``layer``'s RoPE tables (cos, sin) ``[context, head_dim]`` fp32; None
        where it rotates nothing."""
        t = self.spec.layers[layer].rope_table
        return None if t is None else self._rope[t]

    def final_norm(self, x: Tensor) -> Tensor:
        """The final hidden state of trunk rows ``x``: what the LM head reads (embeddings).
        With quantized weights the native norm, as the fused trunk's: torch's reduction
        order may change with the CPU's vector width (docs/determinism.md)."""
        native = self._native
        if (
            native is not None
            and x.dtype == torch.float32
            and x.device.type == "cpu"
            and x.dim() == 2
        ):
            return native.rms_norm(x, self.norm, self.config.rms_eps)
        return F.rms_norm(x, self._shape, self.norm, self.config.rms_eps)

    def logits(
        self, x: Tensor, logits_indices: Tensor | None = None, return_hidden: bool = False
    ) -> Tensor | tuple[Tensor, Tensor]:
        if logits_indices is not None:
            x = x[logits_indices]
        h = self.final_norm(x)
        logits = self.head(h).float()
        if self.spec.logit_scale != 1.0:  # Granite: the logits divided by its scale
            logits = logits / self.spec.logit_scale
        if cap := self.spec.final_softcap:  # Gemma 2: cap * tanh(logits / cap)
            native = self._native
            if native is not None and logits.device.type == "cpu" and logits.is_contiguous():
                logits = native.softcap(logits, cap)  # the same bits on every CPU
            else:
                logits = torch.tanh(logits / cap) * cap
        return (logits, h) if return_hidden else logits

    def attention_in(
        self, i: int, x: Tensor, rope: tuple[Tensor, Tensor] | None, ops: Ops = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Layer ``i`` up to its attention: the queries, keys and values of rows ``x``
        rotated by ``rope`` (cos, sin ``[T, 1, head_dim]``; None: no rotation). A piecewise
        step captures it (``gpu/backends/piecewise.py``)."""
        c, ls = self.config, self.spec.layers[i]
        w = self._weights[i]
        t = x.shape[0]
        if not ls.pre_norms:  # OLMo 2: the projections read the rows as they are
            h = x
        elif ops is not None:
            h = ops.rms_norm(x, w.attn_norm, c.rms_eps)
        else:
            h = F.rms_norm(x, self._shape, w.attn_norm, c.rms_eps)
        qkv = w.qkv(h)
        if ls.qkv_bias:
            qkv = qkv + _given(w.bqkv)
        qk = qkv[:, : self._qk_dim]
        if not ls.qk_norm_whole:
            qk = qk.view(t, c.n_heads + c.n_kv_heads, c.head_dim)
        if ls.qk_norm:  # per head, or over all of q's rows and all of k's (OLMo 2)
            at = c.n_heads if qk.dim() == 3 else c.n_heads * c.head_dim
            q, k = qk[:, :at], qk[:, at:]
            q = F.rms_norm(q, q.shape[-1:], _given(w.q_norm), c.rms_eps)
            k = F.rms_norm(k, k.shape[-1:], _given(w.k_norm), c.rms_eps)
            qk = torch.cat((q, k), dim=1)
        if ls.qk_norm_whole:
            qk = qk.view(t, c.n_heads + c.n_kv_heads, c.head_dim)
        if rope is None:  # a layer without RoPE (SmolLM3's every fourth)
            pass
        elif ops is not None and c.head_dim & (c.head_dim - 1) == 0:
            qk = ops.rope(qk, *rope)
        else:
            cos, sin = rope
            qk = torch.addcmul(qk * cos, qk.roll(c.head_dim // 2, -1), sin)
        v = qkv[:, self._qk_dim :].view(t, c.n_kv_heads, c.head_dim)
        return qk[:, : c.n_heads], qk[:, c.n_heads :], v

    def attention_out(self, i: int, x: Tensor, o: Tensor, ops: Ops = None) -> Tensor:
        """Layer ``i`` from its attention's output ``o`` on: the rows the next layer reads."""
        c, ls = self.config, self.spec.layers[i]
        w = self._weights[i]
        y = w.o(o.reshape(x.shape[0], c.n_heads * c.head_dim))
        if ls.post_norms:
            y = F.rms_norm(y, self._shape, _given(w.post_attn_norm), c.rms_eps)
        if ls.residual_scale != 1.0:  # Granite's residual multiplier
            y = y * ls.residual_scale
        gelu = ls.act == "gelu_tanh"
        if ops is not None and ls.pre_norms:
            x, h = ops.add_rms_norm(x, y, w.ffn_norm, c.rms_eps)
        else:
            x = x + y
            h = F.rms_norm(x, self._shape, w.ffn_norm, c.rms_eps) if ls.pre_norms else x
        if ops is not None:
            y = w.down(ops.gated(w.gate_up(h), gelu))
        else:
            gate, up = w.gate_up(h).chunk(2, dim=-1)
            y = w.down((F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up)
        if ls.post_norms:
            y = F.rms_norm(y, self._shape, _given(w.post_ffn_norm), c.rms_eps)
        if ls.residual_scale != 1.0:
            y = y * ls.residual_scale
        return x + y


def _head(w: Tensor | QuantWeight, lm_head: Tensor, plan: ShardPlan | None,
          config: ModelConfig) -> Linear:  # fmt: skip
    """The LM head: ``w``'s quantized blocks, or over the parameter ``lm_head``."""
    if isinstance(w, QuantWeight):
        return QuantLinear(w, _kernels())
    if plan is not None:
        return VocabParallelHead(lm_head, plan.rank, plan.world, config.vocab_size)
    return PackedLinear(lm_head)


def _union_bytes(spans: list[tuple[int, int]]) -> int:
    """Bytes covered by the address ranges ``[start, end)``, overlaps counted once."""
    total, reach = 0, 0
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _param(t: Tensor | None) -> nn.Parameter | None:
    """An optional weight as a frozen parameter (inference only)."""
    return None if t is None else nn.Parameter(t, requires_grad=False)


def _given(t: Tensor | None) -> Tensor:
    """A weight the layer's spec names (the loader builds each one the spec names)."""
    assert t is not None, "the layer's spec names a weight the loader did not build"
    return t
