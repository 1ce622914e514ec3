"""Determinism of the CPU kernels and the quantized model across builds (docs/determinism.md).

The promise is bitwise: a token's logits on the default (quantized, native) path are one
function of the model file and the token's prefix, whichever build of the kernels runs
them. Each build is asked for by ``LIFECYCLE_NATIVE_ISA`` (gpu/kernels/native_build.py); the tests
compare every build whose flags differ from the default's on this CPU
(``native_build.other_isas``): portable C (no vector extensions) always, AVX2 alone where
AVX-512 or VNNI is listed, AVX2 with AVX-VNNI where both that and AVX-512 are, AVX-512
without VNNI where both are. A build that
reassociated a sum, fused a multiply the source did not, or called a vector math
library would part from the others in the low bits, and the model run through 2 layers
and a softmax would show it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpu.kernels import native, native_build
from tests.threads import torch_threads
from tests.tiny_gguf import TinyModel

pytestmark = pytest.mark.skipif(
    native.load_kernels() is None, reason="the promise is about the native kernels"
)
ROOT = Path(__file__).resolve().parent.parent

# A mixed step on the tiny model through the fused trunk: two decodes beside a fresh
# 70-token prompt and a chunk after a cached prefix; prints the digests of the logits
# and of the cache the step wrote.
_SCRIPT = r"""
import hashlib, json, sys
import torch
from gpu.cache.kv_cache import PagedKVCache, PrefillChunk
from gpu.model.loader import load_model
from gpu.runtime.runner import NativeTrunk, trunk_for
from tests.model_steps import forward

lm = load_model(sys.argv[1], device="cpu", weights="quantized")
bs = 16
cache = PagedKVCache(lm.config, 24, bs)
ids = [(i * 53) % 250 + 3 for i in range(120)]
with torch.inference_mode():
    cache.prepare([], [PrefillChunk([0, 1], 0, 20), PrefillChunk([2, 3], 0, 9)])
    first = forward(lm.model, cache, torch.tensor(ids[:20] + ids[40:49]),
                    torch.tensor([*range(20), *range(9)]))
    cache.prepare([([0, 1], 21), ([2, 3], 10)],
                  [PrefillChunk(list(range(4, 9)), 0, 70), PrefillChunk([0, 1], 21, 5)])
    step = forward(lm.model, cache, torch.tensor([7, 8, *ids[50:120], *ids[20:25]]),
                   torch.tensor([20, 9, *range(70), *range(21, 26)]))
assert isinstance(trunk_for(lm.model, cache), NativeTrunk)
digest = lambda t: hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()
print(json.dumps({"logits": digest(torch.cat([first, step])), "k": digest(cache.k),
                  "v": digest(cache.v), "argmax": step.argmax(-1).tolist(),
                  "torch_cpu": torch.backends.cpu.get_cpu_capability()}))
"""


# What torch itself would run on a CPU with only what the build uses: its kernel dispatch
# (ATen's CPU capability) and oneDNN's, held to the same level, so the process as a whole
# is the one an AVX2-only or a vector-less CPU would run, and any op of torch's on the
# path whose rounding depends on the vector width (RoPE tables, the sampler's softmax)
# shows up as a difference too, not only our kernels'.
_TORCH_LEVEL = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "avxvnni": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2_VNNI"},
    "portable": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41"},
}


def _run_build(isa: str, model: Path) -> dict[str, object]:
    env = {**os.environ, "LIFECYCLE_NATIVE_ISA": isa, "PYTHONPATH": str(ROOT)}
    env.update(_TORCH_LEVEL.get(isa, {}))
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(model)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    level = got.pop("torch_cpu")
    if isa in _TORCH_LEVEL:  # torch honoured the level asked for
        assert level == _TORCH_LEVEL[isa]["ATEN_CPU_CAPABILITY"].upper(), (isa, level)
    return got


def test_every_build_runs_the_model_to_the_same_bits(tiny_gguf: TinyModel) -> None:
    """The default build against each other build: logits and the whole K/V cache of a
    mixed step (decodes, a long fresh prompt, a chunk after a cached prefix)."""
    want = _run_build("auto", tiny_gguf.path)
    for isa in native_build.other_isas():
        assert _run_build(isa, tiny_gguf.path) == want, isa


@pytest.mark.parametrize("name", ["phi3", "gemma2", "gemma3"])
def test_every_build_runs_the_other_families_to_the_same_bits(name: str, tmp_path: Path) -> None:
    """The same for the architectures whose layer differs in the trunk (tests/
    hf_reference.py's tiny files in Q8_0): sliding windows shorter than the prompt, and
    Gemma 2's GeGLU, post-norms, capped scores and capped logits, Gemma 3's per-layer
    RoPE tables."""
    pytest.importorskip("transformers")
    from gguf import GGMLQuantizationType as Q

    from tests.hf_reference import FAMILIES, build_hf, write_family_gguf

    family = FAMILIES[name]
    path = write_family_gguf(family, build_hf(family, dtype=torch.float32),
                             tmp_path / f"{name}.gguf", Q.Q8_0)  # fmt: skip
    want = _run_build("auto", path)
    for isa in native_build.other_isas():
        assert _run_build(isa, path) == want, isa


KV_ELEMENTS = [torch.float32, torch.float16]  # what the paged cache may store


@pytest.mark.parametrize("kv_dtype", KV_ELEMENTS)
@pytest.mark.parametrize("kv", [2, 1])
@pytest.mark.parametrize("hd", [64, 32, 40, 128, 256])
def test_attention_builds_agree(hd: int, kv: int, kv_dtype: torch.dtype) -> None:
    """The attention kernel alone, every build (the vector paths: head_dim 64, 128 and
    256 unrolled, any other multiple of 8 looped; the portable build's scalar loop), keys
    not a multiple of 8 or of the block, from an fp32 and an fp16 cache; with one KV head
    the five rows of one block table are split into two work items for two threads."""
    g = torch.Generator().manual_seed(hd + kv)
    d, h, bs, nb = 5, 6, 16, 6
    q = torch.randn(d, h, hd, generator=g)
    kc = (torch.randn(kv, nb * bs, hd, generator=g) * 2).to(kv_dtype)
    vc = torch.randn(kv, nb * bs, hd, generator=g).to(kv_dtype)
    tables = torch.tensor([[5, 4, 3, 2, 1, 0]] * d, dtype=torch.int32)
    lens = torch.tensor([1, 7, 16, 41, 96], dtype=torch.int32)
    kernels = native.load_kernels()
    assert kernels is not None
    want = kernels.paged_attention(q, kc, vc, tables, lens, bs, hd**-0.5)
    for isa in native_build.other_isas():
        other = native.load_kernels_built_for(isa)
        got = other.paged_attention(q, kc, vc, tables, lens, bs, hd**-0.5)
        assert torch.equal(got, want), isa
    # and one sequence alone equals it in the batch; on two threads too, where one KV
    # head's rows of one block table are split into a work item per thread
    alone = kernels.paged_attention(q[3:4], kc, vc, tables[3:4], lens[3:4], bs, hd**-0.5)
    assert torch.equal(alone, want[3:4])
    with torch_threads(2):
        assert torch.equal(kernels.paged_attention(q, kc, vc, tables, lens, bs, hd**-0.5), want)
    if kv_dtype == torch.float16:  # fp16 is read exactly: the fp32 cache of the same values
        same = kernels.paged_attention(q, kc.float(), vc.float(), tables, lens, bs, hd**-0.5)
        assert torch.equal(same, want)


@pytest.mark.parametrize("kv_dtype", KV_ELEMENTS)
@pytest.mark.parametrize(("hd", "window", "softcap"),
                         [(64, 13, 0.0), (32, 13, 0.0), (64, 0, 2.0), (32, 20, 2.0),
                          (128, 13, 0.0), (256, 20, 2.0), (40, 0, 0.0)])  # fmt: skip
def test_windowed_and_capped_attention(
    hd: int, window: int, softcap: float, kv_dtype: torch.dtype
) -> None:
    """A sliding window (keys more than ``window`` behind the query masked, whether the
    first kept key starts a block or not) and capped scores: the torch reference's values,
    and the same bits in every build."""
    g = torch.Generator().manual_seed(hd + window)
    d, h, kv, bs, nb = 5, 6, 2, 16, 6
    q = torch.randn(d, h, hd, generator=g)
    kc = (torch.randn(kv, nb * bs, hd, generator=g) * 2).to(kv_dtype)
    vc = torch.randn(kv, nb * bs, hd, generator=g).to(kv_dtype)
    order = [5, 4, 3, 2, 1, 0]
    tables = torch.tensor([order] * d, dtype=torch.int32)
    lens = torch.tensor([1, 7, 16, 41, 96], dtype=torch.int32)
    kernels = native.load_kernels()
    assert kernels is not None
    got = kernels.paged_attention(q, kc, vc, tables, lens, bs, hd**-0.5, window, softcap)
    rows = torch.cat([torch.arange(b * bs, (b + 1) * bs) for b in order])
    for s, n in enumerate(lens.tolist()):
        first = max(0, n - window) if window else 0
        keys, vals = kc[:, rows[first:n]].float(), vc[:, rows[first:n]].float()  # [kv, n, hd]
        scores = torch.einsum("kgd,knd->kgn", q[s].view(kv, h // kv, hd), keys) * hd**-0.5
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        want = torch.einsum("kgn,knd->kgd", scores.softmax(-1), vals).reshape(h, hd)
        torch.testing.assert_close(got[s], want, rtol=1e-5, atol=1e-5)
    for isa in native_build.other_isas():
        other = native.load_kernels_built_for(isa)
        same = other.paged_attention(q, kc, vc, tables, lens, bs, hd**-0.5, window, softcap)
        assert torch.equal(same, got), isa


def test_softcap_is_tanh_and_builds_agree() -> None:
    """``cap * tanh(x / cap)`` (tanh_fixed: Cephes' split at |x| = 0.625) within 2e-7 of
    torch's tanh times the cap, over the range that matters, in every build alike."""
    x = torch.cat([torch.linspace(-40, 40, 4001), torch.linspace(-1.3, 1.3, 2601),
                   torch.tensor([0.0, -0.0, 1.25, -1.25, 1e-30, 200.0, -200.0])])  # fmt: skip
    kernels = native.load_kernels()
    assert kernels is not None
    got = kernels.softcap(x.clone(), 2.0)
    torch.testing.assert_close(got, 2.0 * torch.tanh(x / 2.0), rtol=0, atol=4e-7)
    for isa in native_build.other_isas():
        assert torch.equal(native.load_kernels_built_for(isa).softcap(x.clone(), 2.0), got), isa


def test_rms_norm_rows_are_independent_and_builds_agree() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 579, generator=g) * 4  # not a multiple of 8
    w = torch.randn(579, generator=g)
    kernels = native.load_kernels()
    assert kernels is not None
    y = kernels.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(y, torch.nn.functional.rms_norm(x, (579,), w, 1e-5))
    assert torch.equal(kernels.rms_norm(x[4:5], w, 1e-5), y[4:5])
    for isa in native_build.other_isas():
        assert torch.equal(native.load_kernels_built_for(isa).rms_norm(x, w, 1e-5), y), isa
    with pytest.raises(ValueError, match="norm weight"):
        kernels.rms_norm(x, w[:-1], 1e-5)


def test_isa_names_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIFECYCLE_NATIVE_ISA", "avx9")
    with pytest.raises(RuntimeError, match="LIFECYCLE_NATIVE_ISA='avx9'"):
        native_build.native_isa()
    with pytest.raises(ValueError, match="expected one of"):
        native.load_kernels_built_for("sse")
