"""The C decode-attention kernel (gpu/kernels/native.py) against the torch path it replaces.

Both run through ``PagedKVCache`` on the same cache contents and block tables: the
AVX2 head_dim-64 path (the default model's shape) and the generic loops (any other
head_dim), short and long contexts, partial last blocks, strided query rows, and
batch invariance (a sequence's output does not depend on its neighbours).
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
import torch

from gpu.cache.kv_cache import PagedKVCache
from gpu.kernels import native
from modelfile.config import ModelConfig

pytestmark = pytest.mark.skipif(
    native.load_kernels() is None,
    reason="native kernels off (LIFECYCLE_NATIVE=0) or not buildable here (no C compiler, "
    "or one without OpenMP): the "
    "torch path is what runs, and the rest of the suite tests it",
)


def attention_shape(n_heads: int = 9, n_kv_heads: int = 3, head_dim: int = 64) -> ModelConfig:
    """A two-layer model of the default model's attention shape (or another), Llama's
    layer: no custom query scale, no score cap, no sliding window."""
    return ModelConfig("llama", 2, n_heads * head_dim, 4 * n_heads * head_dim, n_heads,
                       n_kv_heads, head_dim, 1e4, 1e-5, 256, 300, True, 1, 2, (2,), False,
                       "shape")  # fmt: skip


def caches(
    shape: ModelConfig, num_blocks: int, block_size: int, kv_dtype: torch.dtype = torch.float32
) -> tuple[PagedKVCache, PagedKVCache]:
    """The torch path's cache and the native one, both storing ``kv_dtype``, filled alike."""
    ref = PagedKVCache(shape, num_blocks, block_size, native=False, kv_dtype=kv_dtype)
    nat = PagedKVCache(shape, num_blocks, block_size, native=True, kv_dtype=kv_dtype)
    g = torch.Generator().manual_seed(1)
    ref.k.copy_(torch.randn(ref.k.shape, generator=g))
    ref.v.copy_(torch.randn(ref.v.shape, generator=g))
    nat.k.copy_(ref.k)
    nat.v.copy_(ref.v)
    assert nat.k.dtype == ref.k.dtype == kv_dtype
    return ref, nat


def decode_batch(
    rng: random.Random, num_blocks: int, block_size: int, lens: list[int]
) -> list[tuple[list[int], int]]:
    free = list(range(num_blocks))
    rng.shuffle(free)
    out = []
    for n in lens:
        nb = -(-n // block_size)
        out.append(([free.pop() for _ in range(nb)], n))
    return out


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    ("shape", "block_size"),
    [
        (attention_shape(), 16),
        (attention_shape(), 5),
        (attention_shape(n_heads=4, n_kv_heads=2, head_dim=24), 16),
    ],
    ids=["hd64-bs16", "hd64-bs5", "hd24-generic"],
)
def test_native_decode_matches_the_torch_path(
    shape: ModelConfig, block_size: int, kv_dtype: torch.dtype
) -> None:
    """The C kernel against the torch path on the same cache: both store the new keys
    rounded alike (torch's conversion and F16C round to nearest even) and attend to the
    stored values, so only the summation order differs (fp32 noise)."""
    rng = random.Random(0)
    num_blocks = 16384 // block_size  # room for 24 sequences of up to 300 tokens
    ref, nat = caches(shape, num_blocks, block_size, kv_dtype)
    assert nat.kernels is not None and ref.kernels is None
    for lens in ([1], [7, 1, 33], [17] * 8, [rng.randrange(1, 300) for _ in range(24)]):
        decodes = decode_batch(rng, num_blocks, block_size, lens)
        ref.prepare(decodes, [])
        nat.prepare(decodes, [])
        d, h, kv, hd = len(lens), shape.n_heads, shape.n_kv_heads, shape.head_dim
        # q as the model passes it: a slice of the fused q|k rows (strided, not contiguous)
        qk = torch.randn(d, h + kv, hd)
        q, k, v = qk[:, :h], qk[:, h:], torch.randn(d, kv, hd)
        assert d == 1 or not q.is_contiguous()
        for layer in range(shape.n_layers):
            want, got = ref(layer, q, k, v), nat(layer, q, k, v)
            assert got.shape == want.shape == (d, h, hd)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
        if kv_dtype == torch.float16:  # both wrote the step's keys as fp16, rounded alike
            assert torch.equal(nat.k, ref.k) and torch.equal(nat.v, ref.v)


def test_native_output_of_a_sequence_does_not_depend_on_the_batch() -> None:
    rng = random.Random(3)
    _, nat = caches(attention_shape(), 128, 16)
    decodes = decode_batch(rng, 128, 16, [40, 90, 5, 130])
    q, k, v = torch.randn(4, 9, 64), torch.randn(4, 3, 64), torch.randn(4, 3, 64)
    nat.prepare(decodes, [])
    together = nat(0, q, k, v)
    for i in range(4):
        nat.prepare([decodes[i]], [])
        alone = nat(0, q[i : i + 1], k[i : i + 1], v[i : i + 1])
        assert torch.equal(alone[0], together[i])


def test_build_failure_or_opt_out_falls_back_to_torch(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setenv("LIFECYCLE_KERNEL_CACHE", str(tmp_path / "k"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger="gpu.kernels.native"):
        assert native.load_kernels() is None
    assert "no C compiler" in caplog.text
    cache = PagedKVCache(attention_shape(), 8, 16)
    assert cache.kernels is None
    with pytest.raises(RuntimeError, match="unavailable"):
        PagedKVCache(attention_shape(), 8, 16, native=True)
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.delenv("CC")
    monkeypatch.setenv("LIFECYCLE_NATIVE", "0")
    assert native.load_kernels() is None


def test_built_library_is_cached_by_source_and_flags(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setenv("LIFECYCLE_KERNEL_CACHE", str(tmp_path))
    first = native.load_kernels()
    assert first is not None and first.path.parent == tmp_path
    built = first.path.stat().st_mtime_ns
    monkeypatch.setattr(native, "_loaded", {})
    again = native.load_kernels()
    assert again is not None and again.path == first.path
    assert again.path.stat().st_mtime_ns == built  # loaded, not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [first.path.name]  # no temp files left


@pytest.mark.parametrize(("n", "k"), [(960, 576), (576, 1536), (8, 3), (48, 77)])
@pytest.mark.parametrize("rows", [1, 2])
def test_small_linear_matches_f_linear(n: int, k: int, rows: int) -> None:
    kernels = native.load_kernels()
    assert kernels is not None
    g = torch.Generator().manual_seed(n * k + rows)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(rows, k, generator=g)
    got = kernels.small_linear(x, kernels.interleave(w))
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-4)
    # a strided x (a row slice of a wider tensor) gives the same result
    wide = torch.randn(rows, k + 5, generator=g)
    torch.testing.assert_close(
        kernels.small_linear(wide[:, :k], kernels.interleave(w)),
        torch.nn.functional.linear(wide[:, :k], w),
        rtol=1e-5,
        atol=1e-4,
    )


def test_packed_linear_uses_the_kernel_at_one_or_two_rows_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gpu.model.decoder import PackedLinear

    lin = PackedLinear(torch.randn(64, 32))
    assert lin.interleaved is not None and lin.kernels is not None
    calls: list[int] = []
    real = type(lin.kernels).small_linear
    monkeypatch.setattr(
        type(lin.kernels),
        "small_linear",
        lambda self, x, w8: calls.append(x.shape[0]) or real(self, x, w8),
    )
    for rows in (1, 2, 3, 32):
        x = torch.randn(rows, 32)
        torch.testing.assert_close(lin(x), x @ lin.weight.T, rtol=1e-5, atol=1e-4)
    assert calls == [1, 2]
    assert PackedLinear(torch.randn(60, 32)).interleaved is None  # rows not a multiple of 8


def test_loading_the_library_leaves_subnormal_floats_alone() -> None:
    """Regression: linking with -ffast-math pulls in crtfastmath.o, whose constructor
    sets flush-to-zero / denormals-are-zero for the whole process when the library
    loads (hypothesis then refused to generate floats in unrelated tests)."""
    import numpy as np

    assert native.load_kernels() is not None
    tiny = np.float32(1e-40)  # subnormal in fp32
    assert tiny * np.float32(1.0) != 0 and float(tiny) * 1.0 != 0
    x = torch.tensor([1e-40], dtype=torch.float32)
    assert (x * 1.0).item() != 0
