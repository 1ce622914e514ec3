"""Weights kept as GGUF quantized blocks on the CPU, and the linear layer that reads them.

A ``QuantWeight`` is one matrix ``[N, K]`` stored as its GGUF blocks, uint8 ``[N,
quant_row_bytes]``: Q4_1 as the bundled model stores its projections (0.625 bytes a
weight), Q8_0 as it stores the embedding and tied LM head (1.06), and Q4_0, Q5_0, Q5_1,
Q4_K, Q5_K, Q6_K as other files do (Q4_K_M: Q4_K and Q6_K, 0.56 and 0.82). One copy,
nothing dequantized ahead: ``QuantLinear`` multiplies by the blocks in place
(``gpu/kernels/csrc/quant_linear.c``: an int8 dot product per block of 32, one function of each
row whatever the call holds), and the embedding dequantizes just the rows a step looks
up. Types the kernel does not read (Q2_K, Q3_K, the IQ types, ...) are requantized once
at load (``requantize``; the loader logs which and what it costs).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize
from torch import Tensor

from gpu.kernels.native import (
    QL_MAX_PARTS,
    QL_PARTS,
    QUANT_TYPES,
    NativeKernels,
    QParts,
    load_kernels,
    quant_row_bytes,
)

__all__ = ["KERNEL_TYPES", "QuantLinear", "QuantWeight", "requantize"]

# GGML types whose blocks the kernel reads in place.
KERNEL_TYPES = frozenset(Q(t) for t in QUANT_TYPES)


@dataclass(frozen=True, eq=False)
class QuantWeight:
    """A matrix ``[rows, k]`` as GGUF blocks: uint8 ``[rows, quant_row_bytes(qtype, k)]``."""

    blocks: Tensor
    qtype: Q
    k: int

    def __post_init__(self) -> None:
        row = quant_row_bytes(int(self.qtype), self.k)  # None unless k is whole blocks
        if row is None or self.blocks.dtype != torch.uint8 or self.blocks.shape[1:] != (row,):
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
        if self.qtype not in (Q.Q8_0, Q.Q4_1):
            kernels = load_kernels()
            assert kernels is not None  # a QuantWeight of these types exists only with them
            return kernels.q_dequantize(raw, int(self.qtype), self.k).reshape(*ids.shape, self.k)
        nb = self.k // 32
        raw = raw.view(-1, nb, 34 if self.qtype == Q.Q8_0 else 20)
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
    """``F.linear(x, w)`` without bias for fp32 rows ``x [M, K]`` and ``w`` a ``QuantWeight``
    or a few of them of different types stacked row-wise (``parts``: a fused q/k/v whose
    v the file stores in another type than q and k, as Q4_K_M files do), through the
    native kernel. The only approximation is x's rounding to int8 per block of 32
    (llama.cpp's; about 2^-8 relative per block). ``ptr`` and ``qtype`` are what
    ``q_linear`` takes (for parts, a ``QParts`` and ``QL_PARTS``); ``blocks`` holds every
    byte of the weight."""

    __slots__ = ("_parts", "blocks", "kernels", "n", "ptr", "qtype", "weights")

    def __init__(self, weight: QuantWeight | Sequence[QuantWeight], kernels: NativeKernels) -> None:
        self.kernels = kernels
        self._parts: QParts | None = None
        self.weights = parts = (weight,) if isinstance(weight, QuantWeight) else tuple(weight)
        self.n = sum(p.shape[0] for p in parts)
        if isinstance(weight, QuantWeight):
            self.blocks = weight.blocks.contiguous()
            self.qtype, self.ptr = int(weight.qtype), self.blocks.data_ptr()
            return
        if not 1 < len(parts) <= QL_MAX_PARTS or len({p.k for p in parts}) != 1:
            raise ValueError(f"{len(parts)} parts of {sorted({p.k for p in parts})} columns")
        self.blocks = torch.cat([p.blocks.reshape(-1) for p in parts])
        desc, at = QParts(), 0
        desc.n = len(parts)
        for i, p in enumerate(parts):
            desc.qtype[i], desc.rows[i] = int(p.qtype), p.shape[0]
            desc.w[i] = self.blocks.data_ptr() + at
            at += p.blocks.numel()
        self._parts, self.qtype, self.ptr = desc, QL_PARTS, ctypes.addressof(desc)

    def __call__(self, x: Tensor) -> Tensor:
        if x.dim() != 2:
            return self(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)
        if self._parts is not None:
            return self.kernels.q_linear_parts(x, self._parts, self.n)
        return self.kernels.q_linear(x, self.blocks, self.qtype)
