"""``PackedLinear``: the oneDNN pre-reordered CPU path agrees with ``F.linear``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu.model.decoder import PackedLinear


@pytest.mark.parametrize("rows", [0, 1, 3, 32, 77])
def test_packed_matches_linear(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(200, 96, generator=g)
    lin = PackedLinear(w)
    x = torch.randn(rows, 96, generator=g)
    with torch.inference_mode():
        out = lin(x)
    assert out.shape == (rows, 200)
    torch.testing.assert_close(out, F.linear(x, w), atol=1e-4, rtol=1e-5)


def test_packed_path_is_taken_on_cpu_fp32_and_handles_views() -> None:
    w = torch.randn(64, 32)
    lin = PackedLinear(w)
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN")
    assert lin.packed is not None
    x = torch.randn(4, 64)[:, ::2]  # non-contiguous input
    torch.testing.assert_close(lin(x), x @ w.T, atol=1e-5, rtol=1e-5)
    x3 = torch.randn(2, 3, 32)
    torch.testing.assert_close(lin(x3), F.linear(x3, w), atol=1e-5, rtol=1e-5)


def test_half_precision_falls_back_to_linear() -> None:
    w = torch.randn(16, 8, dtype=torch.bfloat16)
    lin = PackedLinear(w)
    assert lin.packed is None
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    assert torch.equal(lin(x), F.linear(x, w))
