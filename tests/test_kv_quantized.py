"""The quantized KV caches, q8_0 and q4_0 (``--kv-cache-dtype q8_0`` / ``q4_0``, issue 59,
point 2): llama.cpp's block_q8_0 (an fp16 scale, 32 int8: 34 bytes) and block_q4_0 (an
fp16 scale, 16 bytes of 4-bit values: 18 bytes) per 32 values of a K or V row, each row
rotated first (``kv_rotate``: the Walsh-Hadamard matrix over groups of the largest power of
two dividing head_dim) and written once by the kernels' one writer (``kv_store``) on the
fused trunk and the torch path alike, read in place by the native attention kernel as
``q * d`` and ``(q - 8) * d`` with the query rotated and the output rotated back. Both are
held as uint8 tensors: the element (``KV_Q8``, ``KV_Q4``) says which, decided where the
cache is built; a bare uint8 is refused.

Each quantizer is held to a numpy transcription of llama.cpp's ``quantize_row_q8_0_ref``
/ ``quantize_row_q4_0_ref`` byte for byte (ties, zeros, the signed maximum, extremes:
one test each); the rotation is Sylvester's Hadamard matrix and its own inverse within
its derived bound, and a stored row is the rotated row quantized. The rest is the same
test for both elements, parametrized (ids ``q8_0``, ``q4_0``): every build quantizes and
stores to the same bytes; the attention over a quantized cache equals the same kernel over
an fp32 cache of the blocks' values with the query rotated and the output rotated back
(bit for bit) and an fp64 reference within a derived bound, and unnamed uint8 rows are
refused; every build of the kernels runs a mixed step to the same bits; an engine on the
bundled model gives the same greedy tokens alone, batched, after a prefix-cache hit and
chunked; the torch path (fp32 weights) stores the writer's rows and attends to their
values, and the worker serves it; the disk tier carries the blocks' bytes, refused by
every other element; the refusals name where the native kernels do not read it; the
capacity in tokens follows 34 (q8_0) or 18 (q4_0) bytes per 32 values.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from gpu.cache.blocks import block_hash
from gpu.cache.disk import DiskLayout, DiskPrefixCache
from gpu.cache.kv_cache import (
    PagedKVCache,
    PrefillChunk,
    kv_dtype_refusal,
    kv_storage_dtype,
    kv_value_bytes,
)
from gpu.cache.memory import kv_bytes_per_token
from gpu.kernels import native, native_build
from gpu.kernels.native import KV_Q4, KV_Q8, KVElement, kv_element, kv_row_width
from gpu.model.loader import LoadedModel, load_model
from gpu.runtime.engine import Engine, EngineConfig
from gpu.worker.config import WorkerConfig, build_engine, kv_blocks_for
from tests.engine_runs import run_to_end
from tests.test_determinism import _SCRIPT as _MIXED_STEP
from tests.test_determinism import _TORCH_LEVEL
from tests.test_worker_engine import GREEDY, ids_of, prompts, run
from tests.tiny_gguf import TinyModel, TinySpec, write_tiny_gguf
from wire.worker_options import KV_CACHE_DTYPES, refused_combination

pytestmark = pytest.mark.skipif(
    native.load_kernels() is None, reason="q8_0 and q4_0 caches are read by the native kernels only"
)
EPS = 2.0**-24  # fp32's unit roundoff
ROOT = Path(__file__).resolve().parent.parent
ELEMENTS = [pytest.param(KV_Q8, id="q8_0"), pytest.param(KV_Q4, id="q4_0")]
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18}  # bytes of 32 values, written out (not the element's)


def _kernels() -> native.NativeKernels:
    k = native.load_kernels()
    assert k is not None
    return k


def _quantize(
    kern: native.NativeKernels, elem: KVElement
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The kernels' quantizer of ``elem``: ``kv_q8_quantize`` or ``kv_q4_quantize``."""
    return {"q8_0": kern.kv_q8_quantize, "q4_0": kern.kv_q4_quantize}[elem.name]


# -- the quantizers --------------------------------------------------------------------------
def q8_reference(x: np.ndarray) -> np.ndarray:
    """llama.cpp's ``quantize_row_q8_0_ref`` over the last axis of fp32 ``x``, as bytes
    ``[..., n / 32 * 34]``: amax = max |x|; d = amax / 127 (fp32); id = 1 / d (0 for d 0);
    q = roundf(x * id) (half away from zero: floor(|y| + 0.5) in fp64, exact, with y's
    sign); d stored as fp16, rounded to nearest even."""
    blocks = x.astype(np.float32).reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    y = (blocks * inv).astype(np.float64)  # the fp32 product, exactly
    q = (np.sign(y) * np.floor(np.abs(y) + 0.5)).astype(np.int8)
    out = np.concatenate([d.astype(np.float16).view(np.uint8), q.view(np.uint8)], -1)
    return out.reshape(*x.shape[:-1], -1)


def q8_dequantize(b: np.ndarray) -> np.ndarray:
    """The values a q8_0 row's bytes stand for: q * d, in fp32 (exact)."""
    blocks = np.ascontiguousarray(b).reshape(*b.shape[:-1], -1, 34)
    d = blocks[..., :2].copy().view(np.float16).astype(np.float32)
    q = blocks[..., 2:].copy().view(np.int8).astype(np.float32)
    return (q * d).reshape(*b.shape[:-1], -1)


def q4_reference(x: np.ndarray) -> np.ndarray:
    """llama.cpp's ``quantize_row_q4_0_ref`` over the last axis of fp32 ``x``, as bytes
    ``[..., n / 32 * 18]``: max = the value of the largest |x| (the first of equals; 0.0
    when every |x| is 0, as its loop starts); d = max / -8 (fp32); id = 1 / d (0 for d 0);
    q = MIN(15, (int8_t)(x * id + 8.5f)), the product and the sum each rounded to fp32
    (the truncation of y in [0, 16], clamped; y infinite or NaN, where id overflowed,
    gives 0, as x86's conversion does); byte j = q[j] | q[j + 16] << 4; d as fp16,
    rounded to nearest even."""
    blocks = x.astype(np.float32).reshape(*x.shape[:-1], -1, 32)
    mag = np.abs(blocks)
    first = np.take_along_axis(blocks, mag.argmax(-1)[..., None], -1)
    mx = np.where(mag.max(-1, keepdims=True) > 0, first, np.float32(0)).astype(np.float32)
    d = (mx / np.float32(-8)).astype(np.float32)
    with np.errstate(all="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
        y = (blocks * inv).astype(np.float32) + np.float32(8.5)
        ok = np.isfinite(y) & (y >= 0)
        q = np.where(ok, np.minimum(15, np.trunc(np.where(ok, y, 0))), 0).astype(np.uint8)
        d16 = d.astype(np.float16)  # above fp16's range: an infinity
    packed = q[..., :16] | (q[..., 16:] << 4)
    out = np.concatenate([d16.view(np.uint8), packed], -1)
    return out.reshape(*x.shape[:-1], -1)


def q4_dequantize(b: np.ndarray) -> np.ndarray:
    """The values a q4_0 row's bytes stand for: (q - 8) * d, in fp32 (exact)."""
    blocks = np.ascontiguousarray(b).reshape(*b.shape[:-1], -1, 18)
    d = blocks[..., :2].copy().view(np.float16).astype(np.float32)
    qs = blocks[..., 2:]
    q = np.concatenate([qs & 0x0F, qs >> 4], -1).astype(np.float32) - 8
    return (q * d).reshape(*b.shape[:-1], -1)


DEQUANTIZE = {"q8_0": q8_dequantize, "q4_0": q4_dequantize}


def _q8_awkward_rows() -> torch.Tensor:
    g = torch.Generator().manual_seed(59)
    x = torch.randn(40, 128, generator=g) * torch.logspace(-6, 3, 40)[:, None]
    x[0] = 0.0  # d = 0: every q 0
    x[1, :32] = torch.arange(-16, 16) + 0.5  # amax 16.5: ties appear after scaling
    x[1, 32:64] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.5] + [0.0] * 26)  # d = 1: x * id = x
    x[2, :32] = 1e-30  # d rounds to an fp16 zero, id from the fp32 d: q = 127
    x[3, :32] = 7e5  # d above fp16's range: stored as infinity, as llama.cpp does
    return x


def _q4_awkward_rows() -> torch.Tensor:
    g = torch.Generator().manual_seed(40)
    x = torch.randn(40, 128, generator=g) * torch.logspace(-6, 3, 40)[:, None]
    x[0] = 0.0  # every |x| 0: max stays +0, d = 0 / -8 = -0 (stored 0x8000), every q 8
    x[0, 64:96] = -0.0  # ... whatever the zeros' signs
    # max -8: d = 1, id = 1, y = x + 8.5: ties of the truncation land on whole numbers
    x[1, :32] = torch.tensor([-8.0, 0.5, -0.5, 1.5, 7.5, 6.9, -7.5, 0.49] + [0.25] * 24)
    x[1, 32:64] = torch.tensor([3.0, -3.0] + [1.0] * 30)  # equal |x|: the first's sign, 3
    x[1, 64:96] = torch.tensor([-3.0, 3.0] + [1.0] * 30)  # ... here -3: d flips its sign
    x[1, 96:128] = torch.tensor([1.0] * 31 + [-2.0])  # the largest last
    x[2, :32] = 1e-30  # d rounds to an fp16 zero, id from the fp32 d: q from it
    x[2, 32:64] = 1e-39  # a subnormal d: id overflows to -inf, y -inf or NaN: q 0
    x[2, 64:96] = torch.linspace(-1e-39, 1e-39, 32)
    x[3, :32] = 7e5  # d above fp16's range: stored as an infinity, as llama.cpp does
    x[3, 32:64] = -3.4e38  # fp32's edge
    return x


AWKWARD_ROWS = {"q8_0": _q8_awkward_rows, "q4_0": _q4_awkward_rows}


def test_the_q8_quantizer_is_llama_cpps_reference_byte_for_byte() -> None:
    x = _q8_awkward_rows()
    got = _kernels().kv_q8_quantize(x)
    assert got.shape == (40, 4 * 34) and got.dtype == torch.uint8
    assert np.array_equal(got.numpy(), q8_reference(x.numpy()))
    # roundf, not round-to-even: 2.5 -> 3, -3.5 -> -4, 0.5 -> 1, -0.5 -> -1, 1.5 -> 2
    q = got[1, 34 + 2 : 34 + 8].view(torch.int8).tolist()
    assert q == [127, 3, -4, 1, -1, 2]
    # the values read back: within half a step d of each input, plus 127 times the
    # scale's own fp16 rounding (|q d16 - x| <= |q| |d16 - d| + |q d - x|)
    back = q8_dequantize(got.numpy()[4:]).reshape(36, 4, 32)
    xs = x.numpy()[4:].reshape(36, 4, 32)
    d = np.abs(xs).max(-1, keepdims=True) / np.float32(127)
    d16 = got.numpy()[4:].reshape(36, 4, 34)[..., :2].copy().view(np.float16).astype(np.float64)
    bound = 127 * np.abs(d16 - d) + 0.5 * d * (1 + 2**-20)
    assert (np.abs(back - xs) <= bound).all()


def test_the_q4_quantizer_is_llama_cpps_reference_byte_for_byte() -> None:
    x = _q4_awkward_rows()
    got = _kernels().kv_q4_quantize(x)
    assert got.shape == (40, 4 * 18) and got.dtype == torch.uint8
    assert np.array_equal(got.numpy(), q4_reference(x.numpy()))
    raw = got.numpy()
    assert raw[0, :2].tolist() == [0x00, 0x80] and (raw[0, 2:18] == 0x88).all()
    # d = 1: q = trunc(x + 8.5) clamped: -8 -> 0, 0.5 -> 9, -0.5 -> 8, 1.5 -> 10,
    # 7.5 -> 16 -> 15, 6.9 -> 15, -7.5 -> 1, 0.49 -> 8; x[16:32] = 0.25 -> 8
    q = np.concatenate([raw[1, 2:18] & 15, raw[1, 2:18] >> 4])
    assert q[:8].tolist() == [0, 9, 8, 10, 15, 15, 1, 8] and (q[8:] == 8).all()
    d = raw[1].reshape(4, 18)[:, :2].copy().view(np.float16).ravel().tolist()
    assert d == [1.0, -0.375, 0.375, 0.25]  # the signed maximum's / -8, the first of equals
    # the values read back: within half a step d of each input where they do not clamp
    # (q 15: the far side of max, within one step), plus 8 times the scale's fp16 rounding
    back = q4_dequantize(raw[4:]).reshape(36, 4, 32)
    xs = x.numpy()[4:].reshape(36, 4, 32)
    d32 = np.abs(xs).max(-1, keepdims=True) / np.float32(8)
    d16 = np.abs(raw[4:].reshape(36, 4, 18)[..., :2].copy().view(np.float16).astype(np.float64))
    bound = 8 * np.abs(d16 - d32) + d32 * (1 + 2**-20)
    assert (np.abs(back - xs) <= bound).all()


@pytest.mark.parametrize("elem", ELEMENTS)
def test_every_build_quantizes_and_stores_to_the_same_bytes(elem: KVElement) -> None:
    x = AWKWARD_ROWS[elem.name]()
    kern = _kernels()
    want, stored, back = _quantize(kern, elem)(x), kern.kv_store(x, elem), kern.kv_values(
        kern.kv_store(x, elem), elem, 128)  # fmt: skip
    for isa in native_build.other_isas():
        other = native.load_kernels_built_for(isa)
        assert torch.equal(_quantize(other, elem)(x), want), isa
        assert torch.equal(other.kv_store(x, elem), stored), isa
        # the bits (the awkward rows' infinite scales read back as infinities and NaNs)
        assert torch.equal(other.kv_values(stored, elem, 128).view(torch.int32),
                           back.view(torch.int32)), isa  # fmt: skip


# -- the rotation ----------------------------------------------------------------------------
@pytest.mark.parametrize("hd", [32, 64, 96, 128, 256])
def test_the_rotation_is_the_walsh_hadamard_matrix_and_its_own_inverse(hd: int) -> None:
    """``kv_rotate`` multiplies each group of G values (G the largest power of two
    dividing head_dim) by the order-G Walsh-Hadamard matrix (Sylvester's, +-1 entries):
    equal to the fp64 product within the butterflies' log2(G) roundings; twice, the
    second time times 1 / G, the values back within that bound; 1 / G is exact."""
    kern, g = _kernels(), _group(hd)
    x = torch.randn(7, hd, generator=torch.Generator().manual_seed(hd)) * 3
    h = np.array([[1.0]])
    while h.shape[0] < g:
        h = np.block([[h, h], [h, -h]])
    xs = x.double().numpy().reshape(7, -1, g)
    want = (xs @ h.T).reshape(7, hd)
    lg = int(np.log2(g))
    bound = 1.001 * lg * EPS * np.broadcast_to(np.abs(xs).sum(-1, keepdims=True),
                                                xs.shape).reshape(7, hd)  # fmt: skip
    got = kern.kv_rotate(x.clone())
    assert (np.abs(got.double().numpy() - want) <= bound).all()
    back = kern.kv_rotate(got.clone(), 1 / g)
    # the first rotation's error, summed over the group and over G, then the second's
    assert (np.abs(back.double().numpy() - x.double().numpy()) <= 2 * bound).all()
    assert torch.equal(kern.kv_rotate(got.clone(), 1 / g) * g, kern.kv_rotate(got.clone()))
    with pytest.raises(ValueError, match="multiple of 32"):
        kern.kv_rotate(torch.zeros(2, 48))


@pytest.mark.parametrize("elem", ELEMENTS)
def test_a_stored_row_is_the_rotated_row_quantized_and_reads_back_rotated_back(
    elem: KVElement,
) -> None:
    """``kv_store`` = llama.cpp's quantizer of ``kv_rotate``'s rows, byte for byte;
    ``kv_values`` = the blocks' values rotated back, bit for bit; and the rotation earns
    its place: on rows with a few large channels (as RoPE'd keys have) the values read
    back lie closer to the rows than the same quantizer's without rotation."""
    kern = _kernels()
    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, 128, generator=g)
    x[:, [3, 40, 77]] *= 30  # outlier channels
    stored = kern.kv_store(x, elem)
    assert torch.equal(stored, _quantize(kern, elem)(kern.kv_rotate(x.clone())))
    blocks = torch.from_numpy(DEQUANTIZE[elem.name](stored.numpy()))
    back = kern.kv_values(stored, elem, 128)
    assert torch.equal(back, kern.kv_rotate(blocks.clone(), 1 / 128))
    plain = torch.from_numpy(DEQUANTIZE[elem.name](_quantize(kern, elem)(x).numpy()))
    assert (back - x).norm() < 0.75 * (plain - x).norm()
    with pytest.raises(ValueError, match="as q8_0 or q4_0"):
        kern.kv_store(x, KVElement("float16", torch.float16, 1))
    with pytest.raises(ValueError, match="kv_values reads"):
        kern.kv_values(stored, elem, 64)


# -- attention over a quantized cache --------------------------------------------------------
def _case(hd: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    d, h, kv, bs, nb = 5, 6, 2, 16, 6
    q = torch.randn(d, h, hd, generator=g)
    k = torch.randn(kv, nb * bs, hd, generator=g) * 2
    v = torch.randn(kv, nb * bs, hd, generator=g)
    tables = torch.tensor([[5, 4, 3, 2, 1, 0]] * d, dtype=torch.int32)
    lens = torch.tensor([1, 7, 16, 41, 96], dtype=torch.int32)
    return q, k, v, tables, lens


def _reference(q: torch.Tensor, k: np.ndarray, v: np.ndarray, tables: torch.Tensor,
               lens: torch.Tensor, bs: int, scale: float, window: int) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """fp64 attention over the given values, and each output's error bound for the
    kernel's fp32: a score's dot product of hd terms is off by at most hd * eps * sum
    |q k| (times the scale); exp adds 2 ulp and the softmax's sum and normalization
    (len + 2) * eps relative, so each weight is off by at most (2 * score error + (len +
    4) * eps) relative; the weighted sum of len values adds len * eps * sum |w v|."""
    d, h, hd = q.shape
    g = h // k.shape[0]
    out, bound = np.zeros((d, h, hd)), np.zeros((d, h, hd))
    for s in range(d):
        n = int(lens[s])
        rows = [int(tables[s, p // bs]) * bs + p % bs for p in range(n)]
        rows = rows[max(0, n - window) :] if window else rows
        for i in range(h):
            kk, vv = k[i // g][rows].astype(np.float64), v[i // g][rows].astype(np.float64)
            qq = q[s, i].double().numpy()
            sc = kk @ qq * scale
            w = np.exp(sc - sc.max())
            w /= w.sum()
            out[s, i] = w @ vv
            score_err = hd * EPS * (np.abs(kk) @ np.abs(qq)).max() * scale
            rel = 2 * score_err + (len(rows) + 4) * EPS
            bound[s, i] = rel * (w @ np.abs(vv)) * 2 + len(rows) * EPS * (w @ np.abs(vv))
    return out, bound


ATTENTION_SEED = {"q8_0": 0, "q4_0": 4}  # added to hd + window: each element's own cases


def _group(hd: int) -> int:
    """The rotation's group: the largest power of two dividing ``hd``."""
    return hd & -hd


def _rotated_back(x: np.ndarray, bound: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """fp64 ``H x / G`` over each group of G values of the last axis, and the bound on
    the kernel's fp32 ``kv_rotate(x, 1 / G)`` of an ``x`` that is itself within ``bound``:
    each output is a signed sum of the group's G values (|H| is all ones), so it carries
    their summed bound over G, plus the butterflies' log2(G) roundings, each at most eps
    of a partial sum no larger than the sum of the |x| it holds."""
    g = _group(x.shape[-1])
    h = np.array([[1.0]])
    while h.shape[0] < g:
        h = np.block([[h, h], [h, -h]])
    xs = x.reshape(*x.shape[:-1], -1, g)
    out = (xs @ h.T / g).reshape(x.shape)
    b = bound.reshape(xs.shape)
    err = (b.sum(-1, keepdims=True)
           + int(np.log2(g)) * EPS * (np.abs(xs) + b).sum(-1, keepdims=True)) / g * 1.001  # fmt: skip
    return out, np.broadcast_to(err, xs.shape).reshape(x.shape)


@pytest.mark.parametrize(("hd", "window"), [(64, 0), (32, 0), (64, 13), (128, 20), (96, 0)])
@pytest.mark.parametrize("elem", ELEMENTS)
def test_attention_reads_the_rotated_values_and_rotates_back(
    elem: KVElement, hd: int, window: int
) -> None:
    """head_dim 64 (the AVX2 path) and 32 / 96 / 128 (the portable loop; 96 rotates in
    groups of 32): the quantized cache holds ``kv_store``'s rows (each rotated, then
    quantized), and its attention gives the same bits as the same kernel over an fp32
    cache holding what the blocks stand for (``q * d``, ``(q - 8) * d``: the rotated
    values) with the query rotated (``kv_rotate`` times 1 / G) and the output rotated
    back; within the derived bound of fp64 attention over those values, rotated back in
    fp64; every build the same bits; a sequence alone the same as in the batch; rows read
    as the other element refused for their width, and uint8 rows unnamed refused (uint8
    holds both)."""
    q, k, v, tables, lens = _case(hd, hd + window + ATTENTION_SEED[elem.name])
    kern, scale, bs, g = _kernels(), hd**-0.5, 16, _group(hd)
    dequantize = DEQUANTIZE[elem.name]
    kq, vq = kern.kv_store(k, elem), kern.kv_store(v, elem)
    kf, vf = dequantize(kq.numpy()), dequantize(vq.numpy())
    got = kern.paged_attention(q, kq, vq, tables, lens, bs, scale, window, element=elem)
    qr = kern.kv_rotate(q.clone(), 1 / g)
    rotated = kern.paged_attention(qr, torch.from_numpy(kf), torch.from_numpy(vf), tables, lens,
                                   bs, scale, window)  # fmt: skip
    assert torch.equal(got, kern.kv_rotate(rotated.clone(), 1 / g))
    want_r, bound_r = _reference(qr, kf, vf, tables, lens, bs, scale, window)
    assert (np.abs(rotated.double().numpy() - want_r) <= bound_r).all()
    want, bound = _rotated_back(want_r, bound_r)
    assert (np.abs(got.double().numpy() - want) <= bound).all()
    alone = kern.paged_attention(q[3:4], kq, vq, tables[3:4], lens[3:4], bs, scale, window,
                                 element=elem)  # fmt: skip
    assert torch.equal(alone, got[3:4])
    for isa in native_build.other_isas():
        other = native.load_kernels_built_for(isa)
        assert torch.equal(other.paged_attention(q, kq, vq, tables, lens, bs, scale, window,
                                                 element=elem), got), isa  # fmt: skip
    wrong = KV_Q4 if elem == KV_Q8 else KV_Q8
    with pytest.raises(ValueError, match="do not hold head_dim"):
        kern.paged_attention(q, kq, vq, tables, lens, bs, scale, window, element=wrong)
    with pytest.raises(ValueError, match="holds both q8_0 and q4_0"):
        kern.paged_attention(q, kq, vq, tables, lens, bs, scale, window)  # uint8: unnamed


CHUNK_SEED = {"q8_0": 3, "q4_0": 5}


@pytest.mark.parametrize("elem", ELEMENTS)
def test_rows_of_a_prompt_chunk_read_the_blocks_converted_once(elem: KVElement) -> None:
    """Consecutive rows of one table (a chunk: converted ahead once) equal each row alone."""
    q, k, v, _, _ = _case(64, CHUNK_SEED[elem.name])
    kern = _kernels()
    kq, vq = kern.kv_store(k, elem), kern.kv_store(v, elem)
    tables = torch.tensor([[2, 0, 5, 1, 3, 4]] * 5, dtype=torch.int32)
    lens = torch.tensor([60, 61, 62, 63, 64], dtype=torch.int32)
    run_ = kern.paged_attention(q, kq, vq, tables, lens, 16, 0.125, element=elem)
    for s in range(5):
        one = kern.paged_attention(q[s : s + 1], kq, vq, tables[s : s + 1], lens[s : s + 1], 16,
                                   0.125, element=elem)  # fmt: skip
        assert torch.equal(one, run_[s : s + 1])


# test_determinism's mixed step of the fused trunk (decodes beside a fresh prompt and a
# chunk after a cached prefix) on a quantized cache, its element named: the digests of
# its logits and of the bytes it wrote.
_ANCHOR = "cache = PagedKVCache(lm.config, 24, bs)"


def _mixed_step(elem: KVElement) -> str:
    name = {"q8_0": "KV_Q8", "q4_0": "KV_Q4"}[elem.name]
    return _MIXED_STEP.replace(
        _ANCHOR, f"from gpu.kernels.native import {name}\n" + _ANCHOR[:-1] + f", kv_dtype={name})"
    )


def _run_build(isa: str, model: Path, script: str) -> dict[str, object]:
    env = {**os.environ, "LIFECYCLE_NATIVE_ISA": isa, "PYTHONPATH": str(ROOT)}
    env.update(_TORCH_LEVEL.get(isa, {}))
    out = subprocess.run([sys.executable, "-c", script, str(model)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert isinstance(got, dict)
    got.pop("torch_cpu")  # the level torch was held to: the build's own
    return got


@pytest.fixture(scope="module")
def hd32(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """The tiny model with head_dim 32 (128 wide, 4 heads): q8_0 and q4_0 take it."""
    spec = TinySpec(hidden=128, context_length=1024)
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "hd32.gguf", spec)


@pytest.mark.parametrize("elem", ELEMENTS)
def test_every_build_runs_the_model_on_a_quantized_cache_to_the_same_bits(
    elem: KVElement, hd32: TinyModel
) -> None:
    """The default build against each other build: logits and every byte of the q8_0 or
    q4_0 cache a mixed step wrote (the quantizer inside the trunk, then attention over it)."""
    script = _mixed_step(elem)
    assert _ANCHOR in _MIXED_STEP and f"kv_dtype=KV_Q{elem.name[1]})" in script
    want = _run_build("auto", hd32.path, script)
    for isa in native_build.other_isas():
        assert _run_build(isa, hd32.path, script) == want, isa


# -- the engine on the bundled model ---------------------------------------------------------
def _engine(lm: LoadedModel, elem: KVElement, **kw: object) -> Engine:
    engine = Engine(lm, EngineConfig(**{"kv_blocks": 96, "block_size": 16,
                                        "kv_cache_dtype": elem.name, **kw}))  # type: ignore[arg-type]  # fmt: skip
    assert engine.cache.element == elem.name and engine.cache.kv_element == elem
    assert engine.runner.backends()["trunk"] == "fused"
    return engine


PROMPT_SEED = {"q8_0": 59, "q4_0": 40}


@pytest.mark.parametrize("elem", ELEMENTS)
def test_greedy_tokens_alone_batched_cached_and_chunked_are_equal(
    elem: KVElement, cpu_model: LoadedModel
) -> None:
    """SmolLM2 on a q8_0 or q4_0 cache: each prompt alone, all in one batch, again after
    its prefix is cached (all but its last token read from the cache), and prefilled in
    chunks of 16: the same greedy tokens. The rows the trunk wrote are the element's rows
    (34 or 18 bytes a block): their values quantize back to the same bytes."""
    lm = cpu_model
    ps = prompts(3, lm.config.vocab_size, seed=PROMPT_SEED[elem.name], lo=40, hi=90)
    s = {**GREEDY, "max_new_tokens": 8}
    alone = [run_to_end(_engine(lm, elem), [p], [s])[0] for p in ps]
    assert run_to_end(_engine(lm, elem), ps, [s] * 3) == alone
    chunked = _engine(lm, elem, step_tokens=16, mixed_prefill_tokens=16)
    assert run_to_end(chunked, ps, [s] * 3) == alone
    engine = _engine(lm, elem)
    assert engine.cache.k.shape[-1] == lm.config.head_dim // 32 * BLOCK_BYTES[elem.name]
    first = run(engine, [(1, ps[0], s, {})])[1]
    again = run(engine, [(2, ps[0], s, {})])[2]
    assert ids_of(first) == ids_of(again) == alone[0]
    assert again[0].extra["cached_tokens"] == len(ps[0]) - 1  # to the token
    for t in (engine.cache.k, engine.cache.v):
        rows = t.flatten(0, 2)
        rows = rows[(rows != 0).any(-1)]  # the written ones
        assert len(rows) >= 30 * 3 * len(ps[0])  # every layer and kv head of the prompt
        values = torch.from_numpy(DEQUANTIZE[elem.name](rows.numpy()))
        assert torch.equal(_quantize(_kernels(), elem)(values), rows)


# -- the disk tier ---------------------------------------------------------------------------
TOKENS = (5, 6, 7, 8)
DISK_SEED = {"q8_0": 1, "q4_0": 2}


def _layout(kv_dtype: str) -> DiskLayout:
    return DiskLayout("ab" * 16, kv_dtype, n_layers=2, n_kv_heads=2, block_size=4, head_dim=64)


@pytest.mark.parametrize(
    ("elem", "other"),
    [
        pytest.param(KV_Q8, "float16", id="q8_0-float16"),
        pytest.param(KV_Q8, "q4_0", id="q8_0-q4_0"),  # a q8_0 file is refused by a q4_0 cache
        pytest.param(KV_Q4, "q8_0", id="q4_0-q8_0"),
        pytest.param(KV_Q4, "float16", id="q4_0-float16"),
    ],
)
def test_a_block_file_reads_back_byte_for_byte_and_others_refuse_it(
    elem: KVElement, other: str, tmp_path: Path
) -> None:
    layout, width = _layout(elem.name), 2 * BLOCK_BYTES[elem.name]  # 64 values: 2 blocks
    assert layout.shape == (2, 2, 4, width) and layout.dtype == torch.uint8
    assert layout.element == elem and layout.payload_bytes == 2 * 2 * 2 * 4 * width
    g = torch.Generator().manual_seed(DISK_SEED[elem.name])
    k, v = (_quantize(_kernels(), elem)(torch.randn(2, 2, 4, 64, generator=g)) for _ in range(2))
    key = block_hash(None, TOKENS)
    assert DiskPrefixCache(tmp_path, 1 << 20, layout).put(key, None, TOKENS, k, v)
    got = DiskPrefixCache(tmp_path, 1 << 20, layout).get(key, None, TOKENS)
    assert got is not None and torch.equal(got[0], k) and torch.equal(got[1], v)
    store = DiskPrefixCache(tmp_path, 1 << 20, _layout(other))
    assert store.get(key, None, TOKENS) is None and store.dropped == 1
    assert not store.path(key).exists()


def disk_round_trip(model: Path, tmp_path: Path, kv: str, other_kv: str, seed: int) -> Engine:
    """An engine of ``--kv-cache-dtype kv`` spills its cached blocks; a new one on the
    directory reads them back (the cold run's tokens, the prefix cached); an engine of
    ``other_kv`` (returned) refuses them."""
    lm = load_model(model, device="cpu", weights="quantized")
    p = prompts(1, 200, seed=seed, lo=300, hi=301)[0]
    s = {**GREEDY, "max_new_tokens": 6}

    def engine(kv: str) -> Engine:
        return Engine(lm, EngineConfig(kv_blocks=64, block_size=16, kv_cache_dtype=kv,
                                       prefix_cache_dir=str(tmp_path)))  # fmt: skip

    first = engine(kv)
    cold = ids_of(run(first, [(1, p, s, {})])[1])
    assert first.disk is not None and first.disk.spill(first.blocks) > 0
    warm = run(engine(kv), [(2, p, s, {})])[2]
    assert ids_of(warm) == cold and warm[0].extra["cached_tokens"] == 18 * 16
    other = engine(other_kv)
    assert run(other, [(3, p, s, {})])[3][0].extra["cached_tokens"] == 0
    assert other.disk is not None and other.disk.store.dropped >= 1
    return other


@pytest.mark.parametrize(
    ("elem", "other_kv", "other_element", "seed"),
    [
        pytest.param(KV_Q8, "auto", "float16", 8, id="q8_0"),
        pytest.param(KV_Q4, "q8_0", "q8_0", 9, id="q4_0"),
    ],
)
def test_the_disk_tier_carries_the_blocks_to_a_new_engine(
    elem: KVElement, other_kv: str, other_element: str, seed: int, hd32: TinyModel,
    tmp_path: Path,
) -> None:  # fmt: skip
    """A q8_0 (q4_0) engine spills its cached blocks; a new one of the same element on
    the directory reads them back (the cold run's tokens, the prefix cached); an fp16
    (q8_0) engine refuses them."""
    other = disk_round_trip(hd32.path, tmp_path, elem.name, other_kv, seed=seed)
    assert other.cache.element == other_element


# -- where it runs, and what it holds --------------------------------------------------------
@pytest.mark.parametrize(
    ("values", "why"),
    [
        ({"device": "cuda"}, "{kv} is read by the CPU's native kernels: use --device cpu"),
        ({"kernels": "triton"}, "{kv} is read by the CPU's native kernels, not Triton's"),
        ({"tp": 2}, "leave --kv-cache-dtype at auto"),
    ],
)
@pytest.mark.parametrize("elem", ELEMENTS)
def test_it_is_refused_where_the_native_kernels_do_not_read_it(
    elem: KVElement, values: dict, why: str
) -> None:
    assert elem.name in KV_CACHE_DTYPES
    got = refused_combination({"kv_cache_dtype": elem.name, **values})
    assert got is not None and why.format(kv=elem.name) in got
    for weights in ("auto", "quantized", "fp32"):  # the fused trunk or the torch path
        cpu = {"kv_cache_dtype": elem.name, "device": "cpu", "weights": weights}
        assert refused_combination(cpu) is None


@pytest.mark.parametrize("elem", ELEMENTS)
def test_the_engine_refuses_it_where_the_kernels_cannot_store_it(
    elem: KVElement, tiny_gguf: TinyModel
) -> None:
    cpu, kv = torch.device("cpu"), elem.name
    assert kv_dtype_refusal(kv, cpu, 64) is None and kv_dtype_refusal("fp16", cpu, 16) is None
    assert "--device cpu" in (kv_dtype_refusal(kv, torch.device("cuda"), 64) or "")
    assert "rotates rows of at most 512 values" in (kv_dtype_refusal(kv, cpu, 544) or "")
    with pytest.raises(SystemExit, match=f"{kv} stores blocks of 32 values: head_dim 16 is not "
                       "a multiple of 32"):  # fmt: skip
        build_engine(WorkerConfig(model_path=str(tiny_gguf.path), device="cpu",
                                  kv_cache_dtype=kv, kv_memory_mib=1))  # fmt: skip


@pytest.mark.parametrize("elem", ELEMENTS)
def test_the_torch_path_stores_kv_store_rows_and_attends_to_their_values(
    elem: KVElement, hd32: TinyModel
) -> None:
    """The torch path (fp32 weights; a model the fused trunk does not run) on a q8_0 or
    q4_0 cache: each new K/V row written as ``kv_store`` writes it; a prompt chunk, alone
    and after a cached prefix, attends to what the rows stand for (``kv_values``) exactly
    as an fp32 cache holding those values does (the same SDPA inputs: the same bits); a
    decode is the native kernel's on the blocks, told their element."""
    kern = _kernels()
    lm = load_model(hd32.path, device="cpu", weights="fp32")
    c = lm.config
    blocked = PagedKVCache(c, 4, 16, kv_dtype=elem)
    plain = PagedKVCache(c, 4, 16, kv_dtype=torch.float32)
    assert blocked.kernels is not None and plain.kernels is not None
    g = torch.Generator().manual_seed(BLOCK_BYTES[elem.name])
    table, layer = [2, 0, 3], 1

    def qkv(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (torch.randn(n, c.n_heads, c.head_dim, generator=g),
                *(torch.randn(n, c.n_kv_heads, c.head_dim, generator=g) * 3 for _ in range(2)))  # fmt: skip

    for start, n in ((0, 20), (20, 7)):  # a fresh chunk, then one after its cached prefix
        q, k, v = qkv(n)
        for cache in (blocked, plain):
            cache.prepare([], [PrefillChunk(table, start, n)])
        got = blocked(layer, q, k, v)
        kb, vb = kern.kv_store(k, elem), kern.kv_store(v, elem)
        stored = kern.kv_values(kb, elem, c.head_dim), kern.kv_values(vb, elem, c.head_dim)
        assert torch.equal(got, plain(layer, q, *stored))
        rows = torch.tensor([table[p // 16] * 16 + p % 16 for p in range(start, start + n)])
        assert torch.equal(blocked.k[layer][:, rows], kb.transpose(0, 1))
        assert torch.equal(blocked.v[layer][:, rows], vb.transpose(0, 1))
    q, k, v = qkv(1)
    blocked.prepare([(table, 28)], [])
    got = blocked(layer, q, k, v)
    tables, lens = torch.tensor([table], dtype=torch.int32), torch.tensor([28], dtype=torch.int32)
    want = kern.paged_attention(q, blocked.k[layer], blocked.v[layer], tables, lens, 16,
                                blocked.scale, element=elem)  # fmt: skip
    assert torch.equal(got, want)


@pytest.mark.parametrize("elem", ELEMENTS)
def test_the_worker_serves_it_with_fp32_weights(elem: KVElement, hd32: TinyModel) -> None:
    """``--weights fp32 --kv-cache-dtype q8_0`` (q4_0) starts (the torch path) and serves
    greedy requests to their length, a second time after its prefix is cached, from
    blocks of the element's bytes."""
    engine = build_engine(WorkerConfig(model_path=str(hd32.path), device="cpu", weights="fp32",
                                       kv_cache_dtype=elem.name, kv_memory_mib=1))  # fmt: skip
    assert engine.runner.backends()["trunk"] == "torch" and engine.cache.kv_element == elem
    assert engine.cache.k.shape[-1] == BLOCK_BYTES[elem.name]  # head_dim 32: one block
    p = prompts(1, 200, seed=PROMPT_SEED[elem.name], lo=40, hi=41)[0]
    s = {**GREEDY, "max_new_tokens": 6}
    first = run(engine, [(1, p, s, {})])[1]
    again = run(engine, [(2, p, s, {})])[2]
    assert len(ids_of(first)) == len(ids_of(again)) == 6
    assert again[0].extra["cached_tokens"] == len(p) - 1


def test_the_element_is_the_caches_own_not_its_dtypes(hd32: TinyModel) -> None:
    """q8_0 and q4_0 are both uint8 tensors: each cache holds the element it was built
    with, and a bare uint8 does not build one."""
    lm = load_model(hd32.path, device="cpu", weights="quantized")
    q4 = PagedKVCache(lm.config, 4, 16, kv_dtype=KV_Q4)
    q8 = PagedKVCache(lm.config, 4, 16, kv_dtype=KV_Q8)
    assert q4.k.dtype == q8.k.dtype == torch.uint8
    assert (q4.element, q4.kv_element, q8.element, q8.kv_element) == ("q4_0", KV_Q4, "q8_0", KV_Q8)
    assert q4.k.shape[-1] == 18 and q8.k.shape[-1] == 34
    with pytest.raises(ValueError, match="holds both q8_0 and q4_0"):
        PagedKVCache(lm.config, 4, 16, kv_dtype=torch.uint8)


def test_a_bare_uint8_is_refused_and_the_float_dtypes_name_their_element() -> None:
    """uint8 holds both q8_0 and q4_0: ``kv_element`` (and so ``kv_row_width`` and
    ``kv_value_bytes``) refuses it, asking for the element; each float dtype is one
    element's alone and still names it."""
    assert kv_element(KV_Q8) == KV_Q8 and kv_element(KV_Q4) == KV_Q4
    for name, dtype in (("float32", torch.float32), ("float16", torch.float16),
                        ("bfloat16", torch.bfloat16)):  # fmt: skip
        assert kv_element(dtype).name == name and kv_element(dtype).dtype == dtype
        assert kv_row_width(dtype, 64) == 64 and kv_value_bytes(dtype) == dtype.itemsize
    for refused in (kv_element, lambda d: kv_row_width(d, 64), kv_value_bytes):
        with pytest.raises(ValueError, match="uint8 holds both q8_0 and q4_0; name the element"):
            refused(torch.uint8)
    assert kv_row_width(KV_Q8, 64) == 68 and kv_row_width(KV_Q4, 64) == 36
    with pytest.raises(KeyError):
        kv_element(torch.int32)  # no cache holds it


SMOLLM2_BYTES = {"q8_0": 12240, "q4_0": 6480}  # 30 layers, 3 KV heads, head_dim 64: a token


@pytest.mark.parametrize("elem", ELEMENTS)
def test_capacity_in_tokens_is_the_blocks_bytes_per_32_values(
    elem: KVElement, hd32: TinyModel
) -> None:
    """In the same memory a q8_0 cache holds 64 / 34 the tokens of fp16 (0.53x the bytes a
    token), a q4_0 cache 64 / 18 (0.28x); the worker sizes it so and reports it (HELLO's
    capacity: /server_info)."""
    from gpu.worker.info import hello

    kv, nbytes = elem.name, BLOCK_BYTES[elem.name]
    assert kv_value_bytes(elem) == nbytes / 32 and kv_value_bytes(torch.float16) == 2
    assert kv_storage_dtype(kv, torch.device("cpu"), torch.float32, True) == elem
    sizes = {}
    for choice in ("auto", kv):
        config = WorkerConfig(model_path=str(hd32.path), device="cpu", weights="quantized",
                              kv_cache_dtype=choice, kv_memory_mib=4)  # fmt: skip
        engine = build_engine(config)
        cap = hello(engine).capacity
        value = 2 if choice == "auto" else nbytes / 32
        per_token = 2 * 2 * 2 * 32 * value  # K, V x layers x heads x head_dim
        assert cap["kv_bytes_per_token"] == engine.cache.bytes_per_token() == per_token
        assert engine.cache.kv_element == (elem if choice == kv else kv_element(torch.float16))
        value_bytes = kv_value_bytes(engine.cache.kv_element)
        assert kv_bytes_per_token(engine.mc, value_bytes) == per_token
        blocks = kv_blocks_for(config, 2, 2, 32, value_bytes)
        assert engine.config.kv_blocks == blocks == int(4 * 2**20 // per_token) // 16
        sizes[cap["kv_dtype"]] = (per_token, blocks)
    assert sizes[kv][0] / sizes["float16"][0] == nbytes / 64
    assert sizes[kv][1] >= sizes["float16"][1] * 64 // nbytes
    # SmolLM2's shape: 30 layers, 3 KV heads, head_dim 64
    assert 2 * 30 * 3 * 64 * kv_value_bytes(elem) == SMOLLM2_BYTES[kv] == 23040 * nbytes / 64
