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

Where the kernels' build has vector paths, the loader keeps each matrix packed
(``QuantWeight.packed``): the same blocks re-laid in panels of 16 rows by ``q_pack``
(quant_linear.c), which decode and small batches read without unpacking a row per call.
The function computed is the same, bit for bit; only the layout differs.
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

from gpu.kernels.arena import Arena
from gpu.kernels.native import (
    QL_MAX_PARTS,
    QL_PARTS,
    QP_FLAG,
    QP_ROWS,
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
    """A matrix ``[rows, k]`` as GGUF blocks: uint8 ``[rows, quant_row_bytes(qtype, k)]``,
    or, with ``packed_rows`` (the rows), those blocks packed by ``q_pack`` into uint8
    ``[panels of QP_ROWS, bytes]`` (``packed``)."""

    blocks: Tensor
    qtype: Q
    k: int
    packed_rows: int | None = None

    def __post_init__(self) -> None:
        if self.packed_rows is not None:
            panels = -(-self.packed_rows // QP_ROWS)
            if (
                self.blocks.dtype != torch.uint8
                or self.blocks.dim() != 2
                or self.blocks.shape[0] != panels
            ):
                raise ValueError(
                    f"{tuple(self.blocks.shape)} is not {self.packed_rows} packed rows"
                )
            return
        row = quant_row_bytes(int(self.qtype), self.k)  # None unless k is whole blocks
        if row is None or self.blocks.dtype != torch.uint8 or self.blocks.shape[1:] != (row,):
            raise ValueError(
                f"{self.qtype.name} blocks {tuple(self.blocks.shape)} do not hold rows of {self.k}"
            )

    @property
    def shape(self) -> tuple[int, int]:
        rows = self.packed_rows if self.packed_rows is not None else int(self.blocks.shape[0])
        return rows, self.k

    @property
    def code(self) -> int:
        """The type as ``q_linear`` takes it: the GGML code, with ``QP_FLAG`` when packed."""
        return int(self.qtype) | (QP_FLAG if self.packed_rows is not None else 0)

    def packed(self, kernels: NativeKernels, arena: Arena | None = None) -> QuantWeight:
        """This matrix packed into panels (``q_pack``, carved from ``arena``), or itself
        where ``kernels``' build does not pack or it already is."""
        if self.packed_rows is not None:
            return self
        wp = kernels.q_pack(self.blocks.contiguous(), int(self.qtype), self.k, arena)
        return self if wp is None else QuantWeight(wp, self.qtype, self.k, self.shape[0])

    def rows(self, ids: Tensor, kernels: NativeKernels | None = None) -> Tensor:
        """Rows ``ids`` dequantized to fp32 ``[*ids.shape, k]``, exactly as gguf.quants
        dequantizes them (the embedding lookup); through ``kernels`` where given (a
        model's, held since it was built), else the process's (``load_kernels``)."""
        if self.packed_rows is not None or self.qtype not in (Q.Q8_0, Q.Q4_1):
            kernels = kernels or load_kernels()
            assert kernels is not None  # a QuantWeight of these types exists only with them
            if self.packed_rows is not None:
                out = kernels.q_packed_rows(self.blocks, ids, int(self.qtype), *self.shape)
                return out.reshape(*ids.shape, self.k)
            raw = self.blocks[ids.reshape(-1)]
            return kernels.q_dequantize(raw, int(self.qtype), self.k).reshape(*ids.shape, self.k)
        raw = self.blocks[ids.reshape(-1)]
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
    byte of the weight: its one tensor, or each part's, read where it lies (the loader
    carved them one after the other: ``gpu/kernels/arena.py``)."""

    __slots__ = ("_parts", "blocks", "kernels", "n", "ptr", "qtype", "weights")

    def __init__(self, weight: QuantWeight | Sequence[QuantWeight], kernels: NativeKernels) -> None:
        self.kernels = kernels
        self._parts: QParts | None = None
        self.weights = parts = (weight,) if isinstance(weight, QuantWeight) else tuple(weight)
        self.n = sum(p.shape[0] for p in parts)
        self.blocks = tuple(p.blocks.contiguous() for p in parts)
        if isinstance(weight, QuantWeight):
            self.qtype, self.ptr = weight.code, self.blocks[0].data_ptr()
            return
        if not 1 < len(parts) <= QL_MAX_PARTS or len({p.k for p in parts}) != 1:
            raise ValueError(f"{len(parts)} parts of {sorted({p.k for p in parts})} columns")
        desc = QParts()
        desc.n = len(parts)
        for i, (p, b) in enumerate(zip(parts, self.blocks, strict=True)):
            desc.qtype[i], desc.rows[i], desc.w[i] = p.code, p.shape[0], b.data_ptr()
        self._parts, self.qtype, self.ptr = desc, QL_PARTS, ctypes.addressof(desc)

    def __call__(self, x: Tensor) -> Tensor:
        if x.dim() != 2:
            return self(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)
        if self._parts is not None:
            return self.kernels.q_linear_parts(x, self._parts, self.n)
        if self.qtype & QP_FLAG:
            return self.kernels.q_linear_packed(x, self.blocks[0], self.qtype & ~QP_FLAG, self.n)
        return self.kernels.q_linear(x, self.blocks[0], self.qtype)
