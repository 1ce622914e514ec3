"""The q4_0 KV cache (``--kv-cache-dtype q4_0``), beside q8_0 (tests/test_kv_q8.py): llama.cpp's
block_q4_0 per 32 values of a K or V row (an fp16 scale, 16 bytes of 4-bit values), written
once by the fused trunk and read in place by the native attention kernel as ``(q - 8) * d``.

The quantizer is held to a numpy transcription of llama.cpp's ``quantize_row_q4_0_ref``
byte for byte (ties, zeros, the signed maximum, extremes); the attention over a q4_0
cache to the same kernel over an fp32 cache of the dequantized values (bit for bit:
``(q - 8) * d`` is exact) and to an fp64 reference within a derived bound; every build
of the kernels to the same bits; an engine on the bundled model to the same greedy
tokens alone, batched, after a prefix-cache hit and chunked; the disk tier to the
blocks' bytes, refused by a q8_0 or fp16 cache; the capacity to 18 bytes per 32 values.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from gpu.cache.blocks import block_hash
from gpu.cache.disk import DiskLayout, DiskPrefixCache
from gpu.cache.kv_cache import PagedKVCache, kv_dtype_refusal, kv_storage_dtype, kv_value_bytes
from gpu.cache.memory import kv_bytes_per_token
from gpu.kernels import native, native_build
from gpu.kernels.native import KV_Q4, KV_Q8, kv_element
from gpu.model.loader import LoadedModel, load_model
from gpu.runtime.engine import Engine, EngineConfig
from gpu.worker.config import WorkerConfig, build_engine, kv_blocks_for
from tests.engine_runs import run_to_end
from tests.test_kv_q8 import _ANCHOR, _MIXED_STEP, _case, _reference, _run_build, disk_round_trip
from tests.test_worker_engine import GREEDY, ids_of, prompts, run
from tests.tiny_gguf import TinyModel, TinySpec, write_tiny_gguf
from wire.worker_options import KV_CACHE_DTYPES, refused_combination

pytestmark = pytest.mark.skipif(
    native.load_kernels() is None, reason="a q4_0 cache is read by the native kernels only"
)
ROOT = Path(__file__).resolve().parent.parent


def _kernels() -> native.NativeKernels:
    k = native.load_kernels()
    assert k is not None
    return k


# -- the quantizer ---------------------------------------------------------------------------
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


def _awkward_rows() -> torch.Tensor:
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


def test_the_quantizer_is_llama_cpps_reference_byte_for_byte() -> None:
    x = _awkward_rows()
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


def test_every_build_quantizes_to_the_same_bytes() -> None:
    x = _awkward_rows()
    want = _kernels().kv_q4_quantize(x)
    for isa in native_build.other_isas():
        assert torch.equal(native.load_kernels_built_for(isa).kv_q4_quantize(x), want), isa


# -- attention over a q4_0 cache -------------------------------------------------------------
@pytest.mark.parametrize(("hd", "window"), [(64, 0), (32, 0), (64, 13), (128, 20)])
def test_attention_reads_the_dequantized_values(hd: int, window: int) -> None:
    """head_dim 64 (the AVX2 path) and 32 / 128 (the portable loop): the q4_0 cache gives
    the same bits as an fp32 cache holding ``(q - 8) * d``, and within the derived bound
    of fp64 attention over those values; every build the same bits; a sequence alone the
    same as in the batch; the rows unnamed are read as q8_0 and refused for their width."""
    q, k, v, tables, lens = _case(hd, hd + window + 4)
    kern, scale, bs = _kernels(), hd**-0.5, 16
    kq, vq = kern.kv_q4_quantize(k), kern.kv_q4_quantize(v)
    kf, vf = q4_dequantize(kq.numpy()), q4_dequantize(vq.numpy())
    got = kern.paged_attention(q, kq, vq, tables, lens, bs, scale, window, element=KV_Q4)
    same = kern.paged_attention(q, torch.from_numpy(kf), torch.from_numpy(vf), tables, lens, bs,
                                scale, window)  # fmt: skip
    assert torch.equal(got, same)
    want, bound = _reference(q, kf, vf, tables, lens, bs, scale, window)
    assert (np.abs(got.double().numpy() - want) <= bound).all()
    alone = kern.paged_attention(q[3:4], kq, vq, tables[3:4], lens[3:4], bs, scale, window,
                                 element=KV_Q4)  # fmt: skip
    assert torch.equal(alone, got[3:4])
    for isa in native_build.other_isas():
        other = native.load_kernels_built_for(isa)
        assert torch.equal(other.paged_attention(q, kq, vq, tables, lens, bs, scale, window,
                                                 element=KV_Q4), got), isa  # fmt: skip
    with pytest.raises(ValueError, match="do not hold head_dim"):
        kern.paged_attention(q, kq, vq, tables, lens, bs, scale, window)  # uint8: q8_0


def test_rows_of_a_prompt_chunk_read_the_blocks_converted_once() -> None:
    """Consecutive rows of one table (a chunk: converted ahead once) equal each row alone."""
    q, k, v, _, _ = _case(64, 5)
    kern = _kernels()
    kq, vq = kern.kv_q4_quantize(k), kern.kv_q4_quantize(v)
    tables = torch.tensor([[2, 0, 5, 1, 3, 4]] * 5, dtype=torch.int32)
    lens = torch.tensor([60, 61, 62, 63, 64], dtype=torch.int32)
    run_ = kern.paged_attention(q, kq, vq, tables, lens, 16, 0.125, element=KV_Q4)
    for s in range(5):
        one = kern.paged_attention(q[s : s + 1], kq, vq, tables[s : s + 1], lens[s : s + 1], 16,
                                   0.125, element=KV_Q4)  # fmt: skip
        assert torch.equal(one, run_[s : s + 1])


# test_determinism's mixed step of the fused trunk on a q4_0 cache: the digests of its
# logits and of the bytes it wrote.
_SCRIPT = _MIXED_STEP.replace(
    _ANCHOR, "from gpu.kernels.native import KV_Q4\n" + _ANCHOR[:-1] + ", kv_dtype=KV_Q4)"
)


@pytest.fixture(scope="module")
def hd32(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """The tiny model with head_dim 32 (128 wide, 4 heads): q4_0 takes it."""
    spec = TinySpec(hidden=128, context_length=1024)
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "hd32.gguf", spec)


def test_every_build_runs_the_model_on_a_q4_cache_to_the_same_bits(hd32: TinyModel) -> None:
    """The default build against each other build: logits and every byte of the q4_0
    cache a mixed step wrote (the quantizer inside the trunk, then attention over it)."""
    assert _ANCHOR in _MIXED_STEP and "KV_Q4)" in _SCRIPT
    want = _run_build("auto", hd32.path, _SCRIPT)
    for isa in native_build.other_isas():
        assert _run_build(isa, hd32.path, _SCRIPT) == want, isa


# -- the engine on the bundled model ---------------------------------------------------------
def _engine(lm: LoadedModel, **kw: object) -> Engine:
    engine = Engine(lm, EngineConfig(**{"kv_blocks": 96, "block_size": 16,
                                        "kv_cache_dtype": "q4_0", **kw}))  # type: ignore[arg-type]  # fmt: skip
    assert engine.cache.element == "q4_0" and engine.cache.kv_element == KV_Q4
    assert engine.runner.backends()["trunk"] == "fused"
    return engine


def test_greedy_tokens_alone_batched_cached_and_chunked_are_equal(cpu_model: LoadedModel) -> None:
    """SmolLM2 on a q4_0 cache: each prompt alone, all in one batch, again after its
    prefix is cached (all but its last token read from the cache), and prefilled in
    chunks of 16: the same greedy tokens. The rows the trunk wrote are q4_0 rows (18
    bytes a block): their values ``(q - 8) * d`` quantize back to the same bytes."""
    lm = cpu_model
    ps = prompts(3, lm.config.vocab_size, seed=40, lo=40, hi=90)
    s = {**GREEDY, "max_new_tokens": 8}
    alone = [run_to_end(_engine(lm), [p], [s])[0] for p in ps]
    assert run_to_end(_engine(lm), ps, [s] * 3) == alone
    chunked = _engine(lm, step_tokens=16, mixed_prefill_tokens=16)
    assert run_to_end(chunked, ps, [s] * 3) == alone
    engine = _engine(lm)
    assert engine.cache.k.shape[-1] == lm.config.head_dim // 32 * 18
    first = run(engine, [(1, ps[0], s, {})])[1]
    again = run(engine, [(2, ps[0], s, {})])[2]
    assert ids_of(first) == ids_of(again) == alone[0]
    assert again[0].extra["cached_tokens"] == len(ps[0]) - 1  # to the token
    for t in (engine.cache.k, engine.cache.v):
        rows = t.flatten(0, 2)
        rows = rows[(rows != 0).any(-1)]  # the written ones
        assert len(rows) >= 30 * 3 * len(ps[0])  # every layer and kv head of the prompt
        values = torch.from_numpy(q4_dequantize(rows.numpy()))
        assert torch.equal(_kernels().kv_q4_quantize(values), rows)


# -- the disk tier ---------------------------------------------------------------------------
Q4_LAYOUT = DiskLayout("ab" * 16, "q4_0", n_layers=2, n_kv_heads=2, block_size=4, head_dim=64)
TOKENS = (5, 6, 7, 8)


@pytest.mark.parametrize("other", ["q8_0", "float16"])
def test_a_q4_block_file_reads_back_byte_for_byte_and_others_refuse_it(
    other: str, tmp_path: Path
) -> None:
    assert Q4_LAYOUT.shape == (2, 2, 4, 36) and Q4_LAYOUT.dtype == torch.uint8
    assert Q4_LAYOUT.element == KV_Q4 and Q4_LAYOUT.payload_bytes == 2 * 2 * 2 * 4 * 36
    g = torch.Generator().manual_seed(2)
    k, v = (_kernels().kv_q4_quantize(torch.randn(2, 2, 4, 64, generator=g)) for _ in range(2))
    key = block_hash(None, TOKENS)
    assert DiskPrefixCache(tmp_path, 1 << 20, Q4_LAYOUT).put(key, None, TOKENS, k, v)
    got = DiskPrefixCache(tmp_path, 1 << 20, Q4_LAYOUT).get(key, None, TOKENS)
    assert got is not None and torch.equal(got[0], k) and torch.equal(got[1], v)
    layout = DiskLayout("ab" * 16, other, n_layers=2, n_kv_heads=2, block_size=4, head_dim=64)
    store = DiskPrefixCache(tmp_path, 1 << 20, layout)
    assert store.get(key, None, TOKENS) is None and store.dropped == 1
    assert not store.path(key).exists()


def test_a_q8_block_file_is_refused_by_a_q4_cache(tmp_path: Path) -> None:
    q8 = DiskLayout("ab" * 16, "q8_0", n_layers=2, n_kv_heads=2, block_size=4, head_dim=64)
    g = torch.Generator().manual_seed(3)
    k, v = (_kernels().kv_q8_quantize(torch.randn(2, 2, 4, 64, generator=g)) for _ in range(2))
    key = block_hash(None, TOKENS)
    assert DiskPrefixCache(tmp_path, 1 << 20, q8).put(key, None, TOKENS, k, v)
    store = DiskPrefixCache(tmp_path, 1 << 20, Q4_LAYOUT)
    assert store.get(key, None, TOKENS) is None and store.dropped == 1


def test_the_disk_tier_carries_q4_blocks_to_a_new_engine(hd32: TinyModel, tmp_path: Path) -> None:
    """A q4_0 engine spills its cached blocks; a new q4_0 engine on the directory reads
    them back (the cold run's tokens, the prefix cached); a q8_0 engine refuses them."""
    other = disk_round_trip(hd32.path, tmp_path, "q4_0", "q8_0", seed=9)
    assert other.cache.element == "q8_0"


# -- where it runs, and what it holds --------------------------------------------------------
@pytest.mark.parametrize(
    ("values", "why"),
    [
        ({"kv_cache_dtype": "q4_0", "device": "cuda"}, "q4_0 is read by the CPU's native"),
        ({"kv_cache_dtype": "q4_0", "device": "cpu", "weights": "fp32"}, "quantized weights"),
        ({"kv_cache_dtype": "q4_0", "kernels": "triton"}, "quantized weights"),
        ({"kv_cache_dtype": "q4_0", "tp": 2}, "leave --kv-cache-dtype at auto"),
    ],
)
def test_q4_is_refused_where_the_native_kernels_do_not_read_it(values: dict, why: str) -> None:
    assert "q4_0" in KV_CACHE_DTYPES
    got = refused_combination(values)
    assert got is not None and why in got
    assert refused_combination({"kv_cache_dtype": "q4_0", "device": "cpu"}) is None


def test_the_engine_refuses_q4_without_the_fused_trunk(
    tiny_gguf: TinyModel, hd32: TinyModel
) -> None:
    cpu = torch.device("cpu")
    assert "q4_0 is read by the native fused trunk" in (
        kv_dtype_refusal("q4_0", cpu, False, 64) or ""
    )
    assert "--device cpu" in (kv_dtype_refusal("q4_0", torch.device("cuda"), True, 64) or "")
    with pytest.raises(SystemExit, match="q4_0 stores blocks of 32 values: head_dim 16"):
        build_engine(WorkerConfig(model_path=str(tiny_gguf.path), device="cpu",
                                  kv_cache_dtype="q4_0", kv_memory_mib=1))  # fmt: skip
    with pytest.raises(SystemExit, match="quantized weights"):
        build_engine(WorkerConfig(model_path=str(hd32.path), device="cpu", weights="fp32",
                                  kv_cache_dtype="q4_0", kv_memory_mib=1))  # fmt: skip
    # the torch path never reads a q4_0 cache: it says so rather than misread the bytes
    lm = load_model(hd32.path, device="cpu", weights="quantized")
    torch_path = Engine(lm, EngineConfig(kv_blocks=8, block_size=16, kv_cache_dtype="q4_0",
                                         fuse_trunk=False))  # fmt: skip
    with pytest.raises(RuntimeError, match="q4_0 KV cache is written and read by the fused"):
        run(torch_path, [(1, [5, 6, 7], {**GREEDY, "max_new_tokens": 2}, {})])


def test_the_element_is_the_caches_own_not_its_dtypes(hd32: TinyModel) -> None:
    """q8_0 and q4_0 are both uint8 tensors: each cache holds the element it was built
    with (a bare uint8 is q8_0, what callers before q4_0 pass)."""
    lm = load_model(hd32.path, device="cpu", weights="quantized")
    q4 = PagedKVCache(lm.config, 4, 16, kv_dtype=KV_Q4)
    q8 = PagedKVCache(lm.config, 4, 16, kv_dtype=torch.uint8)
    assert q4.k.dtype == q8.k.dtype == torch.uint8
    assert (q4.element, q8.element, q8.kv_element) == ("q4_0", "q8_0", KV_Q8)
    assert q4.k.shape[-1] == 18 and q8.k.shape[-1] == 34
    assert kv_element(torch.uint8) == KV_Q8 and kv_element(KV_Q4) == KV_Q4


def test_capacity_in_tokens_is_18_bytes_per_32_values(hd32: TinyModel) -> None:
    """In the same memory a q4_0 cache holds 64 / 18 the tokens of fp16 (0.28x the bytes a
    token); the worker sizes it so and reports it (HELLO's capacity: /server_info)."""
    from gpu.worker.info import hello

    assert kv_value_bytes(KV_Q4) == 18 / 32
    assert kv_storage_dtype("q4_0", torch.device("cpu"), torch.float32, True) == KV_Q4
    sizes = {}
    for kv in ("auto", "q8_0", "q4_0"):
        config = WorkerConfig(model_path=str(hd32.path), device="cpu", weights="quantized",
                              kv_cache_dtype=kv, kv_memory_mib=4)  # fmt: skip
        engine = build_engine(config)
        cap = hello(engine).capacity
        value = {"auto": 2, "q8_0": 34 / 32, "q4_0": 18 / 32}[kv]
        per_token = 2 * 2 * 2 * 32 * value  # K, V x layers x heads x head_dim
        assert cap["kv_bytes_per_token"] == engine.cache.bytes_per_token() == per_token
        elem = kv_value_bytes(engine.cache.kv_element)
        assert kv_bytes_per_token(engine.mc, elem) == per_token
        blocks = kv_blocks_for(config, 2, 2, 32, elem)
        assert engine.config.kv_blocks == blocks == int(4 * 2**20 // per_token) // 16
        sizes[cap["kv_dtype"]] = (per_token, blocks)
    assert sizes["q4_0"][0] / sizes["float16"][0] == 18 / 64
    assert sizes["q4_0"][1] >= sizes["float16"][1] * 64 // 18
    # SmolLM2's shape: 30 layers, 3 KV heads, head_dim 64
    assert 2 * 30 * 3 * 64 * kv_value_bytes(KV_Q4) == 6480 == 23040 * 18 / 64
