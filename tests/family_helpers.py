"""What the architecture tests against transformers share (tests/test_families.py,
tests/test_families_served.py, tests/test_families_config.py): the tiny random models'
prompts, transformers' logits, greedy decoding on the paged cache, and the fp32 bound."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gpu.kernels import native
from tests.test_model import PagedSeqs, run_steps

needs_kernels = pytest.mark.skipif(
    native.load_kernels() is None, reason="quantized weights need the native kernels"
)

# Our fp32 logits may be at most this many times as far from transformers' in float64 as
# transformers' own float32 logits are (the derivation: tests/test_families.py).
FP32_FACTOR = 4.0


def prompt_ids(n: int, seed: int) -> list[int]:
    """``n`` token ids of the tiny vocabulary, drawn by ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return [int(i) for i in torch.randint(4, 269, (n,), generator=g)]


def hf_logits(model: Any, ids: list[int]) -> torch.Tensor:
    """A transformers model's logits at every position of ``ids``, in float64."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].to(torch.float64)


def paged_greedy(lm: Any, prompt: list[int], n: int, fuse: bool = True,
                 follow: list[int] | None = None) -> tuple[list[int], torch.Tensor]:  # fmt: skip
    """Quantized weights on the paged cache: the prompt, then ``n`` decodes, each of the
    token picked (``follow``'s instead, where given). (the picks, the decodes' logits)"""
    seqs, picks, rows, step = PagedSeqs(lm, 1, 256, fuse=fuse), [], [], prompt
    for i in range(n):
        rows.append(run_steps(lm.model, seqs, [([0], [step])])[0][-1])
        picks.append(int(rows[-1].argmax()))
        step = [follow[i] if follow else picks[-1]]
    return picks, torch.stack(rows).double()
