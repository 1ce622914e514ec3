"""The fused Triton kernels (``gpu/kernels/triton_ops.py``, ``--kernels triton``) against the torch
ops they replace: compiled on a GPU, through Triton's interpreter on the CPU
(``TRITON_INTERPRET=1``, set here before Triton is imported when there is no GPU).

The bounds: each kernel computes in fp32 what torch computes in fp32 too, in another
order (a row's sum of squares, a dot product over the head, a softmax over the keys), so
they differ by rounding alone: a sum of n fp32 terms moves by at most about n * 2^-24 of
its terms' magnitude. Every reduction here has at most a few hundred terms of magnitude
about 1, so 1e-5 (absolute, on values of order 1) holds with room; in bf16 the result
is rounded once more, to 2^-8 relative, and the bound is that rounding: 2^-7 of the
value (both sides may round the other way once; Triton's interpreter truncates to bf16
where compiled kernels round to nearest even, also within one unit of 2^-7)."""

from __future__ import annotations

import os
from functools import partial

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="Triton is in the dev extra (pip install '.[dev]')")

import torch.nn.functional as F  # noqa: E402

from gpu.cache.kv_cache import PagedKVCache, capped_attention  # noqa: E402
from gpu.kernels import triton_ops as ops  # noqa: E402
from gpu.kernels.kernel_choice import triton_ops  # noqa: E402
from gpu.model.loader import LoadedModel, load_model  # noqa: E402
from gpu.runtime.engine import Engine, EngineConfig  # noqa: E402
from tests.engine_runs import run_to_end  # noqa: E402
from tests.tiny_gguf import TinyModel  # noqa: E402

DEV = torch.device("cuda" if CUDA else "cpu")
FP32 = 1e-5


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    if got.dtype == torch.float32:
        assert (got - want).abs().max().item() <= FP32
    else:  # one more rounding to the element on each side: 2^-7 of the value
        diff = (got.float() - want.float()).abs()
        assert (diff <= want.float().abs() * 2**-7 + 1e-6).all()


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def dtype(request: pytest.FixtureRequest) -> torch.dtype:
    return request.param  # type: ignore[no-any-return]


def test_rms_norm_and_the_residual_add(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 96, generator=gen).to(DEV, dtype)
    y = torch.randn(7, 96, generator=gen).to(DEV, dtype)
    w = torch.randn(96, generator=gen).to(DEV, dtype)
    _close(ops.rms_norm(x, w, 1e-6), F.rms_norm(x.float(), (96,), w.float(), 1e-6).to(dtype))
    s, h = ops.add_rms_norm(x, y, w, 1e-6)
    if CUDA or dtype == torch.float32:
        assert torch.equal(s, x + y)  # the residual is the torch path's, rounded alike
    else:  # the interpreter truncates to bf16 where the compiled kernel rounds to even
        _close(s, x + y)
    _close(h, F.rms_norm(s.float(), (96,), w.float(), 1e-6).to(dtype))


def test_rope_of_a_strided_view(dtype: torch.dtype) -> None:
    """q and k heads as the layer has them: a view into the qkv projection's rows."""
    gen = torch.Generator().manual_seed(1)
    t, heads, hd = 5, 6, 32
    qkv = torch.randn(t, heads * hd + 2 * hd, generator=gen).to(DEV, dtype)
    qk = qkv[:, : heads * hd].view(t, heads, hd)
    cos = torch.randn(t, 1, hd, generator=gen).to(DEV, dtype)
    sin = torch.randn(t, 1, hd, generator=gen).to(DEV, dtype)
    want = torch.addcmul(qk.float() * cos.float(), qk.float().roll(hd // 2, -1), sin.float())
    got = ops.rope(qk, cos, sin)
    assert got.is_contiguous() and got.shape == (t, heads, hd)
    _close(got, want.to(dtype))
    with pytest.raises(ValueError, match="power of two"):
        ops.rope(torch.zeros(2, 2, 24, device=DEV), cos[:2, :, :24], sin[:2, :, :24])


@pytest.mark.parametrize("gelu", [False, True], ids=["silu", "gelu"])
def test_gated_activation(dtype: torch.dtype, gelu: bool) -> None:
    gen = torch.Generator().manual_seed(2)
    gu = torch.randn(4, 2 * 1100, generator=gen).to(DEV, dtype)  # two column blocks
    gate, up = gu.float().chunk(2, dim=-1)
    act = F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)
    _close(ops.gated(gu, gelu), (act * up).to(dtype))


@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (20, 0.0), (0, 30.0)])
def test_paged_decode_reads_the_blocks_in_place(window: int, softcap: float) -> None:
    """Three sequences with scattered blocks, padded tables and different lengths (one
    shorter than a block, one ending inside its last block), GQA 3:1, against attention
    over each sequence's keys gathered in order."""
    gen = torch.Generator().manual_seed(3)
    n_kv, g, hd, bs, nblocks = 2, 3, 32, 16, 12
    kc = torch.randn(n_kv, nblocks * bs, hd, generator=gen).to(DEV)
    vc = torch.randn(n_kv, nblocks * bs, hd, generator=gen).to(DEV)
    q = torch.randn(3, n_kv * g, hd, generator=gen).to(DEV)
    tables = [[7, 2, 9, 0], [4, 0, 0, 0], [1, 11, 3, 5]]  # padded with block 0
    lens = [45, 9, 64]
    scale = hd**-0.5
    got = ops.paged_decode(q, kc, vc, torch.tensor(tables, dtype=torch.int32, device=DEV),
                           torch.tensor(lens, dtype=torch.int32, device=DEV), bs, scale,
                           window, softcap)  # fmt: skip
    for i, (table, n) in enumerate(zip(tables, lens, strict=True)):
        rows = torch.tensor([table[p // bs] * bs + p % bs for p in range(n)], device=DEV)
        keys, vals = kc[:, rows], vc[:, rows]  # [n_kv, n, hd]
        key = torch.arange(n, device=DEV)
        mask = key >= (n - window if window else 0)
        qh = q[i].view(1, n_kv * g, 1, hd)
        k4 = keys.repeat_interleave(g, 0).unsqueeze(0)
        v4 = vals.repeat_interleave(g, 0).unsqueeze(0)
        if softcap:
            want = capped_attention(qh, k4, v4, mask[None, :], scale, softcap)
        else:
            want = F.scaled_dot_product_attention(qh, k4, v4, attn_mask=mask[None, :], scale=scale)
        _close(got[i], want[0, :, 0])


@pytest.fixture(scope="module")
def lm(tiny_gguf: TinyModel) -> LoadedModel:
    return load_model(tiny_gguf.path, device=DEV.type)


def _engine(lm: LoadedModel, kernels: str, graphs: str = "off", native: bool | None = None,
            ) -> Engine:  # fmt: skip
    return Engine(lm, EngineConfig(256, 16, 8, 64, 64, 16, decode_graphs=graphs,
                                   kernels=kernels),
                  cache_type=partial(PagedKVCache, native=native))  # fmt: skip


def test_the_model_with_triton_kernels_gives_the_torch_paths_tokens(
    lm: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tiny model (fp32) served through the kernels, with and without the static-buffer
    graphs (whole decode steps and piecewise ones), gives the torch path's greedy tokens;
    the cache's decode rows go through the paged kernel (``--kernels triton`` sets both
    the torch path's and the cache's kernels). On the CPU the cache's C kernel would take
    the decodes first; the cache is made without it here, as a GPU never has it."""
    calls = []
    paged = ops.paged_decode
    monkeypatch.setattr(ops, "paged_decode", lambda *a: calls.append(1) or paged(*a))
    prompts = [[5, 9, 13, 40, 77, 3], list(range(20, 57)), [101, 7]]
    s = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 12}
    plain = run_to_end(_engine(lm, "torch"), prompts, [s] * 3)
    assert not calls
    for graphs in ("off", "eager"):
        fused = _engine(lm, "triton", graphs, native=False)
        assert fused.runner.ops is ops and fused.cache.ops is ops
        assert fused.cache.kernels is None
        assert run_to_end(fused, prompts, [s] * 3) == plain, graphs
        assert len(calls) >= 11 * lm.config.n_layers, graphs  # every decode step's layers
        calls.clear()
    assert _engine(lm, "torch").runner.ops is None  # each engine its own, the model none


def test_kernel_modes() -> None:
    assert triton_ops("torch", DEV) is None
    assert triton_ops("triton", DEV) is ops
    with pytest.raises(ValueError, match="kernels must be one of"):
        triton_ops("cuda", DEV)


def test_the_cache_picks_the_paged_kernel_for_decodes(lm: LoadedModel) -> None:
    cache = PagedKVCache(lm.config, 8, 16, DEV, native=False, ops=ops)
    cache.prepare([([3, 1], 20)], [])
    lay = cache._layout
    assert lay is not None and lay.dec_tables is not None and lay.dec_rows is None
    assert lay.dec_tables.tolist() == [[3, 1]] and lay.dec_lens is not None
    assert lay.dec_lens.tolist() == [20]
    # a block of 12: not a power of two, so not for Triton
    odd = PagedKVCache(lm.config, 8, 12, DEV, native=False, ops=ops)
    odd.prepare([([3, 1], 20)], [])
    assert not odd.triton_decode
    assert odd._layout is not None and odd._layout.dec_rows is not None  # the gather path


def test_tensor_parallel_refuses_the_triton_kernels(tiny_gguf: TinyModel) -> None:
    from gpu.worker.config import WorkerConfig, build_engine

    config = WorkerConfig(model_path=str(tiny_gguf.path), device="cpu", tp=2, kernels="triton")
    with pytest.raises(SystemExit, match="leave --kernels at torch"):
        build_engine(config)
