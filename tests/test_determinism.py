"""Determinism of the CPU kernels and the quantized model across builds (docs/determinism.md).

The promise is bitwise: a token's logits on the default (quantized, native) path are one
function of the model file and the token's prefix, whichever build of the kernels runs
them. Each build is asked for by ``LIFECYCLE_NATIVE_ISA`` (gpu/native.py): portable C
(no vector extensions at all) always, and where the CPU lists AVX-512 the AVX2 build
beside the default AVX-512 one. A build that reassociated a sum, fused a multiply the
source did not, or called a vector math library would part from the others in the low
bits, and the model run through 2 layers and a softmax would show it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpu import native
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
from gpu.kv_cache import PagedKVCache, PrefillChunk
from gpu.loader import load_model

lm = load_model(sys.argv[1], device="cpu", weights="quantized")
bs = 16
cache = PagedKVCache(lm.config, 24, bs)
ids = [(i * 53) % 250 + 3 for i in range(120)]
with torch.inference_mode():
    cache.prepare([], [PrefillChunk([0, 1], 0, 20), PrefillChunk([2, 3], 0, 9)])
    first = lm.model(torch.tensor(ids[:20] + ids[40:49]), torch.tensor([*range(20), *range(9)]), cache)
    cache.prepare([([0, 1], 21), ([2, 3], 10)],
                  [PrefillChunk(list(range(4, 9)), 0, 70), PrefillChunk([0, 1], 21, 5)])
    step = lm.model(torch.tensor([7, 8, *ids[50:120], *ids[20:25]]),
                    torch.tensor([20, 9, *range(70), *range(21, 26)]), cache)
assert lm.model._fused is not None
digest = lambda t: hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()
print(json.dumps({"logits": digest(torch.cat([first, step])), "k": digest(cache.k),
                  "v": digest(cache.v), "argmax": step.argmax(-1).tolist()}))
"""


def _run_build(isa: str, model: Path) -> dict[str, object]:
    env = {**os.environ, "LIFECYCLE_NATIVE_ISA": isa, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(model)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _other_builds() -> list[str]:
    return ["portable", *(["avx2"] if native.cpu_has("avx512f") else [])]


def test_every_build_runs_the_model_to_the_same_bits(tiny_gguf: TinyModel) -> None:
    """The default build against each other build: logits and the whole K/V cache of a
    mixed step (decodes, a long fresh prompt, a chunk after a cached prefix)."""
    want = _run_build("auto", tiny_gguf.path)
    for isa in _other_builds():
        assert _run_build(isa, tiny_gguf.path) == want, isa


@pytest.mark.parametrize("hd", [64, 32])
def test_attention_builds_agree(hd: int) -> None:
    """The attention kernel alone, every build, head_dim 64 (the AVX2 path) and 32 (the
    portable loop in every build), keys not a multiple of 8 or of the block."""
    g = torch.Generator().manual_seed(hd)
    d, h, kv, bs, nb = 5, 6, 2, 16, 6
    q = torch.randn(d, h, hd, generator=g)
    kc = torch.randn(kv, nb * bs, hd, generator=g) * 2
    vc = torch.randn(kv, nb * bs, hd, generator=g)
    tables = torch.tensor([[5, 4, 3, 2, 1, 0]] * d, dtype=torch.int32)
    lens = torch.tensor([1, 7, 16, 41, 96], dtype=torch.int32)
    kernels = native.load_kernels()
    assert kernels is not None
    want = kernels.paged_decode_attention(q, kc, vc, tables, lens, bs, hd**-0.5)
    for isa in _other_builds():
        other = native.load_kernels_built_for(isa)
        got = other.paged_decode_attention(q, kc, vc, tables, lens, bs, hd**-0.5)
        assert torch.equal(got, want), isa
    # and one sequence alone equals it in the batch
    alone = kernels.paged_decode_attention(q[3:4], kc, vc, tables[3:4], lens[3:4], bs, hd**-0.5)
    assert torch.equal(alone, want[3:4])


def test_rms_norm_rows_are_independent_and_builds_agree() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 579, generator=g) * 4  # not a multiple of 8
    w = torch.randn(579, generator=g)
    kernels = native.load_kernels()
    assert kernels is not None
    y = kernels.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(y, torch.nn.functional.rms_norm(x, (579,), w, 1e-5))
    assert torch.equal(kernels.rms_norm(x[4:5], w, 1e-5), y[4:5])
    for isa in _other_builds():
        assert torch.equal(native.load_kernels_built_for(isa).rms_norm(x, w, 1e-5), y), isa
    with pytest.raises(ValueError, match="norm weight"):
        kernels.rms_norm(x, w[:-1], 1e-5)


def test_isa_names_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIFECYCLE_NATIVE_ISA", "avx9")
    with pytest.raises(RuntimeError, match="LIFECYCLE_NATIVE_ISA='avx9'"):
        native.native_isa()
    with pytest.raises(ValueError, match="expected one of"):
        native.load_kernels_built_for("sse")
