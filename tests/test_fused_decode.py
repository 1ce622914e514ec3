"""The fused decode trunk (``gpu/fused.py`` over ``gpu/csrc/decode_step.c``) against the
torch path it replaces for pure-decode steps with quantized weights on the CPU.

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
from gpu.kv_cache import PagedKVCache, PrefillChunk
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


def _prefilled(lm: LoadedModel, prompts: list[list[int]]) -> tuple[PagedKVCache, list[list[int]]]:
    """A paged cache holding each prompt's K/V (through the torch path), and the tables."""
    per = max(-(-(len(p) + 8) // BS) for p in prompts)
    cache = PagedKVCache(lm.config, per * len(prompts), BS)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(len(prompts))]
    with torch.inference_mode():
        for p, t in zip(prompts, tables, strict=True):
            cache.prepare([], [PrefillChunk(t, 0, len(p))])
            lm.model(torch.tensor(p), torch.arange(len(p)), cache)
    return cache, tables


def _decode(lm: LoadedModel, cache: PagedKVCache, tables: list[list[int]],
            prompts: list[list[int]], new: list[int], fuse: bool) -> torch.Tensor:  # fmt: skip
    lm.model.fuse_decode = fuse
    try:
        with torch.inference_mode():
            cache.prepare([(t, len(p) + 1) for t, p in zip(tables, prompts, strict=True)], [])
            return lm.model(torch.tensor(new), torch.tensor([len(p) for p in prompts]), cache)
    finally:
        lm.model.fuse_decode = True


def _both(lm: LoadedModel, prompts: list[list[int]], new: list[int],
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(torch logits, fused logits, K after torch, K after fused) from one prefilled state."""
    cache, tables = _prefilled(lm, prompts)
    k0, v0 = cache.k.clone(), cache.v.clone()
    want = _decode(lm, cache, tables, prompts, new, fuse=False)
    k_want = cache.k.clone()
    cache.k.copy_(k0)
    cache.v.copy_(v0)
    got = _decode(lm, cache, tables, prompts, new, fuse=True)
    assert lm.model._fused is not None and lm.model._fused.cache_ref() is cache
    return want, got, k_want, cache.k.clone()


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    atol, agree = QUANTIZED_BOUNDS
    assert float((got - want).abs().max()) <= atol
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= agree


def test_fused_step_matches_the_torch_path(qlm: LoadedModel) -> None:
    prompts = [[5, 6, 7, 8, 9], list(range(40, 77)), [200], list(range(100, 118))]
    want, got, k_want, k_got = _both(qlm, prompts, [11, 12, 13, 14])
    assert got.shape == want.shape == (4, qlm.config.vocab_size)
    # Two layers of 64: no rounding flip on these inputs (measured 7e-7 apart), so the
    # tiny model pins the two paths to each other far below the quantized bounds.
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
    # The first layer's K passes one int8 rounding: equal to fp32 rounding.
    torch.testing.assert_close(k_got[0], k_want[0], atol=1e-4, rtol=1e-4)
    # The new tokens' rows and nothing else were written, in every layer.
    changed = (k_got != k_want).any(dim=(1, 3)).nonzero().tolist()
    cache_rows = {r for _, r in changed}
    ctx = [len(p) for p in prompts]
    per = max(-(-(c + 8) // BS) for c in ctx)  # as _prefilled lays the tables out
    tables = [list(range(i * per, (i + 1) * per)) for i in range(len(prompts))]
    slots = {t[c // BS] * BS + c % BS for t, c in zip(tables, ctx, strict=True)}
    assert cache_rows <= slots


def test_fused_step_alone_equals_it_in_a_batch(qlm: LoadedModel) -> None:
    """One row's output does not depend on the step's other rows beyond rounding."""
    prompts = [list(range(20, 45)), [7, 8, 9]]
    _, batched, _, _ = _both(qlm, prompts, [50, 51])
    _, alone, _, _ = _both(qlm, prompts[:1], [50])
    _close(batched[:1], alone)


def test_fusion_applies_only_to_pure_decode_on_quantized_weights(
    qlm: LoadedModel, tiny_gguf: TinyModel
) -> None:
    cache, tables = _prefilled(qlm, [[5, 6, 7]])
    cache.prepare([], [PrefillChunk(tables[0], 3, 2)])
    assert cache.pure_decode() is None  # prefill
    cache.prepare([(tables[0], 4)], [PrefillChunk(tables[0], 3, 1)])
    assert cache.pure_decode() is None  # mixed
    cache.prepare([(tables[0], 4)], [])
    assert cache.pure_decode() is not None
    assert qlm.model._fused_for(cache) is not None
    qlm.model.fuse_decode = False
    try:
        assert qlm.model._fused_for(cache) is None
    finally:
        qlm.model.fuse_decode = True
    dense = load_model(tiny_gguf.path, device="cpu", weights="fp32")
    assert dense.model._fused_for(PagedKVCache(dense.config, 4, BS)) is None
    # the torch fallback of decode attention (no native kernel) takes the torch path
    plain = PagedKVCache(qlm.config, 4, BS, native=False)
    plain.prepare([([0], 1)], [])
    assert plain.pure_decode() is None


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
    want, got, _, _ = _both(cpu_model, prompts[:1], new[:1])
    _close(got, want)
    want, got, _, _ = _both(cpu_model, prompts, new)
    _close(got, want)
