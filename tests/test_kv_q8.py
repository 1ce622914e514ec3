"""The q8_0 KV cache (``--kv-cache-dtype q8_0``, issue 59, point 2): llama.cpp's
block_q8_0 per 32 values of a K or V row, written once by the fused trunk and read in
place by the native attention kernel.

The quantizer is held to a numpy transcription of llama.cpp's ``quantize_row_q8_0_ref``
byte for byte; the attention over a q8_0 cache to the same kernel over an fp32 cache of
the dequantized values (bit for bit: ``q * d`` is exact) and to an fp64 reference within
a derived bound; every build of the kernels to the same bits; an engine on the bundled
model to the same greedy tokens alone, batched, after a prefix-cache hit and chunked;
the disk tier to the blocks' bytes; the capacity in tokens to 34 bytes per 32 values.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gpu.cache.blocks import block_hash
from gpu.cache.disk import DiskLayout, DiskPrefixCache
from gpu.cache.kv_cache import kv_dtype_refusal, kv_storage_dtype, kv_value_bytes
from gpu.cache.memory import kv_bytes_per_token
from gpu.kernels import native, native_build
from gpu.kernels.native import KV_Q8
from gpu.model.loader import LoadedModel, load_model
from gpu.runtime.engine import Engine, EngineConfig
from gpu.worker.config import WorkerConfig, build_engine, kv_blocks_for
from tests.engine_runs import run_to_end
from tests.test_determinism import _SCRIPT as _MIXED_STEP
from tests.test_determinism import _TORCH_LEVEL
from tests.test_worker_engine import GREEDY, ids_of, prompts, run
from tests.tiny_gguf import TinyModel, TinySpec, write_tiny_gguf
from wire.worker_options import refused_combination

pytestmark = pytest.mark.skipif(
    native.load_kernels() is None, reason="a q8_0 cache is read by the native kernels only"
)
EPS = 2.0**-24  # fp32's unit roundoff
ROOT = Path(__file__).resolve().parent.parent


def _kernels() -> native.NativeKernels:
    k = native.load_kernels()
    assert k is not None
    return k


# -- the quantizer ---------------------------------------------------------------------------
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


def _awkward_rows() -> torch.Tensor:
    g = torch.Generator().manual_seed(59)
    x = torch.randn(40, 128, generator=g) * torch.logspace(-6, 3, 40)[:, None]
    x[0] = 0.0  # d = 0: every q 0
    x[1, :32] = torch.arange(-16, 16) + 0.5  # amax 16.5: ties appear after scaling
    x[1, 32:64] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.5] + [0.0] * 26)  # d = 1: x * id = x
    x[2, :32] = 1e-30  # d rounds to an fp16 zero, id from the fp32 d: q = 127
    x[3, :32] = 7e5  # d above fp16's range: stored as infinity, as llama.cpp does
    return x


def test_the_quantizer_is_llama_cpps_reference_byte_for_byte() -> None:
    x = _awkward_rows()
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


def test_every_build_quantizes_to_the_same_bytes() -> None:
    x = _awkward_rows()
    want = _kernels().kv_q8_quantize(x)
    for isa in native_build.other_isas():
        assert torch.equal(native.load_kernels_built_for(isa).kv_q8_quantize(x), want), isa


# -- attention over a q8_0 cache -------------------------------------------------------------
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


@pytest.mark.parametrize(("hd", "window"), [(64, 0), (32, 0), (64, 13), (128, 20)])
def test_attention_reads_the_dequantized_values(hd: int, window: int) -> None:
    """head_dim 64 (the AVX2 path) and 32 / 128 (the portable loop): the q8_0 cache gives
    the same bits as an fp32 cache holding ``q * d``, and within the derived bound of
    fp64 attention over those values; every build the same bits; a sequence alone the
    same as in the batch."""
    q, k, v, tables, lens = _case(hd, hd + window)
    kern, scale, bs = _kernels(), hd**-0.5, 16
    kq, vq = kern.kv_q8_quantize(k), kern.kv_q8_quantize(v)
    kf, vf = q8_dequantize(kq.numpy()), q8_dequantize(vq.numpy())
    got = kern.paged_attention(q, kq, vq, tables, lens, bs, scale, window)
    same = kern.paged_attention(q, torch.from_numpy(kf), torch.from_numpy(vf), tables, lens, bs,
                                scale, window)  # fmt: skip
    assert torch.equal(got, same)
    want, bound = _reference(q, kf, vf, tables, lens, bs, scale, window)
    assert (np.abs(got.double().numpy() - want) <= bound).all()
    alone = kern.paged_attention(q[3:4], kq, vq, tables[3:4], lens[3:4], bs, scale, window)
    assert torch.equal(alone, got[3:4])
    for isa in native_build.other_isas():
        other = native.load_kernels_built_for(isa)
        assert torch.equal(other.paged_attention(q, kq, vq, tables, lens, bs, scale, window),
                           got), isa  # fmt: skip


def test_rows_of_a_prompt_chunk_read_the_blocks_converted_once() -> None:
    """Consecutive rows of one table (a chunk: converted ahead once) equal each row alone."""
    q, k, v, _, _ = _case(64, 3)
    kern = _kernels()
    kq, vq = kern.kv_q8_quantize(k), kern.kv_q8_quantize(v)
    tables = torch.tensor([[2, 0, 5, 1, 3, 4]] * 5, dtype=torch.int32)
    lens = torch.tensor([60, 61, 62, 63, 64], dtype=torch.int32)
    run_ = kern.paged_attention(q, kq, vq, tables, lens, 16, 0.125)
    for s in range(5):
        one = kern.paged_attention(
            q[s : s + 1], kq, vq, tables[s : s + 1], lens[s : s + 1], 16, 0.125
        )
        assert torch.equal(one, run_[s : s + 1])


# test_determinism's mixed step of the fused trunk (decodes beside a fresh prompt and a
# chunk after a cached prefix) on a q8_0 cache: the digests of its logits and of the
# bytes it wrote.
_ANCHOR = "cache = PagedKVCache(lm.config, 24, bs)"
_SCRIPT = _MIXED_STEP.replace(_ANCHOR, _ANCHOR[:-1] + ", kv_dtype=torch.uint8)")


def _run_build(isa: str, model: Path, script: str = _SCRIPT) -> dict[str, object]:
    env = {**os.environ, "LIFECYCLE_NATIVE_ISA": isa, "PYTHONPATH": str(ROOT)}
    env.update(_TORCH_LEVEL.get(isa, {}))
    out = subprocess.run([sys.executable, "-c", script, str(model)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert isinstance(got, dict)
    got.pop("torch_cpu")  # the level torch was held to: the build's own
    return got


def test_every_build_runs_the_model_on_a_q8_cache_to_the_same_bits(hd32: TinyModel) -> None:
    """The default build against each other build: logits and every byte of the q8_0
    cache a mixed step wrote (the quantizer inside the trunk, then attention over it)."""
    assert _ANCHOR in _MIXED_STEP and "uint8" in _SCRIPT
    want = _run_build("auto", hd32.path)
    for isa in native_build.other_isas():
        assert _run_build(isa, hd32.path) == want, isa


# -- the engine on the bundled model ---------------------------------------------------------
def _engine(lm: LoadedModel, **kw: object) -> Engine:
    engine = Engine(lm, EngineConfig(**{"kv_blocks": 96, "block_size": 16,
                                        "kv_cache_dtype": "q8_0", **kw}))  # type: ignore[arg-type]  # fmt: skip
    assert engine.cache.element == "q8_0" and engine.runner.backends()["trunk"] == "fused"
    return engine


def test_greedy_tokens_alone_batched_cached_and_chunked_are_equal(cpu_model: LoadedModel) -> None:
    """SmolLM2 on a q8_0 cache: each prompt alone, all in one batch, again after its
    prefix is cached (all but its last token read from the cache), and prefilled in
    chunks of 16: the same greedy tokens. The rows the trunk wrote are q8_0 rows: their
    values ``q * d`` quantize back to the same bytes."""
    lm = cpu_model
    ps = prompts(3, lm.config.vocab_size, seed=59, lo=40, hi=90)
    s = {**GREEDY, "max_new_tokens": 8}
    alone = [run_to_end(_engine(lm), [p], [s])[0] for p in ps]
    assert run_to_end(_engine(lm), ps, [s] * 3) == alone
    chunked = _engine(lm, step_tokens=16, mixed_prefill_tokens=16)
    assert run_to_end(chunked, ps, [s] * 3) == alone
    engine = _engine(lm)
    first = run(engine, [(1, ps[0], s, {})])[1]
    again = run(engine, [(2, ps[0], s, {})])[2]
    assert ids_of(first) == ids_of(again) == alone[0]
    assert again[0].extra["cached_tokens"] == len(ps[0]) - 1  # to the token
    for t in (engine.cache.k, engine.cache.v):
        rows = t.flatten(0, 2)
        rows = rows[(rows != 0).any(-1)]  # the written ones
        assert len(rows) >= 30 * 3 * len(ps[0])  # every layer and kv head of the prompt
        values = torch.from_numpy(q8_dequantize(rows.numpy()))
        assert torch.equal(_kernels().kv_q8_quantize(values), rows)


# -- the disk tier ---------------------------------------------------------------------------
Q8_LAYOUT = DiskLayout("ab" * 16, "q8_0", n_layers=2, n_kv_heads=2, block_size=4, head_dim=64)
TOKENS = (5, 6, 7, 8)


def test_a_q8_block_file_reads_back_byte_for_byte_and_fp16_refuses_it(tmp_path: Path) -> None:
    assert Q8_LAYOUT.shape == (2, 2, 4, 68) and Q8_LAYOUT.dtype == torch.uint8
    assert Q8_LAYOUT.payload_bytes == 2 * 2 * 2 * 4 * 68
    g = torch.Generator().manual_seed(1)
    k, v = (_kernels().kv_q8_quantize(torch.randn(2, 2, 4, 64, generator=g)) for _ in range(2))
    key = block_hash(None, TOKENS)
    assert DiskPrefixCache(tmp_path, 1 << 20, Q8_LAYOUT).put(key, None, TOKENS, k, v)
    got = DiskPrefixCache(tmp_path, 1 << 20, Q8_LAYOUT).get(key, None, TOKENS)
    assert got is not None and torch.equal(got[0], k) and torch.equal(got[1], v)
    fp16 = DiskLayout("ab" * 16, "float16", n_layers=2, n_kv_heads=2, block_size=4, head_dim=64)
    store = DiskPrefixCache(tmp_path, 1 << 20, fp16)
    assert store.get(key, None, TOKENS) is None and store.dropped == 1
    assert not store.path(key).exists()


@pytest.fixture(scope="module")
def hd32(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """The tiny model with head_dim 32 (128 wide, 4 heads): q8_0 takes it."""
    spec = TinySpec(hidden=128, context_length=1024)
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "hd32.gguf", spec)


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


def test_the_disk_tier_carries_q8_blocks_to_a_new_engine(hd32: TinyModel, tmp_path: Path) -> None:
    """A q8_0 engine spills its cached blocks; a new q8_0 engine on the directory reads
    them back (the cold run's tokens, the prefix cached); an fp16 engine refuses them."""
    other = disk_round_trip(hd32.path, tmp_path, "q8_0", "auto", seed=8)
    assert other.cache.element == "float16"


# -- where it runs, and what it holds --------------------------------------------------------
@pytest.mark.parametrize(
    ("values", "why"),
    [
        ({"kv_cache_dtype": "q8_0", "device": "cuda"}, "use --device cpu"),
        ({"kv_cache_dtype": "q8_0", "device": "cpu", "weights": "fp32"}, "quantized weights"),
        ({"kv_cache_dtype": "q8_0", "kernels": "triton"}, "quantized weights"),
        ({"kv_cache_dtype": "q8_0", "tp": 2}, "leave --kv-cache-dtype at auto"),
    ],
)
def test_q8_is_refused_where_the_native_kernels_do_not_read_it(values: dict, why: str) -> None:
    got = refused_combination(values)
    assert got is not None and why in got
    assert refused_combination({"kv_cache_dtype": "q8_0", "device": "cpu"}) is None


def test_the_engine_refuses_q8_without_the_fused_trunk(
    tiny_gguf: TinyModel, hd32: TinyModel
) -> None:
    cpu = torch.device("cpu")
    assert "dense weights" in (kv_dtype_refusal("q8_0", cpu, False, 64) or "")
    assert "--device cpu" in (kv_dtype_refusal("q8_0", torch.device("cuda"), True, 64) or "")
    assert kv_dtype_refusal("fp16", cpu, False, 64) is None
    with pytest.raises(SystemExit, match="head_dim 16 is not a multiple of 32"):
        build_engine(WorkerConfig(model_path=str(tiny_gguf.path), device="cpu",
                                  kv_cache_dtype="q8_0", kv_memory_mib=1))  # fmt: skip
    with pytest.raises(SystemExit, match="quantized weights"):
        build_engine(WorkerConfig(model_path=str(hd32.path), device="cpu", weights="fp32",
                                  kv_cache_dtype="q8_0", kv_memory_mib=1))  # fmt: skip
    # the torch path never reads a q8_0 cache: it says so rather than misread the bytes
    lm = load_model(hd32.path, device="cpu", weights="quantized")
    torch_path = Engine(lm, EngineConfig(kv_blocks=8, block_size=16, kv_cache_dtype="q8_0",
                                         fuse_trunk=False))  # fmt: skip
    with pytest.raises(RuntimeError, match="fused native trunk only"):
        run(torch_path, [(1, [5, 6, 7], {**GREEDY, "max_new_tokens": 2}, {})])


def test_capacity_in_tokens_is_34_bytes_per_32_values(hd32: TinyModel) -> None:
    """In the same memory a q8_0 cache holds 64 / 34 the tokens of fp16 (0.53x the bytes a
    token); the worker sizes it so and reports it (HELLO's capacity: /server_info)."""
    from gpu.worker.info import hello

    assert kv_value_bytes(KV_Q8) == 34 / 32 and kv_value_bytes(torch.float16) == 2
    assert kv_storage_dtype("q8_0", torch.device("cpu"), torch.float32, True) == KV_Q8
    sizes = {}
    for kv in ("auto", "q8_0"):
        config = WorkerConfig(model_path=str(hd32.path), device="cpu", weights="quantized",
                              kv_cache_dtype=kv, kv_memory_mib=4)  # fmt: skip
        engine = build_engine(config)
        cap = hello(engine).capacity
        per_token = 2 * 2 * 2 * 32 * (2 if kv == "auto" else 34 / 32)  # K, V x layers x heads
        assert cap["kv_bytes_per_token"] == engine.cache.bytes_per_token() == per_token
        assert kv_bytes_per_token(engine.mc, kv_value_bytes(engine.cache.k.dtype)) == per_token
        blocks = kv_blocks_for(config, 2, 2, 32, kv_value_bytes(engine.cache.k.dtype))
        assert engine.config.kv_blocks == blocks == int(4 * 2**20 // per_token) // 16
        sizes[cap["kv_dtype"]] = (per_token, blocks)
    assert sizes["q8_0"][0] / sizes["float16"][0] == 34 / 64
    assert sizes["q8_0"][1] >= sizes["float16"][1] * 64 // 34
    # SmolLM2's shape: 30 layers, 3 KV heads, head_dim 64
    assert 2 * 30 * 3 * 64 * kv_value_bytes(KV_Q8) == 12240 == 23040 * 34 / 64
