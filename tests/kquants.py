"""Simple quantizers for the k-quant types gguf-py reads but cannot write (Q4_K, Q5_K,
Q6_K), and a Q4_K_M-style type plan, so tests can build files laid out as llama.cpp's
``llama-quantize`` lays them out.

These are not llama.cpp's quantizers (which search for the best scales): each sub-block
takes its range's scale and offset, rounded to the type's 6-bit (Q4_K, Q5_K) or int8
(Q6_K) sub-block scales. The bytes follow ggml's block layouts (``block_q4_K``,
``block_q5_K``, ``block_q6_K``), which gguf-py's dequantizer reads back; the tests
compare our kernels with that dequantization, not with these values.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

__all__ = ["KQUANT_TYPES", "q4_k_m_type", "quantize_any"]

KQUANT_TYPES = frozenset({Q.Q4_K, Q.Q5_K, Q.Q6_K})


def _f16(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).view(np.uint8).reshape(*v.shape, 2)


def _scale_min_bytes(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """ggml's 12 bytes of eight 6-bit (scale, min) pairs (the inverse of get_scale_min_k4)."""
    out = np.zeros((*sc.shape[:-1], 12), dtype=np.uint8)
    for j in range(4):
        out[..., j] = (sc[..., j] & 63) | ((sc[..., j + 4] >> 4) << 6)
        out[..., j + 4] = (m[..., j] & 63) | ((m[..., j + 4] >> 4) << 6)
        out[..., j + 8] = (sc[..., j + 4] & 15) | ((m[..., j + 4] & 15) << 4)
    return out


def _q45_k(x: np.ndarray, bits: int) -> np.ndarray:
    """Q4_K (bits 4) or Q5_K (bits 5) blocks of rows ``x [n, k]``, k % 256 == 0."""
    n, k = x.shape
    top = (1 << bits) - 1
    sub = x.reshape(n, k // 256, 8, 32).astype(np.float64)
    lo = np.minimum(sub.min(-1), 0.0)
    scale = (sub.max(-1) - lo) / top
    mins = -lo
    d = np.maximum(scale.max(-1, keepdims=True) / 63, 1e-8).astype(np.float16).astype(np.float64)
    dmin = np.maximum(mins.max(-1, keepdims=True) / 63, 1e-8).astype(np.float16)
    dmin = dmin.astype(np.float64)
    sc = np.clip(np.rint(scale / d), 1, 63).astype(np.uint8)
    m = np.clip(np.rint(mins / dmin), 0, 63).astype(np.uint8)
    q = np.rint((sub + (dmin * m)[..., None]) / (d * sc)[..., None])
    q = np.clip(q, 0, top).astype(np.uint8).reshape(n, k // 256, 256)
    qs = np.zeros((n, k // 256, 128), dtype=np.uint8)
    qh = np.zeros((n, k // 256, 32), dtype=np.uint8)
    for j in range(4):
        a, c = q[..., 64 * j : 64 * j + 32], q[..., 64 * j + 32 : 64 * j + 64]
        qs[..., 32 * j : 32 * j + 32] = (a & 15) | ((c & 15) << 4)
        qh |= ((a >> 4) << (2 * j)) | ((c >> 4) << (2 * j + 1))
    parts = [_f16(d[..., 0]), _f16(dmin[..., 0]), _scale_min_bytes(sc, m)]
    parts += [qh, qs] if bits == 5 else [qs]
    return np.concatenate(parts, axis=-1).reshape(n, -1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    """Q6_K blocks of rows ``x [n, k]``, k % 256 == 0: sixteen int8 scales per 256."""
    n, k = x.shape
    sub = x.reshape(n, k // 256, 16, 16).astype(np.float64)
    scale = np.abs(sub).max(-1) / 31
    d = np.maximum(scale.max(-1, keepdims=True) / 127, 1e-8).astype(np.float16)
    d = d.astype(np.float64)
    sc = np.clip(np.rint(scale / d), 1, 127).astype(np.int8)
    q = np.clip(np.rint(sub / (d * sc)[..., None]), -32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(n, k // 256, 256)
    ql = np.zeros((n, k // 256, 128), dtype=np.uint8)
    qh = np.zeros((n, k // 256, 64), dtype=np.uint8)
    for h in range(2):
        e = q[..., 128 * h : 128 * h + 128]
        q1, q2, q3, q4 = e[..., 0:32], e[..., 32:64], e[..., 64:96], e[..., 96:128]
        ql[..., 64 * h : 64 * h + 32] = (q1 & 15) | ((q3 & 15) << 4)
        ql[..., 64 * h + 32 : 64 * h + 64] = (q2 & 15) | ((q4 & 15) << 4)
        qh[..., 32 * h : 32 * h + 32] = (
            (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6)
        )
    parts = [ql, qh, sc.view(np.uint8), _f16(d[..., 0])]
    return np.concatenate(parts, axis=-1).reshape(n, -1)


def quantize_any(x: np.ndarray, qtype: Q) -> np.ndarray:
    """Blocks of ``x [n, k]`` in ``qtype``: gguf-py's quantizer, or the ones above."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if qtype == Q.Q4_K:
        return _q45_k(x, 4)
    if qtype == Q.Q5_K:
        return _q45_k(x, 5)
    if qtype == Q.Q6_K:
        return _q6_k(x)
    return quantize(x, qtype)


def q4_k_m_type(name: str, k: int, layer: int | None, n_layers: int, tied: bool) -> Q:
    """The type ``llama-quantize`` gives a matrix in a Q4_K_M file (llama_tensor_get_type,
    simplified to what a dense model has): Q6_K for the output (the embedding when tied), for
    attn_v and ffn_down in the first and last eighth of the layers and every third
    between; Q4_K otherwise. Rows that are not a whole number of 256 take the fallback
    llama.cpp takes: Q5_0 for Q4_K, Q8_0 for Q6_K."""
    more = layer is not None and (
        layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2
    )
    if name == "output.weight" or (name == "token_embd.weight" and tied):
        want = Q.Q6_K
    elif (".attn_v." in name or ".ffn_down." in name) and more:
        want = Q.Q6_K
    else:
        want = Q.Q4_K
    if k % 256:
        return Q.Q5_0 if want == Q.Q4_K else Q.Q8_0
    return want
