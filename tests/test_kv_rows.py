"""The rows of the quantized KV caches, q8_0 and q4_0 (``--kv-cache-dtype q8_0`` /
``q4_0``, issue 59, point 2), and the attention kernel over them, without a model:
llama.cpp's block_q8_0 (an fp16 scale, 32 int8: 34 bytes) and block_q4_0 (an fp16 scale,
16 bytes of 4-bit values: 18 bytes) per 32 values of a K or V row, each row rotated first
(``kv_rotate``: the Walsh-Hadamard matrix over groups of the largest power of two dividing
head_dim) and written by the kernels' one writer (``kv_store``), read in place by the
native attention kernel as ``q * d`` and ``(q - 8) * d`` with the query rotated and the
output rotated back.

Each quantizer is held to a numpy transcription of llama.cpp's ``quantize_row_q8_0_ref``
/ ``quantize_row_q4_0_ref`` byte for byte (ties, zeros, the signed maximum, extremes:
one test each); the rotation is Sylvester's Hadamard matrix and its own inverse within
its derived bound, and a stored row is the rotated row quantized. The rest is the same
test for both elements, parametrized (ids ``q8_0``, ``q4_0``): every build quantizes and
stores to the same bytes; the attention over a quantized cache equals the same kernel over
an fp32 cache of the blocks' values with the query rotated and the output rotated back
(bit for bit) and an fp64 reference within a derived bound, and unnamed uint8 rows are
refused; a prompt chunk's rows read the blocks converted once as each row alone does.
``tests/test_kv_quantized.py`` runs the caches in the model, the engine and the worker.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from gpu.kernels import native, native_build
from gpu.kernels.kv_element import KV_Q4, KV_Q8, KVElement

pytestmark = pytest.mark.skipif(
    native.load_kernels() is None, reason="q8_0 and q4_0 caches are read by the native kernels only"
)
EPS = 2.0**-24  # fp32's unit roundoff
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
