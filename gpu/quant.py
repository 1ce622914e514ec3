"""Weights kept as GGUF quantized blocks on the CPU, and the linear layer that reads them.

A ``QuantWeight`` is one matrix ``[N, K]`` stored as its GGUF blocks, uint8 ``[N, K / 32 *
block bytes]``: Q4_1 as the bundled model stores its projections (0.625 bytes a weight),
Q8_0 as it stores the embedding and tied LM head (1.06). One copy, nothing dequantized
ahead: ``QuantLinear`` multiplies by the blocks in place (``gpu/csrc/quant_linear.c``:
at decode row counts an int8 dot product that reads 6.4x fewer bytes than fp32, from 8
rows on fp32 panels dequantized per tile), and the embedding dequantizes just the rows a
step looks up. Types the kernel does not read (Q4_0, Q5_x, the k-quants, ...) are
requantized to Q8_0 once at load (``requantize``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize
from torch import Tensor

from gpu.native import QUANT_BLOCK_BYTES, NativeKernels

__all__ = ["KERNEL_TYPES", "QuantLinear", "QuantWeight", "requantize"]

# GGML types whose blocks the kernel reads in place.
KERNEL_TYPES = frozenset(Q(t) for t in QUANT_BLOCK_BYTES)


@dataclass(frozen=True, eq=False)
class QuantWeight:
    """A matrix ``[rows, k]`` as GGUF blocks: uint8 ``[rows, k / 32 * block bytes]``."""

    blocks: Tensor
    qtype: Q
    k: int

    def __post_init__(self) -> None:
        row = self.k // 32 * QUANT_BLOCK_BYTES[self.qtype]
        if self.k % 32 or self.blocks.dtype != torch.uint8 or self.blocks.shape[1:] != (row,):
            raise ValueError(
                f"{self.qtype.name} blocks {tuple(self.blocks.shape)} do not hold rows of {self.k}"
            )

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.blocks.shape[0]), self.k

    def rows(self, ids: Tensor) -> Tensor:
        """Rows ``ids`` dequantized to fp32 ``[*ids.shape, k]``, exactly as gguf.quants
        dequantizes them (the embedding lookup)."""
        raw = self.blocks[ids.reshape(-1)]
        nb = self.k // 32
        raw = raw.view(-1, nb, QUANT_BLOCK_BYTES[self.qtype])
        d = raw[..., 0:2].view(torch.float16).float()
        if self.qtype == Q.Q8_0:
            out = d * raw[..., 2:].view(torch.int8).float()
        else:  # Q4_1: fp16 d, fp16 m, 16 bytes of nibbles (low: elements 0-15, high: 16-31)
            m = raw[..., 2:4].view(torch.float16).float()
            qs = raw[..., 4:]
            out = d * torch.cat((qs & 15, qs >> 4), dim=-1).float() + m
        return out.reshape(*ids.shape, self.k)

    def dequantize(self) -> Tensor:
        """The whole matrix as fp32 ``[rows, k]`` (tests, and the dense fallbacks)."""
        return self.rows(torch.arange(self.shape[0]))


def requantize(w: Tensor, qtype: Q = Q.Q8_0) -> QuantWeight:
    """An fp32 ``[N, K]`` matrix (K % 32 == 0) as ``qtype`` blocks (a type the kernel
    reads), gguf.quants' quantizer."""
    arr = np.ascontiguousarray(w.detach().float().cpu().numpy())
    return QuantWeight(torch.from_numpy(quantize(arr, qtype).copy()), qtype, int(w.shape[1]))


class QuantLinear:
    """``F.linear(x, w)`` without bias for fp32 rows ``x [M, K]`` and ``w`` a ``QuantWeight``,
    through the native kernel. The only approximation is x's rounding to int8 per block
    of 32 below 8 rows (llama.cpp's; about 2^-8 relative per block)."""

    __slots__ = ("blocks", "kernels", "qtype", "weight")

    def __init__(self, weight: QuantWeight, kernels: NativeKernels) -> None:
        self.weight = weight
        self.blocks = weight.blocks.contiguous()
        self.qtype = int(weight.qtype)
        self.kernels = kernels

    def __call__(self, x: Tensor) -> Tensor:
        if x.dim() != 2:
            return self(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)
        return self.kernels.q_linear(x, self.blocks, self.qtype)
