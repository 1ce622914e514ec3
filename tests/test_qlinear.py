"""The quantized-weight linear kernel (gpu/kernels/csrc/quant_linear.c) against dequantize-then-F.linear.

What the kernel multiplies by must be exactly what gguf.quants (the loader's
dequantization) makes of the blocks: ``q_dequantize`` runs the kernel's own reading of
the block layout and is compared bit for bit. The product itself is approximate by
design: each row of x is rounded to int8 per block of 32 (scale ``amax / 127``, as
llama.cpp does), so an element moves by at most ``amax_block / 254`` and output j by at
most ``sum_i |w_ji| * amax_block(i) / 254``. The tests assert that bound (with 1 %
slack for the rounding of the scales and 1e-5 of ``sum_i |w_ji x_i|`` for fp32
accumulation); against ``max |ref|`` the error is about 0.5 % on random data. With x
already on the int8 grid (integers, block amax 127) the rounding is exact and the
kernel matches fp64 to fp32 accumulation error.

Every output is one function of its row of x and its row of w, defined in the kernel's
header (an exact integer per block, one FMA per block in block order):
``q_linear_reference`` computes that definition output by output, and every path of the
kernel (decode's one or two rows against four weight rows at once, the panels of 8 or 16
weight rows with their one-pass row counts, a second chunk of rows), every row count
from 1 to 20, thread count and build (AVX-512 VNNI, AVX-VNNI, AVX2, portable C) equals it.
Those are asserted bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

from gpu.kernels import native, native_build
from modelfile.gguf_file import GGUFFile, default_model_path
from tests.threads import torch_threads

KERNELS = native.load_kernels()
# One block of x whose int8 scale is exactly 1 (amax 127) and whose other values lie
# half-way between integers: every build must round them half to even, as llama.cpp's
# nearbyintf and the SIMD builds' round_ps do (a build rounding half away differs here).
TIES = torch.tensor([127.0] + [k + 0.5 for k in range(-15, 16)])
pytestmark = pytest.mark.skipif(
    KERNELS is None,
    reason="native kernels off (LIFECYCLE_NATIVE=0) or not buildable here (no C compiler, "
    "or one without OpenMP): the quantized kernel has no torch fallback to test",
)
Q = GGMLQuantizationType
# Every type the kernel reads in place; the k-quants take rows of 256 weights.
TYPES = (Q.Q8_0, Q.Q4_1, Q.Q4_0, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K)
K_QUANTS = frozenset({Q.Q4_K, Q.Q5_K, Q.Q6_K})
# Where each type keeps its fp16 scale(s) in a block: (byte offset, how many).
_SCALES = {Q.Q8_0: (0, 1), Q.Q4_0: (0, 1), Q.Q5_0: (0, 1), Q.Q4_1: (0, 2), Q.Q5_1: (0, 2),
           Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208, 1)}  # fmt: skip


def kdim(qtype: GGMLQuantizationType, k: int) -> int:
    """``k`` rounded up to a whole number of the type's blocks."""
    elems = GGML_QUANT_SIZES[qtype][0]
    return -(-k // elems) * elems


def kernels() -> native.NativeKernels:
    assert KERNELS is not None
    return KERNELS


def random_blocks(qtype: GGMLQuantizationType, n: int, k: int, seed: int) -> np.ndarray:
    """Random bytes for every quant (all nibbles, high bits and 6-bit scales, int8 -128
    included), finite fp16 scales."""
    rng = np.random.default_rng(seed)
    elems, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // elems, size), dtype=np.uint8)
    at, count = _SCALES[qtype]
    scales = rng.uniform(-0.05, 0.05, (n, k // elems, count)).astype(np.float16)
    raw[..., at : at + 2 * count] = scales.view(np.uint8).reshape(n, k // elems, 2 * count)
    return raw.reshape(n, -1)


def bound(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Per-output bound on the error the int8 rounding of x may cause (module docstring)."""
    amax = x.abs().view(x.shape[0], -1, 32).amax(-1).repeat_interleave(32, dim=1)
    w64, x64 = w.double(), x.double()
    return (amax.double() / 254) @ w64.abs().T * 1.01 + 1e-5 * (x64.abs() @ w64.abs().T)


def check(w_blocks: np.ndarray, qtype: GGMLQuantizationType, x: torch.Tensor) -> float:
    """Kernel vs F.linear on gguf's dequantization; returns max error / max |ref|."""
    k = x.shape[1]
    blocks = torch.from_numpy(np.ascontiguousarray(w_blocks))
    w = torch.from_numpy(dequantize(w_blocks, qtype).reshape(-1, k))
    assert torch.equal(kernels().q_dequantize(blocks, int(qtype), k), w)
    y = kernels().q_linear(x, blocks, int(qtype))
    ref = F.linear(x.double(), w.double())
    err = (y.double() - ref).abs()
    assert (err <= bound(w, x)).all(), float((err / bound(w, x)).max())
    return float(err.max() / ref.abs().max())


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7])
def test_random_blocks(qtype: GGMLQuantizationType, rows: int) -> None:
    k = kdim(qtype, 576)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    assert check(random_blocks(qtype, 37, k, seed=rows), qtype, x) < 0.02


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_quantized_floats_and_one_block_rows(qtype: GGMLQuantizationType) -> None:
    """Blocks made by gguf.quants' own quantizer (random blocks for the k-quants, which
    it cannot make), and one block per row."""
    rng = np.random.default_rng(3)
    for k in (kdim(qtype, 32), 1536):
        if qtype in K_QUANTS:
            w = random_blocks(qtype, 64, k, seed=k)
        else:
            w = quantize(rng.standard_normal((64, k)).astype(np.float32), qtype)
        x = torch.randn(2, k, generator=torch.Generator().manual_seed(k))
        assert check(w, qtype, x) < 0.02


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_x_on_the_int8_grid_is_exact(qtype: GGMLQuantizationType) -> None:
    g = torch.Generator().manual_seed(5)
    k = kdim(qtype, 576)
    x = torch.randint(-127, 128, (2, k), generator=g).float()
    x.view(2, -1, 32)[:, :, 0] = 127.0  # every block's amax: scale exactly 1
    blocks = random_blocks(qtype, 48, k, seed=5)
    w = torch.from_numpy(dequantize(blocks, qtype).reshape(-1, k))
    y = kernels().q_linear(x, torch.from_numpy(blocks), int(qtype))
    ref = F.linear(x.double(), w.double())
    torch.testing.assert_close(y.double(), ref, rtol=0, atol=1e-5 * float(ref.abs().max()))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(
    ("rows", "n", "k"), [(8, 64, 576), (32, 37, 576), (71, 48, 1536), (500, 20, 64)]
)
def test_many_rows_are_f_linear_on_the_dequantization(
    qtype: GGMLQuantizationType, rows: int, n: int, k: int
) -> None:
    """Prefill row counts, odd widths, rows past a chunk of 96: within the rounding bound
    of F.linear."""
    k = kdim(qtype, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + n))
    assert check(random_blocks(qtype, n, k, seed=rows), qtype, x) < 0.02


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_row_is_the_same_in_any_call(qtype: GGMLQuantizationType) -> None:
    """Each row of an m-row call (m = 1..13, 31, 64, 97, 200: every tile shape, the
    eight-row tiles, a second chunk of 96) equals that row alone, and a call on one
    thread equals it on two, bit for bit."""
    k = kdim(qtype, 576)
    x = torch.randn(200, k, generator=torch.Generator().manual_seed(3)) * 3
    blocks = torch.from_numpy(random_blocks(qtype, 37, k, seed=3))
    with torch_threads(2):
        alone = torch.cat(
            [kernels().q_linear(x[i : i + 1], blocks, int(qtype)) for i in range(200)]
        )
        for m in [*range(1, 14), 31, 64, 97, 200]:
            y = kernels().q_linear(x[:m], blocks, int(qtype))
            assert torch.equal(y, alone[:m]), m
    with torch_threads(1):
        one = kernels().q_linear(x[:97], blocks, int(qtype))
    assert torch.equal(one, alone[:97])


# Every row count from 1 to 20: decode (one or two rows against four weight rows at once),
# the panels from three rows on (one pass for up to 8 rows, 4 without AVX-512; then
# passes of 8 and the rest), so every threshold and its neighbours; then 31-33 and 300
# (a second chunk of 256 rows).
ROW_COUNTS = (*range(1, 21), 31, 32, 33, 300)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_path_is_the_definition(qtype: GGMLQuantizationType) -> None:
    """Every row count of ``ROW_COUNTS`` (so every path: decode's one and two rows, the
    panels and their tails, 37 outputs: a partial panel and a partial group of four), on
    one thread and two, against the header's definition computed output by output."""
    k = kdim(qtype, 1536)
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(11)) * 3
    x[3] = 0.0  # a zero block: scale 0
    x[5, :32] = TIES  # exact ties at the int8 rounding
    blocks = torch.from_numpy(random_blocks(qtype, 37, k, seed=11))
    ref = kernels().q_linear_reference(x, blocks, int(qtype))
    for threads in (1, 2):
        with torch_threads(threads):
            for m in ROW_COUNTS:
                y = kernels().q_linear(x[:m], blocks, int(qtype))
                assert torch.equal(y, ref[:m]), (threads, m)


@pytest.mark.parametrize("isa", native_build.other_isas())
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_build_computes_the_same_bits(qtype: GGMLQuantizationType, isa: str) -> None:
    other = native.load_kernels_built_for(isa)
    x = torch.randn(70, 1536, generator=torch.Generator().manual_seed(9))
    x[3] = 0.0  # a zero block: scale 0
    x[5, :32] = TIES  # exact ties at the int8 rounding
    blocks = torch.from_numpy(random_blocks(qtype, 51, 1536, seed=9))
    ref = kernels().q_linear_reference(x, blocks, int(qtype))
    for threads in (1, 2):
        with torch_threads(threads):
            for m in (*range(1, 21), 70):
                y = other.q_linear(x[:m], blocks, int(qtype))
                assert torch.equal(y, ref[:m]), (isa, threads, m)
                assert torch.equal(y, kernels().q_linear(x[:m], blocks, int(qtype))), (isa, m)
    assert torch.equal(
        other.q_dequantize(blocks, int(qtype), 1536),
        kernels().q_dequantize(blocks, int(qtype), 1536),
    )


def test_rejects_what_it_cannot_read() -> None:
    blocks = torch.from_numpy(random_blocks(GGMLQuantizationType.Q4_1, 8, 64, seed=0))
    with pytest.raises(ValueError, match="GGML types"):
        kernels().q_linear(torch.zeros(1, 64), blocks, int(GGMLQuantizationType.Q2_K))
    with pytest.raises(ValueError, match="rows of 64"):  # a k-quant needs rows of 256
        kernels().q_linear(torch.zeros(1, 64), blocks, int(GGMLQuantizationType.Q4_K))
    with pytest.raises(ValueError, match="rows of 96"):
        kernels().q_linear(torch.zeros(1, 96), blocks, int(GGMLQuantizationType.Q4_1))
    with pytest.raises(ValueError, match="fp32"):
        kernels().q_linear(torch.zeros(1, 64).double(), blocks, int(GGMLQuantizationType.Q4_1))


def file_blocks(f: GGUFFile, name: str, rows: int) -> np.ndarray:
    """The first ``rows`` rows of a tensor's blocks, copied out of the file."""
    t, qtype = f.tensors[name], f.tensor_type(name)
    row_bytes = native.quant_row_bytes(int(qtype), f.tensor_shape(name)[1])
    return np.array(np.memmap(f.path, np.uint8, "r", t.offset, (rows, row_bytes)))


@pytest.mark.parametrize(
    ("name", "qtype"),
    [
        ("blk.0.ffn_down.weight", GGMLQuantizationType.Q4_1),
        ("blk.29.attn_q.weight", GGMLQuantizationType.Q4_1),
        ("token_embd.weight", GGMLQuantizationType.Q8_0),  # also the tied LM head
    ],
)
def test_bundled_model_tensors(name: str, qtype: GGMLQuantizationType) -> None:
    f = GGUFFile(default_model_path())
    assert f.tensor_type(name) == qtype
    n, k = f.tensor_shape(name)
    rows = min(n, 2048)
    blocks = file_blocks(f, name, rows)
    if rows == n:  # the loader's own dequantization of the whole tensor, bit for bit
        assert torch.equal(
            kernels().q_dequantize(torch.from_numpy(blocks), int(qtype), k),
            torch.from_numpy(f.dequantize(name)),
        )
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(7))
    assert check(blocks, qtype, x) < 0.02


# sha256 (16 hex digits) of the kernel's output for one decode row and for eight rows
# (a panel) on fixed inputs: a value change every build and path shares (x's int8
# scale computed another way, a block's scales read otherwise) keeps the builds equal
# to each other and to the reference, and changes these; the failure names the type.
# Recorded 2026-12-06; every build computes the same bits (the tests above), so these
# hold on any x86 CPU.
KERNEL_DIGESTS = {
    "Q8_0": ("638e41846400f669", "7c010c74baf1038d"),
    "Q4_1": ("c0f65793fd496a15", "270ca19cd8469037"),
    "Q4_0": ("89a91c167b005056", "64105df7a5adb2ee"),
    "Q5_0": ("456682ba773494c0", "3cfb21f4c4d5edda"),
    "Q5_1": ("bbabdd92033f1203", "1da09951f2e1ca9a"),
    "Q4_K": ("05ca0cf6f13dadfc", "c28b7319075c9860"),
    "Q5_K": ("8d1060bd4d4ff892", "dbb06ac7e8dad24e"),
    "Q6_K": ("bc895589c53cb0b6", "d39b94256cc180bb"),
}


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_each_types_output_is_the_recorded_one(qtype: GGMLQuantizationType) -> None:
    """Issue 54, point 7: a per-type golden digest at the kernel level. Inputs are exact
    in binary (multiples of 1/512 from numpy's seeded generator) so nothing but the
    kernel's own arithmetic decides the bits."""
    import hashlib

    k = kdim(qtype, 512)
    rng = np.random.default_rng(53)
    x = torch.from_numpy((rng.integers(-4096, 4096, (8, k)) / 512).astype(np.float32))
    blocks = torch.from_numpy(random_blocks(qtype, 37, k, seed=53))
    with torch_threads(2):
        got = tuple(
            hashlib.sha256(
                kernels().q_linear(x[:m], blocks, int(qtype)).numpy().tobytes()
            ).hexdigest()[:16]
            for m in (1, 8)
        )
    assert got == KERNEL_DIGESTS[qtype.name], qtype.name


# ---- Packed weights (q_pack): the layout the loader keeps where the build has vector paths

PACKS = KERNELS is not None and KERNELS.packs


def packed(blocks: torch.Tensor, qtype: GGMLQuantizationType, k: int) -> torch.Tensor:
    wp = kernels().q_pack(blocks, int(qtype), k)
    assert wp is not None
    return wp


@pytest.mark.skipif(not PACKS, reason="this build has no vector paths: nothing is packed")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_packed_weights_are_the_definition(qtype: GGMLQuantizationType) -> None:
    """Packed, every row count of ``ROW_COUNTS`` and 70 (one row, the 8- and 4-row passes
    and their tails; from 64 rows AMX's groups of 16 where the CPU has it, 70: four
    groups and a tail of 6; a second chunk of 256) on one thread and two equals the
    definition on the file's blocks, bit for bit; 37 outputs: a partial panel. Its rows read back are the file's dequantization, and it is the
    file's size (the k-quants with offsets 4 bytes more per 256 weights)."""
    k = kdim(qtype, 1536)
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(11)) * 3
    x[3] = 0.0
    x[5, :32] = TIES
    blocks = torch.from_numpy(random_blocks(qtype, 37, k, seed=11))
    wp = packed(blocks, qtype, k)
    extra = 4 * (k // 256) if qtype in (Q.Q4_K, Q.Q5_K) else 0
    assert wp.numel() == 48 * (blocks.shape[1] + extra)  # 37 rows padded to 3 panels of 16
    ref = kernels().q_linear_reference(x, blocks, int(qtype))
    for threads in (1, 2):
        with torch_threads(threads):
            for m in (*ROW_COUNTS, 70):
                y = kernels().q_linear_packed(x[:m], wp, int(qtype), 37)
                assert torch.equal(y, ref[:m]), (threads, m)
    ids = torch.tensor([36, 0, 17, 17, 5])
    assert torch.equal(
        kernels().q_packed_rows(wp, ids, int(qtype), 37, k),
        kernels().q_dequantize(blocks[ids].contiguous(), int(qtype), k),
    )


@pytest.mark.skipif(not PACKS, reason="this build has no vector paths: nothing is packed")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_packed_output_is_the_recorded_one(qtype: GGMLQuantizationType) -> None:
    """The same digests as the file's blocks give (``KERNEL_DIGESTS``): one function."""
    import hashlib

    k = kdim(qtype, 512)
    rng = np.random.default_rng(53)
    x = torch.from_numpy((rng.integers(-4096, 4096, (8, k)) / 512).astype(np.float32))
    wp = packed(torch.from_numpy(random_blocks(qtype, 37, k, seed=53)), qtype, k)
    with torch_threads(2):
        got = tuple(
            hashlib.sha256(
                kernels().q_linear_packed(x[:m], wp, int(qtype), 37).numpy().tobytes()
            ).hexdigest()[:16]
            for m in (1, 8)
        )
    assert got == KERNEL_DIGESTS[qtype.name], qtype.name


@pytest.mark.skipif(not PACKS, reason="this build has no vector paths: nothing is packed")
@pytest.mark.parametrize("isa", native_build.other_isas())
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_build_packs_and_computes_the_same_bits(
    qtype: GGMLQuantizationType, isa: str
) -> None:
    """Each build packs the same bytes (the layout is not the build's) and computes the
    same bits from them; the portable build packs nothing."""
    other = native.load_kernels_built_for(isa)
    k = kdim(qtype, 1536)
    blocks = torch.from_numpy(random_blocks(qtype, 51, k, seed=9))
    wp = packed(blocks, qtype, k)
    theirs = other.q_pack(blocks, int(qtype), k)
    if isa == "portable":
        assert theirs is None
        return
    assert theirs is not None and torch.equal(theirs, wp)
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(9))
    ref = kernels().q_linear_reference(x, blocks, int(qtype))
    for threads in (1, 2):
        with torch_threads(threads):
            for m in (*range(1, 21), 70):
                assert torch.equal(other.q_linear_packed(x[:m], wp, int(qtype), 51), ref[:m])


@pytest.mark.skipif(not PACKS, reason="this build has no vector paths: nothing is packed")
def test_parts_mix_packed_and_file_blocks() -> None:
    """A fused weight in parts of different types (Q4_K_M's q/k/v), some packed and some
    not: each part's columns are its own call's."""
    from gpu.model.quant import QuantLinear, QuantWeight

    k = 512
    q = QuantWeight(torch.from_numpy(random_blocks(Q.Q4_K, 40, k, seed=1)), Q.Q4_K, k)
    v = QuantWeight(torch.from_numpy(random_blocks(Q.Q6_K, 24, k, seed=2)), Q.Q6_K, k)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(4))
    want = torch.cat([QuantLinear(q, kernels())(x), QuantLinear(v, kernels())(x)], dim=1)
    for parts in ([q.packed(kernels()), v], [q, v.packed(kernels())],
                  [q.packed(kernels()), v.packed(kernels())]):  # fmt: skip
        assert torch.equal(QuantLinear(parts, kernels())(x), want)
    pq = q.packed(kernels())
    assert pq.shape == (40, k) and pq.packed(kernels()) is pq
    assert torch.equal(pq.rows(torch.tensor([[3, 39]])), q.rows(torch.tensor([[3, 39]])))


@pytest.mark.skipif(not PACKS, reason="this build has no vector paths: nothing is packed")
def test_packed_rejects_what_it_cannot_read() -> None:
    blocks = torch.from_numpy(random_blocks(Q.Q4_1, 20, 64, seed=0))
    wp = packed(blocks, Q.Q4_1, 64)
    with pytest.raises(ValueError, match="packed rows"):  # 20 rows pack to 2 panels, not 3
        kernels().q_linear_packed(torch.zeros(1, 64), wp, int(Q.Q4_1), 40)
    with pytest.raises(ValueError, match="packed rows"):
        kernels().q_linear_packed(torch.zeros(1, 64), wp, int(Q.Q8_0), 20)
    with pytest.raises(IndexError):
        kernels().q_packed_rows(wp, torch.tensor([20]), int(Q.Q4_1), 20, 64)
