"""The fused trunk (``gpu/fused.py`` over ``gpu/csrc/fused_trunk.c``) against the torch
path it replaces for steps of decodes and short prompt chunks, quantized weights, CPU.

Both paths run the same q_linear and paged-attention kernels; the fused one computes
the norms, RoPE, the cache write and SwiGLU in C in another summation order. The
first layer therefore agrees to fp32 rounding. Past it, the int8 rounding of each
matmul's input (llama.cpp's, ``gpu/quant.py``) now and then moves one value by a
quantum, as any change of summation order does (``tests/test_model.py``,
``INVARIANCE``): on the bundled model (measured: 0.79 apart at most, logit std 6.9,
every argmax equal) logits are held to the same bounds as batched-against-alone; the
2-layer tiny model, where no value lands near a rounding boundary, to 1e-3.
"""

from __future__ import annotations

import pytest
import torch

from gpu import native
from gpu.kv_cache import ROW_QUERY_MAX_CHUNK, PagedKVCache, PrefillChunk
from gpu.loader import LoadedModel, load_model
from tests.tiny_gguf import TinyModel

pytestmark = pytest.mark.skipif(
    native.load_kernels() is None, reason="the fused step needs the native kernels"
)
BS = 16
QUANTIZED_BOUNDS = (3.0, 0.85)  # tests/test_model.py INVARIANCE["quantized"]


@pytest.fixture(scope="module")
def qlm(tiny_gguf: TinyModel) -> LoadedModel:
    lm = load_model(tiny_gguf.path, device="cpu", weights="quantized")
    assert lm.model.quantized()
    return lm


def _prefilled(lm: LoadedModel, prompts: list[list[int]], room: int = 8,
               spare: int = 0) -> tuple[PagedKVCache, list[list[int]]]:  # fmt: skip
    """A paged cache holding each prompt's K/V (through the torch path), ``room`` more
    positions in each table and ``spare`` blocks beyond them, and the tables."""
    per = max(-(-(len(p) + room) // BS) for p in prompts)
    cache = PagedKVCache(lm.config, per * len(prompts) + spare, BS)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(len(prompts))]
    with torch.inference_mode():
        for p, t in zip(prompts, tables, strict=True):
            cache.prepare([], [PrefillChunk(t, 0, len(p))])
            lm.model(torch.tensor(p), torch.arange(len(p)), cache)
    return cache, tables


def _decode(lm: LoadedModel, cache: PagedKVCache, tables: list[list[int]],
            prompts: list[list[int]], new: list[int], fuse: bool) -> torch.Tensor:  # fmt: skip
    decodes = [(t, len(p) + 1) for t, p in zip(tables, prompts, strict=True)]
    return _step(lm, cache, decodes, [], new, [len(p) for p in prompts], fuse)


def _both(lm: LoadedModel, prompts: list[list[int]], new: list[int],
          ) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """(torch logits, fused logits, K after torch, K after fused, K before) from one
    prefilled state."""
    cache, tables = _prefilled(lm, prompts)
    k0, v0 = cache.k.clone(), cache.v.clone()
    want = _decode(lm, cache, tables, prompts, new, fuse=False)
    k_want = cache.k.clone()
    cache.k.copy_(k0)
    cache.v.copy_(v0)
    got = _decode(lm, cache, tables, prompts, new, fuse=True)
    assert lm.model._fused is not None and lm.model._fused.cache_ref() is cache
    return want, got, k_want, cache.k.clone(), k0


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    atol, agree = QUANTIZED_BOUNDS
    assert float((got - want).abs().max()) <= atol
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= agree


def _mostly_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within the quantized bounds, and most rows equal to fp32 rounding: a row that
    lands on an int8 rounding boundary in one path may move by a quantum (which row
    does depends on the CPU's summation order in torch's ops), a wrong kernel moves
    them all."""
    _close(got, want)
    per_row = (got - want).abs().reshape(got.shape[0], -1).amax(-1)
    assert float(per_row.median()) <= 1e-4, per_row


def test_fused_step_matches_the_torch_path(qlm: LoadedModel) -> None:
    prompts = [[5, 6, 7, 8, 9], list(range(40, 77)), [200], list(range(100, 118))]
    want, got, k_want, k_got, k0 = _both(qlm, prompts, [11, 12, 13, 14])
    assert got.shape == want.shape == (4, qlm.config.vocab_size)
    # Measured 7e-7 apart on these inputs: far below the quantized bounds.
    _mostly_equal(got, want)
    # The first layer's K, one int8 rounding in: each new token's row (as [slot, ...]).
    ctx = [len(p) for p in prompts]
    per = max(-(-(c + 8) // BS) for c in ctx)  # as _prefilled lays the tables out
    tables = [list(range(i * per, (i + 1) * per)) for i in range(len(prompts))]
    slots = [t[c // BS] * BS + c % BS for t, c in zip(tables, ctx, strict=True)]
    _mostly_equal(k_got[0][:, slots].transpose(0, 1), k_want[0][:, slots].transpose(0, 1))
    # Every layer got the new tokens' rows and nothing else.
    for layer in range(qlm.config.n_layers):
        rows = (k_got[layer] != k0[layer]).any(dim=(0, 2)).nonzero().flatten().tolist()
        assert sorted(rows) == sorted(slots), layer


def test_fused_step_alone_equals_it_in_a_batch(qlm: LoadedModel) -> None:
    """One row's output does not depend on the step's other rows beyond rounding."""
    prompts = [list(range(20, 45)), [7, 8, 9]]
    batched = _both(qlm, prompts, [50, 51])[1]
    alone = _both(qlm, prompts[:1], [50])[1]
    _close(batched[:1], alone)


def _step(lm: LoadedModel, cache: PagedKVCache, decodes: list[tuple[list[int], int]],
          prefills: list[PrefillChunk], ids: list[int], pos: list[int], fuse: bool,
          ) -> torch.Tensor:  # fmt: skip
    lm.model.fuse_trunk = fuse
    try:
        with torch.inference_mode():
            cache.prepare(decodes, prefills)
            return lm.model(torch.tensor(ids), torch.tensor(pos), cache)
    finally:
        lm.model.fuse_trunk = True


def test_a_mixed_step_matches_the_torch_path(qlm: LoadedModel) -> None:
    """Two decodes beside a prompt chunk after a cached prefix and a fresh prompt: every
    row's logits, and the K/V the step wrote."""
    prompts = [list(range(30, 50)), [7, 8, 9, 10], list(range(60, 100))]
    cache, tables = _prefilled(qlm, prompts, room=32, spare=3)
    chunk = list(range(120, 150))  # 30 more tokens of the third sequence
    fresh = list(range(200, 240))  # a new prompt in blocks no one holds
    free = [b for b in range(cache.num_blocks) if all(b not in t for t in tables)]
    decodes = [(tables[0], 21), (tables[1], 5)]
    prefills = [PrefillChunk(tables[2], 40, len(chunk)), PrefillChunk(free[:3], 0, len(fresh))]
    ids = [11, 12, *chunk, *fresh]
    pos = [20, 4, *range(40, 70), *range(40)]
    k0, v0 = cache.k.clone(), cache.v.clone()
    want = _step(qlm, cache, decodes, prefills, ids, pos, fuse=False)
    k_want = cache.k.clone()
    cache.k.copy_(k0)
    cache.v.copy_(v0)
    got = _step(qlm, cache, decodes, prefills, ids, pos, fuse=True)
    assert cache.row_queries() is not None and qlm.model._fused is not None
    # 72 rows through the panel path: measured, 4 rows 0.01-0.05 apart (int8 rounding
    # boundaries in the second layer), the rest equal to 1e-6.
    _mostly_equal(got, want)
    declared = cache.row_queries()
    assert declared is not None
    written = declared[0]  # every row's cache slot
    _mostly_equal(cache.k[0][:, written].transpose(0, 1), k_want[0][:, written].transpose(0, 1))


def test_fusion_applies_to_decodes_and_short_chunks_on_quantized_weights(
    qlm: LoadedModel, tiny_gguf: TinyModel
) -> None:
    cache, tables = _prefilled(qlm, [[5, 6, 7]])
    n = ROW_QUERY_MAX_CHUNK
    cache.prepare([], [PrefillChunk(tables[0], 3, 2)])
    assert cache.row_queries() is not None  # a short chunk
    cache.prepare([(tables[0], 4)], [PrefillChunk(list(range(4, 9)), 0, n)])
    assert cache.row_queries() is not None  # mixed, the chunk at the limit
    cache.prepare([(tables[0], 4)], [PrefillChunk(list(range(4, 9)), 0, n + 1)])
    assert cache.row_queries() is None  # a long chunk: SDPA on the torch path
    cache.prepare([(tables[0], 4)], [])
    slots, rows, lens = cache.row_queries() or (None, None, None)
    assert rows is not None and lens is not None and lens.tolist() == [4]
    assert qlm.model._fused_for(cache) is not None
    qlm.model.fuse_trunk = False
    try:
        assert qlm.model._fused_for(cache) is None
    finally:
        qlm.model.fuse_trunk = True
    dense = load_model(tiny_gguf.path, device="cpu", weights="fp32")
    assert dense.model._fused_for(PagedKVCache(dense.config, 4, BS)) is None
    # the torch fallback of decode attention (no native kernel) takes the torch path
    plain = PagedKVCache(qlm.config, 4, BS, native=False)
    plain.prepare([([0], 1)], [])
    assert plain.row_queries() is None


def test_long_prompts_keep_sdpa(qlm: LoadedModel) -> None:
    """A chunk over the limit runs the torch path even with fusion on: same logits as
    with it off, bit for bit."""
    n = ROW_QUERY_MAX_CHUNK + 10
    cache = PagedKVCache(qlm.config, 8, BS)
    ids, pos = [(i * 7) % 250 + 5 for i in range(n)], list(range(n))
    table = list(range(-(-n // BS)))
    on = _step(qlm, cache, [], [PrefillChunk(table, 0, n)], ids, pos, fuse=True)
    off = _step(qlm, cache, [], [PrefillChunk(table, 0, n)], ids, pos, fuse=False)
    assert torch.equal(on, off)


@pytest.mark.model
def test_fused_step_on_smollm2(cpu_model: LoadedModel) -> None:
    """The bundled model at batch 1 and 5, mixed contexts."""
    if not cpu_model.model.quantized():
        pytest.skip("the default model loaded with fp32 weights")
    tok = cpu_model.tokenizer
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land",
             "1, 2, 3, 4,", "Water boils at"]  # fmt: skip
    prompts = [tok.encode(t) for t in texts]
    new = [tok.encode(" the")[0]] * len(prompts)
    want, got, *_ = _both(cpu_model, prompts[:1], new[:1])
    _close(got, want)
    want, got, *_ = _both(cpu_model, prompts, new)
    _close(got, want)
