"""Memory for weights read at every step: in transparent huge pages, in the order a step
reads them.

A decode step of one sequence streams every weight of the model once, a few hundred MB,
and does little else: on the CPU its time is the time to read them. Packed one tensor at
a time into 4 KiB pages (torch's allocator: glibc's heap, where ``madvise`` is the
kernel's default for transparent huge pages), each 4 KiB page is a TLB miss and a page
walk, and the hardware prefetchers stop at every page boundary. ``WeightArena`` carves the
packed weights instead out of anonymous private mappings of ``CHUNK_BYTES`` (or one
tensor's size, when larger), 2 MiB aligned and advised ``MADV_HUGEPAGE``, one after the
other as the loader packs them: layer by layer, each layer's projections in the order
the forward calls them, then the embedding and LM head. The Qwen2.5-0.5B shape's one-row
step on a 2-vCPU Xeon, median of 41, three interleaved runs (2026-12-07): torch's
allocator 30.3 / 29.7 / 30.1 ms, torch's own huge pages for its allocations of 2 MiB and
more (``THP_MEM_ALLOC_ENABLE=1``) 25.0 / 26.4 / 25.1, this arena 20.7 / 23.2 / 25.5.

A tensor carved here holds its mapping (``torch.frombuffer`` keeps the buffer alive): a
chunk is unmapped when the last of its tensors is freed, and a chunk's pages never
touched are never backed. Where the platform cannot advise huge pages (not Linux, or
THP set to ``never``) ``weight_arena`` gives ``TorchArena``, plain ``torch.empty``: the
same tensors, the same bits, decided once, where the loader builds its arena.
"""

from __future__ import annotations

import mmap
import sys
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor

__all__ = [
    "ALIGN",
    "CHUNK_BYTES",
    "HUGE_PAGE",
    "Arena",
    "TorchArena",
    "WeightArena",
    "huge_pages_advisable",
    "weight_arena",
]

HUGE_PAGE = 2 << 20
CHUNK_BYTES = 64 << 20
ALIGN = 64  # each tensor starts on a cache line
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


class Arena(Protocol):
    def empty(self, shape: tuple[int, ...]) -> Tensor:
        """A new uint8 tensor of ``shape``, contents undefined."""
        ...


class TorchArena:
    """``torch.empty``: where huge pages cannot be advised."""

    def empty(self, shape: tuple[int, ...]) -> Tensor:
        return torch.empty(shape, dtype=torch.uint8)


class WeightArena:
    """uint8 tensors carved in order of request from 2 MiB-aligned anonymous mappings
    advised ``MADV_HUGEPAGE`` (module docstring); each starts ``ALIGN``-aligned right
    after the one before it, or at the start of a new chunk where it does not fit."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES) -> None:
        if chunk_bytes < HUGE_PAGE or chunk_bytes % HUGE_PAGE:
            raise ValueError(f"chunk of {chunk_bytes} bytes: a multiple of {HUGE_PAGE} expected")
        self.chunk_bytes = chunk_bytes
        self._chunk: Tensor | None = None
        self._at = 0

    def empty(self, shape: tuple[int, ...]) -> Tensor:
        n = 1
        for s in shape:
            if s < 0:
                raise ValueError(f"negative size in {shape}")
            n *= s
        if self._chunk is None or self._at + n > self._chunk.numel():
            self._chunk = _huge_chunk(max(self.chunk_bytes, -(-n // HUGE_PAGE) * HUGE_PAGE))
            self._at = 0
        out = self._chunk[self._at : self._at + n].view(shape)
        self._at += -(-n // ALIGN) * ALIGN
        return out


def _huge_chunk(size: int) -> Tensor:
    """``size`` bytes (a multiple of ``HUGE_PAGE``) starting on a huge page boundary,
    advised for huge pages: a view of a private anonymous mapping one huge page larger."""
    m = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(m, dtype=torch.uint8)  # holds the mapping
    start = -whole.data_ptr() % HUGE_PAGE
    m.madvise(mmap.MADV_HUGEPAGE, start, size)
    return whole[start : start + size]


def huge_pages_advisable() -> bool:
    """Whether ``madvise(MADV_HUGEPAGE)`` can give this process huge pages: Linux, the
    constant known, and transparent huge pages not set to ``never``."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        setting = THP_ENABLED.read_text()
    except OSError:
        return False
    return "[never]" not in setting


def weight_arena() -> Arena:
    """The arena a model's packed weights are carved from on this platform."""
    return WeightArena() if huge_pages_advisable() else TorchArena()
