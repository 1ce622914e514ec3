"""RoPE's tables, as transformers computes them (``modeling_rope_utils``), and the undoing
of llama.cpp's q/k row permutation: what ``gpu/model/decoder.py`` and ``gpu/model/loader.py`` build a
model's rotary embedding from."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from modelfile.config import RopeScaling

__all__ = ["rope_inv_freq", "rope_tables", "unpermute_rope_rows"]


def unpermute_rope_rows(w: Tensor, n_head: int) -> Tensor:
    """Undo convert_hf_to_gguf's q/k row permutation (llama.cpp's adjacent-pair RoPE).

    GGUF row (head, d, half) holds HF row (head, half, d); this is transformers'
    ``_reverse_permute_weights``. With it, HF rotate-half RoPE is exact.
    """
    rows = w.shape[0]
    dim = rows // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def rope_inv_freq(
    head_dim: int, theta: float, scaling: RopeScaling | None = None,
    freq_factors: Tensor | None = None,
) -> tuple[Tensor, float]:  # fmt: skip
    """RoPE's inverse frequencies ``[head_dim / 2]`` (fp32) and the factor cos/sin are
    scaled by, as transformers' ``modeling_rope_utils`` defines them: linear divides them
    by the factor; yarn blends the interpolated and the original frequencies along a ramp
    between the dimensions that turn ``beta_fast`` and ``beta_slow`` times within the
    original context, scaling cos/sin by 0.1 ln(factor) + 1 unless the file gives it;
    ``freq_factors`` divide them one by one: a llama file's ``rope_freqs`` (Llama 3's
    scaling, precomputed by the converter) or, for longrope (Phi-3,
    ``_compute_longrope_parameters``), the file's long or short factors
    (``RopeScaling.long_factors`` says which), cos/sin scaled by its ``attn_factor``."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    scaling = scaling or RopeScaling()
    if scaling.kind == "longrope":
        if freq_factors is None:
            raise ValueError("longrope needs the file's long or short factors")
        inv_freq = 1.0 / (freq_factors.float().cpu() * theta**exponents)
        return inv_freq, scaling.attn_factor if scaling.attn_factor is not None else 1.0
    inv_freq = 1.0 / (theta**exponents)
    attention = 1.0
    if scaling.kind == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.kind == "yarn":
        inv_freq, attention = _yarn(head_dim, theta, scaling)
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.float().cpu()
    return inv_freq, attention


def _yarn(dim: int, base: float, s: RopeScaling) -> tuple[Tensor, float]:
    def correction_dim(rotations: float) -> float:
        return dim * math.log(s.original_context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(s.beta_fast)), 0)
    high = float(min(math.ceil(correction_dim(s.beta_slow)), dim - 1))
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = 1.0 / (s.factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation
    attention = s.attn_factor if s.attn_factor is not None else 0.1 * math.log(s.factor) + 1.0
    return inv_freq, attention


def rope_tables(
    inv_freq: Tensor, n_positions: int, attention: float = 1.0, device: torch.device | None = None
) -> tuple[Tensor, Tensor]:
    """``cos`` and sign-folded ``sin`` tables ``[n_positions, head_dim]`` (fp32), each
    times ``attention`` (yarn's factor; 1 otherwise).

    HF: ``x*cos + rotate_half(x)*sin`` with ``rotate_half(x) = cat(-x2, x1)``; since
    ``roll(x, d/2) = cat(x2, x1)``, folding the minus sign into the first half of ``sin``
    turns RoPE into ``x*cos + roll(x)*sin`` (a sign flip is exact in floating point).
    """
    half = inv_freq.shape[0]
    pos = torch.arange(n_positions, dtype=torch.int64).float()
    freqs = torch.outer(pos, inv_freq.float())
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if attention != 1.0:
        cos, sin = cos * attention, sin * attention
    sin[:, :half].neg_()
    return cos.to(device), sin.to(device)
