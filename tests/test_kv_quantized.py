"""The quantized KV caches, q8_0 and q4_0 (``--kv-cache-dtype q8_0`` / ``q4_0``, issue 59,
point 2), in the model, the engine and the worker: llama.cpp's blocks per 32 values of a
K or V row, each row rotated and quantized by the kernels' one writer on the fused trunk
and the torch path alike (``tests/test_kv_rows.py`` holds the rows and the attention
kernel to their definitions). Both are held as uint8 tensors: the element (``KV_Q8``,
``KV_Q4``) says which, decided where the cache is built; a bare uint8 is refused.

The same test for both elements, parametrized (ids ``q8_0``, ``q4_0``): every build of the
kernels runs a mixed step to the same bits; an engine on the bundled model gives the same
greedy tokens alone, batched, after a prefix-cache hit and chunked; the torch path (fp32
weights) stores the writer's rows and attends to their values, and the worker serves it;
the disk tier carries the blocks' bytes, refused by every other element; the refusals
name where the native kernels do not read it; the capacity in tokens follows 34 (q8_0)
or 18 (q4_0) bytes per 32 values.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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
from gpu.kernels.kv_element import KV_Q4, KV_Q8, KVElement, kv_element, kv_row_width
from gpu.model.loader import LoadedModel, load_model
from gpu.runtime.engine import Engine, EngineConfig
from gpu.worker.config import WorkerConfig, build_engine, kv_blocks_for
from tests.engine_runs import run_to_end
from tests.test_determinism import _SCRIPT as _MIXED_STEP
from tests.test_determinism import _TORCH_LEVEL
from tests.test_kv_rows import BLOCK_BYTES, DEQUANTIZE, ELEMENTS, _kernels, _quantize
from tests.test_worker_engine import GREEDY, ids_of, prompts, run
from tests.tiny_gguf import TinyModel, TinySpec, write_tiny_gguf
from wire.worker_options import KV_CACHE_DTYPES, refused_combination

pytestmark = pytest.mark.skipif(
    native.load_kernels() is None, reason="q8_0 and q4_0 caches are read by the native kernels only"
)
ROOT = Path(__file__).resolve().parent.parent


# test_determinism's mixed step of the fused trunk (decodes beside a fresh prompt and a
# chunk after a cached prefix) on a quantized cache, its element named: the digests of
# its logits and of the bytes it wrote.
_ANCHOR = "cache = PagedKVCache(lm.config, 24, bs)"


def _mixed_step(elem: KVElement) -> str:
    name = {"q8_0": "KV_Q8", "q4_0": "KV_Q4"}[elem.name]
    return _MIXED_STEP.replace(
        _ANCHOR,
        f"from gpu.kernels.kv_element import {name}\n" + _ANCHOR[:-1] + f", kv_dtype={name})",
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
