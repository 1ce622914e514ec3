"""The model's row-wise ops and paged decode attention as Triton kernels, fewer launches
than the torch ops they replace (``--kernels triton``; docs/worker.md, "Fused kernels").

On a GPU a small model's step is bound by launches and by the GPU's own per-kernel
latency, even replayed from a CUDA graph: a layer of the torch path is about twenty
kernels. Each of these runs as one what the torch path runs as several: ``add_rms_norm``
(two, or three with the add), ``rope`` (four), ``gated`` (SwiGLU, or Gemma's GeGLU) and
``paged_decode`` (the gather, two products, the softmax and the copies: eight, and a
gathered copy of the context; here the blocks are read in place, with an online softmax).

Each computes in fp32 and stores in the input's dtype. ``TRITON_INTERPRET=1`` runs them
on CPU tensors (Triton's interpreter): the tests check them against the torch ops
without a GPU (tests/test_triton_ops.py), and on a GPU compiled. Importing this module
needs Triton: ``gpu/kernels/kernel_choice.py`` imports it when ``--kernels triton`` asks.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

__all__ = ["add_rms_norm", "gated", "paged_decode", "rms_norm", "rope"]


def _pow2(n: int) -> int:
    return int(triton.next_power_of_2(n))


# -- RMSNorm, with the residual add ------------------------------------------------------
@triton.jit
def _rms_norm_kernel(x_ptr, y_ptr, w_ptr, sum_ptr, out_ptr, n, eps,
                     HAS_Y: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = cols < n
    x = tl.load(x_ptr + row * n + cols, mask=m, other=0.0).to(tl.float32)
    if HAS_Y:
        x += tl.load(y_ptr + row * n + cols, mask=m, other=0.0).to(tl.float32)
        x = x.to(sum_ptr.dtype.element_ty)  # the residual as the torch path rounds it
        tl.store(sum_ptr + row * n + cols, x, mask=m)
        x = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n + cols, (x * inv * w).to(out_ptr.dtype.element_ty), mask=m)


def rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """``F.rms_norm(x, (H,), w, eps)`` of rows ``x [T, H]``."""
    x = x.contiguous()
    out = x.new_empty(x.shape)
    n = x.shape[-1]
    _rms_norm_kernel[(x.numel() // n,)](x, x, w, x, out, n, eps, HAS_Y=False, BLOCK=_pow2(n))
    return out


def add_rms_norm(x: Tensor, y: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``(s, F.rms_norm(s, (H,), w, eps))`` with ``s = x + y``, rows ``[T, H]``."""
    x, y = x.contiguous(), y.contiguous()
    s, out = x.new_empty(x.shape), x.new_empty(x.shape)
    n = x.shape[-1]
    _rms_norm_kernel[(x.numel() // n,)](x, y, w, s, out, n, eps, HAS_Y=True, BLOCK=_pow2(n))
    return s, out


# -- RoPE --------------------------------------------------------------------------------
@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, heads, row_stride, head_stride,
                 HD: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.arange(0, HD)
    src = x_ptr + row * row_stride + head * head_stride
    x = tl.load(src + d).to(tl.float32)
    rolled = tl.load(src + (d + HD // 2) % HD).to(tl.float32)
    c = tl.load(cos_ptr + row * HD + d).to(tl.float32)
    s = tl.load(sin_ptr + row * HD + d).to(tl.float32)
    dst = out_ptr + (row * heads + head) * HD + d
    tl.store(dst, (x * c + rolled * s).to(out_ptr.dtype.element_ty))


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``torch.addcmul(x * cos, x.roll(hd // 2, -1), sin)`` for ``x [T, heads, hd]`` (rows
    and heads strided, the last dimension contiguous: a view of the qkv projection) and
    ``cos``, ``sin`` ``[T, 1, hd]`` contiguous; a contiguous ``[T, heads, hd]``."""
    t, heads, hd = x.shape
    if x.stride(2) != 1 or hd != _pow2(hd):
        raise ValueError("rope needs a contiguous last dimension of a power of two")
    out = x.new_empty((t, heads, hd))
    _rope_kernel[(t, heads)](x, cos, sin, out, heads, x.stride(0), x.stride(1), HD=hd)
    return out


# -- SwiGLU / GeGLU ----------------------------------------------------------------------
@triton.jit
def _gated_kernel(gu_ptr, out_ptr, inner, GELU: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < inner
    g = tl.load(gu_ptr + row * 2 * inner + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * inner + inner + cols, mask=m, other=0.0).to(tl.float32)
    if GELU:  # 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), tanh z = 2 sigmoid(2z) - 1
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = g * (1.0 / (1.0 + tl.exp(-2.0 * z)))
    else:  # silu
        a = g / (1.0 + tl.exp(-g))
    tl.store(out_ptr + row * inner + cols, (a * u).to(out_ptr.dtype.element_ty), mask=m)


def gated(gate_up: Tensor, gelu: bool = False) -> Tensor:
    """``act(gate) * up`` of ``gate_up [T, 2I]`` (gate first): ``[T, I]``."""
    gate_up = gate_up.contiguous()
    t, two = gate_up.shape
    inner = two // 2
    out = gate_up.new_empty((t, inner))
    block = min(1024, _pow2(inner))
    _gated_kernel[(t, triton.cdiv(inner, block))](gate_up, out, inner, GELU=gelu, BLOCK=block)
    return out


# -- paged decode attention --------------------------------------------------------------
_NO_WINDOW = 1 << 30  # a window wider than any context: every key of the sequence


@triton.jit
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr,
                         nb, kv_rows, scale, softcap, window,
                         G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr,
                         BS: tl.constexpr, CAP: tl.constexpr):  # fmt: skip
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    n_kv = tl.num_programs(1)
    g = tl.arange(0, GP)
    d = tl.arange(0, HD)
    r = tl.arange(0, BS)
    gm = g < G
    heads = n_kv * G
    # q [D, heads, HD]: this kv head's G query heads
    q_off = (seq * heads + kvh * G + g)[:, None] * HD + d[None, :]
    q = tl.load(q_ptr + q_off, mask=gm[:, None], other=0.0).to(tl.float32)
    length = tl.load(lens_ptr + seq)
    lo = length - 1 - window  # keys at or below lo are outside the window
    m_i = tl.full((GP,), float("-inf"), tl.float32)
    l_i = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, HD), tl.float32)
    base = kvh.to(tl.int64) * kv_rows  # the cache [n_kv, rows, HD], one layer
    for b in range(0, nb):
        pos = b * BS + r
        valid = (pos < length) & (pos > lo)
        block = tl.load(tables_ptr + seq * nb + b).to(tl.int64)
        rows = block * BS + r
        kv_off = (base + rows)[:, None] * HD + d[None, :]
        k = tl.load(k_ptr + kv_off, mask=valid[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_ptr + kv_off, mask=valid[:, None], other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GP, BS]
        if CAP:
            s = softcap * (2.0 / (1.0 + tl.exp(-2.0 * s / softcap)) - 1.0)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + q_off, out.to(out_ptr.dtype.element_ty), mask=gm[:, None])


def paged_decode(q: Tensor, kc: Tensor, vc: Tensor, tables: Tensor, lens: Tensor,
                 block_size: int, scale: float, window: int = 0, softcap: float = 0.0,
                 ) -> Tensor:  # fmt: skip
    """Decode attention of ``q [D, heads, hd]`` (one query per sequence) over one layer's
    cache ``kc``, ``vc`` ``[n_kv, rows, hd]``: sequence ``i`` reads the first
    ``lens[i]`` keys of its blocks ``tables[i]`` (``[D, nb]`` int32, padded with any
    block past its length), the last ``window`` of them when ``window`` > 0; scores
    capped as ``softcap * tanh(s / softcap)`` when ``softcap`` > 0. ``[D, heads, hd]``."""
    d, heads, hd = q.shape
    n_kv = kc.shape[0]
    if hd != _pow2(hd) or not (kc.is_contiguous() and vc.is_contiguous()):
        raise ValueError("paged_decode needs a contiguous cache and a power-of-two head")
    q = q.contiguous()
    g = heads // n_kv
    out = q.new_empty(q.shape)
    nb = tables.shape[1]
    _paged_decode_kernel[(d, n_kv)](
        q, kc, vc, tables, lens, out, nb, kc.shape[1], scale, softcap or 1.0,
        window if window > 0 else _NO_WINDOW,
        G=g, GP=_pow2(g), HD=hd, BS=block_size, CAP=bool(softcap),
    )  # fmt: skip
    return out
