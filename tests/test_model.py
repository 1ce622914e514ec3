"""The torch Llama: against a naive reference, KV-cached vs full, batched vs alone.

fp32 weights run on the dense test cache, held to fp32 rounding. The quantized weights
(the CPU default) run as the worker runs them, on the paged cache through the fused
native trunk, where a token's logits are one function of its prefix: cached against
recomputed and batched against alone are asserted bit for bit (docs/determinism.md).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu.cache.kv_cache import PagedKVCache, PrefillChunk, kv_storage_dtype
from gpu.kernels import native
from gpu.model.decoder import Llama
from gpu.model.loader import LoadedModel, load_model
from gpu.runtime.runner import trunk_for
from gpu.worker.generate import greedy_generate
from tests.dense_cache import DenseKVCache
from tests.tiny_gguf import TinyModel


def reference_logits(tiny: TinyModel, ids: list[int]) -> np.ndarray:
    """HF Llama written out longhand in float64: per-head loops, rotate-half RoPE."""
    s, w = tiny.spec, {k: v.astype(np.float64) for k, v in tiny.weights.items()}
    d = s.hidden // s.n_heads
    group = s.n_heads // s.n_kv_heads

    def rms(x: np.ndarray, g: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + s.rms_eps) * g

    def rope(x: np.ndarray) -> np.ndarray:  # x [T, heads, d]
        pos = np.arange(x.shape[0], dtype=np.float64)[:, None, None]
        freq = s.rope_theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
        ang = pos * freq  # [T, 1, d/2]
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return np.concatenate(
            [x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], -1
        )

    t = len(ids)
    x = w["token_embd.weight"][ids]
    causal = np.tril(np.ones((t, t), dtype=bool))
    for i in range(s.n_layers):
        p = f"blk.{i}."
        h = rms(x, w[p + "attn_norm.weight"])
        q = rope((h @ w[p + "attn_q.weight"].T).reshape(t, s.n_heads, d))
        k = rope((h @ w[p + "attn_k.weight"].T).reshape(t, s.n_kv_heads, d))
        v = (h @ w[p + "attn_v.weight"].T).reshape(t, s.n_kv_heads, d)
        o = np.zeros((t, s.n_heads, d))
        for head in range(s.n_heads):
            kv = head // group
            scores = q[:, head] @ k[:, kv].T / np.sqrt(d)
            scores = np.where(causal, scores, -np.inf)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            o[:, head] = (probs / probs.sum(-1, keepdims=True)) @ v[:, kv]
        x = x + o.reshape(t, -1) @ w[p + "attn_output.weight"].T
        h = rms(x, w[p + "ffn_norm.weight"])
        gate, up = h @ w[p + "ffn_gate.weight"].T, h @ w[p + "ffn_up.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "ffn_down.weight"].T
    return rms(x, w["output_norm.weight"]) @ w["token_embd.weight"].T


class PagedSeqs:
    """The dense cache's interface over the worker's paged cache: each sequence id owns
    a fixed run of blocks; a step of one-token appends to filled sequences is a decode
    step, any other a step of prompt chunks (what the engine lays out). K and V are
    stored as the worker stores them by default (fp16 for quantized weights on the CPU)."""

    def __init__(self, lm: LoadedModel, max_seqs: int, max_len: int, native: bool | None = None,
                 kv_dtype: torch.dtype | None = None, fuse: bool = True) -> None:  # fmt: skip
        """``kv_dtype``: what K and V are stored as (None: the worker's default);
        ``fuse``: the trunk an engine chooses (False: the torch path)."""
        self.per = -(-max_len // 16)
        kv = kv_dtype or kv_storage_dtype("auto", lm.device, lm.dtype, lm.model.quantized())
        self.backend = PagedKVCache(lm.config, max_seqs * self.per, 16, native=native, kv_dtype=kv)
        self.trunk = trunk_for(lm.model, self.backend, fuse=fuse)
        self.n = [0] * max_seqs

    def _table(self, s: int) -> list[int]:
        return list(range(s * self.per, (s + 1) * self.per))

    def length(self, s: int) -> int:
        return self.n[s]

    def positions(self, seq_ids: list[int], lens: list[int]) -> torch.Tensor:
        return torch.cat(
            [torch.arange(self.n[s], self.n[s] + k) for s, k in zip(seq_ids, lens, strict=True)]
        )

    def prepare(self, seq_ids: list[int], lens: list[int]) -> None:
        if all(k == 1 and self.n[s] for s, k in zip(seq_ids, lens, strict=True)):
            self.backend.prepare([(self._table(s), self.n[s] + 1) for s in seq_ids], [])
        else:
            chunks = [
                PrefillChunk(self._table(s), self.n[s], k)
                for s, k in zip(seq_ids, lens, strict=True)
            ]
            self.backend.prepare([], chunks)
        for s, k in zip(seq_ids, lens, strict=True):
            self.n[s] += k


def run_steps(
    model: Llama, cache: DenseKVCache | PagedSeqs, steps: list[tuple[list[int], list[list[int]]]]
) -> list[torch.Tensor]:
    """Each step: (seq_ids, token lists); returns all-row logits per step."""
    out = []
    with torch.inference_mode():
        for seq_ids, chunks in steps:
            lens = [len(c) for c in chunks]
            pos = cache.positions(seq_ids, lens)
            cache.prepare(seq_ids, lens)
            ids = torch.tensor([i for c in chunks for i in c], dtype=torch.int64)
            if isinstance(cache, PagedSeqs):  # the trunk an engine's runner chooses
                out.append(model.logits(cache.trunk(ids, pos)))
            else:
                out.append(model(ids, pos, cache))
    return out


@pytest.fixture(scope="module")
def tiny_lm(tiny_gguf: TinyModel) -> LoadedModel:
    """fp32 weights: the longhand reference and the invariance checks are fp32 math."""
    return load_model(tiny_gguf.path, device="cpu", weights="fp32")


@pytest.fixture(scope="module", params=["fp32", "quantized"])
def smollm2(request: pytest.FixtureRequest) -> LoadedModel:
    """The real model in both weight modes (quantized: the CPU default, ``cpu_model``)."""
    if request.param == "fp32":
        return load_model(device="cpu", weights="fp32")
    if native.load_kernels() is None:
        pytest.skip("quantized weights need the native kernels (LIFECYCLE_NATIVE=0 here)")
    lm: LoadedModel = request.getfixturevalue("cpu_model")
    assert lm.model.quantized()
    return lm


def _cache(lm: LoadedModel, max_seqs: int, max_len: int) -> DenseKVCache | PagedSeqs:
    """Quantized weights on the paged cache (the fused trunk), fp32 on the dense one."""
    if lm.model.quantized():
        return PagedSeqs(lm, max_seqs, max_len)
    return DenseKVCache(lm.config, max_seqs, max_len)


def _close(lm: LoadedModel, got: torch.Tensor, want: torch.Tensor) -> None:
    if lm.model.quantized():
        assert torch.equal(got, want), float((got - want).abs().max())
        return
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_forward_matches_longhand_reference(tiny_gguf: TinyModel, tiny_lm: LoadedModel) -> None:
    ids = [5, 77, 120, 3, 250, 9, 9, 42, 200, 1, 13, 60]
    cache = DenseKVCache(tiny_lm.config, 1, 32)
    (got,) = run_steps(tiny_lm.model, cache, [([0], [ids])])
    ref = reference_logits(tiny_gguf, ids)
    assert got.dtype == torch.float32 and got.shape == (len(ids), len(tiny_gguf.tokens))
    np.testing.assert_allclose(got.numpy(), ref, atol=1e-4, rtol=1e-4)


def test_logits_indices_and_hidden(tiny_lm: LoadedModel) -> None:
    ids = torch.tensor([5, 6, 7, 8])
    with torch.inference_mode():
        c1 = DenseKVCache(tiny_lm.config, 1, 8)
        pos = c1.positions([0], [4])
        c1.prepare([0], [4])
        full = tiny_lm.model(ids, pos, c1)
        c2 = DenseKVCache(tiny_lm.config, 1, 8)
        c2.prepare([0], [4])
        logits, hidden = tiny_lm.model(
            ids, pos, c2, logits_indices=torch.tensor([1, 3]), return_hidden=True
        )
    assert logits.shape == (2, tiny_lm.config.vocab_size) and hidden.shape == (
        2,
        tiny_lm.config.hidden,
    )
    torch.testing.assert_close(logits, full[[1, 3]], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden @ tiny_lm.model.lm_head.T, logits, atol=1e-5, rtol=1e-5)


def _cached_vs_full(lm: LoadedModel, prompt: list[int], cont: list[int], chunk: int) -> None:
    full_ids = prompt + cont
    (full,) = run_steps(lm.model, _cache(lm, 1, len(full_ids)), [([0], [full_ids])])
    cache = _cache(lm, 1, len(full_ids))
    steps = [([0], [prompt[i : i + chunk]]) for i in range(0, len(prompt), chunk)]
    steps += [([0], [[t]]) for t in cont]
    got = torch.cat(run_steps(lm.model, cache, steps))
    _close(lm, got, full)
    assert cache.length(0) == len(full_ids)


def _batched_vs_alone(
    lm: LoadedModel, prompts: list[list[int]], decode: list[int], slots: list[int]
) -> None:
    n = len(prompts)
    alone = []
    for p in prompts:
        cache = _cache(lm, 1, 64)
        alone.append(run_steps(lm.model, cache, [([0], [p])] + [([0], [[t]]) for t in decode]))
    # all prompts in one varlen step, then batched decode steps
    cache = _cache(lm, max(slots) + 1, 64)
    bounds = np.cumsum([0, *map(len, prompts)])
    batched = run_steps(lm.model, cache, [(slots, prompts)] + [(slots, [[t]] * n) for t in decode])
    for j in range(n):
        _close(lm, batched[0][bounds[j] : bounds[j + 1]], alone[j][0])
        for step in range(1, len(decode) + 1):
            _close(lm, batched[step][j : j + 1], alone[j][step][0:1])


def test_kv_cached_decode_equals_full_recompute(tiny_lm: LoadedModel) -> None:
    _cached_vs_full(tiny_lm, [4, 8, 15, 16, 23, 42, 7, 7, 100], [250, 3, 9, 31], chunk=4)


@pytest.mark.parametrize("slots", [[0, 1, 2], [4, 0, 2]], ids=["adjacent-slots", "gathered-slots"])
def test_batched_varlen_equals_each_alone(tiny_lm: LoadedModel, slots: list[int]) -> None:
    prompts = [[5, 6, 7], [100, 101, 102, 103, 104, 105, 106], [9]]
    _batched_vs_alone(tiny_lm, prompts, [42, 43], slots)


def test_dense_cache_rejects_bad_layouts(tiny_lm: LoadedModel) -> None:
    with pytest.raises(ValueError, match="exceeds the model context"):
        DenseKVCache(tiny_lm.config, 1, tiny_lm.config.context_length + 1)
    cache = DenseKVCache(tiny_lm.config, 2, 4)
    with pytest.raises(ValueError):
        cache.prepare([0, 0], [1, 1])
    with pytest.raises(ValueError):
        cache.prepare([0], [5])
    cache.prepare([1], [3])
    assert cache.length(1) == 3
    cache.reset(1)
    assert cache.length(1) == 0


def test_greedy_generate_stops_at_budget(tiny_lm: LoadedModel) -> None:
    out = greedy_generate(tiny_lm, [5, 6, 7], 5)
    assert 0 < len(out) <= 5 and not set(out) & tiny_lm.tokenizer.eog_ids


# -- the real model --------------------------------------------------------------------


@pytest.mark.model
def test_smollm2_knows_the_capital_of_france(smollm2: LoadedModel) -> None:
    """Mixed-up q/k layouts give fluent garbage; this catches it. Asked just "What is the
    capital of France?", the first answer token is a near-tie (fp32: "The" 25.33 against
    "L" 25.24) that llama.cpp's int8 activations flip: llama-server on this file answers
    "L'Étoile, la Marseillaise, ...", and so do our quantized weights. Asked for one
    word, both weight modes and llama-server answer "The capital of France is Paris."."""
    assert smollm2.chat is not None
    question = "What is the capital of France? Answer in one word."
    text = smollm2.chat.render([{"role": "user", "content": question}])
    ids = smollm2.tokenizer.encode(text, add_special_tokens=False)
    answer = smollm2.tokenizer.decode(greedy_generate(smollm2, ids, 24))
    assert "Paris" in answer


@pytest.mark.model
def test_smollm2_kv_cached_decode_equals_full_recompute(smollm2: LoadedModel) -> None:
    prompt = smollm2.tokenizer.encode("The quick brown fox jumps over the lazy dog because")
    _cached_vs_full(smollm2, prompt, [253, 2475, 314, 2365, 28], chunk=5)


@pytest.mark.model
def test_smollm2_batched_varlen_equals_each_alone(smollm2: LoadedModel) -> None:
    enc = smollm2.tokenizer.encode
    prompts = [
        enc("Paris is"),
        enc("1, 2, 3, 4, 5, 6, 7,"),
        enc("Once upon a time, in a land far away"),
    ]
    _batched_vs_alone(smollm2, prompts, [28, 314], [3, 0, 1])
