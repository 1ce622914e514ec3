"""What a KV cache stores each K and V value as (``--kv-cache-dtype``'s elements): fp32,
fp16, bf16, and llama.cpp's q8_0 and q4_0 blocks, which the native kernels read in place
(``gpu/kernels/csrc/paged_attention.c``). An element is decided once, where a cache is built
(``kv_element``), and carried as it is: q8_0 and q4_0 are both held as uint8 bytes, so a
tensor's dtype alone cannot say which.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

import torch

__all__ = [
    "KV_ELEMENTS",
    "KV_Q4",
    "KV_Q8",
    "KVElement",
    "KVStore",
    "Q4_BYTES",
    "Q8_BLOCK",
    "Q8_BYTES",
    "kv_element",
    "kv_row_width",
]


@dataclass(frozen=True, slots=True)
class KVElement:
    """What a KV cache stores each K and V value as, decided once where the cache is
    built (``kv_element``): its name (HELLO's ``kv_dtype``, the disk tier's), the torch
    dtype of the cache's tensors, paged_attention.c's ``kv_kind`` (None: the native
    kernels do not read it) and, for llama.cpp's block formats, the values and bytes of
    a block. q8_0 and q4_0 are both held as uint8 bytes: the element, not the tensors'
    dtype, says which."""

    name: str
    dtype: torch.dtype
    kind: int | None
    block: int = 1  # values per block (1: a plain element)
    block_bytes: int = 0  # bytes per block (0: the dtype's size)

    def row_width(self, head_dim: int) -> int:
        """Elements of ``dtype`` in one cache row of ``head_dim`` values."""
        if self.block == 1:
            return head_dim
        return head_dim // self.block * self.block_bytes

    @property
    def value_bytes(self) -> float:
        """Bytes one value takes: the dtype's size, 34 / 32 for q8_0, 18 / 32 for q4_0."""
        return self.block_bytes / self.block if self.block > 1 else self.dtype.itemsize

    @property
    def blocked(self) -> bool:
        """llama.cpp blocks (q8_0, q4_0): read by the native kernels alone."""
        return self.block > 1


# The KV cache's elements, as paged_attention.c's kv_kind: a q8_0 cache holds its rows'
# bytes (llama.cpp's block_q8_0: an fp16 scale, then 32 int8), a q4_0 cache block_q4_0's
# (an fp16 scale, then 16 bytes of 4-bit values), uint8 as torch holds them.
Q8_BLOCK, Q8_BYTES, Q4_BYTES = 32, 34, 18
KV_Q8 = KVElement("q8_0", torch.uint8, 2, Q8_BLOCK, Q8_BYTES)
KV_Q4 = KVElement("q4_0", torch.uint8, 3, Q8_BLOCK, Q4_BYTES)
KV_ELEMENTS = {
    e.name: e
    for e in (
        KVElement("float32", torch.float32, 0),
        KVElement("float16", torch.float16, 1),
        KVElement("bfloat16", torch.bfloat16, None),  # the torch path's alone
        KV_Q8,
        KV_Q4,
    )
}
# What a cache's ``kv_dtype`` takes: an element, or a dtype that one element alone is held
# as (the float ones). uint8 holds both q8_0 and q4_0: those are named by their element.
KVStore: TypeAlias = torch.dtype | KVElement
_HELD_AS = {d: tuple(e for e in KV_ELEMENTS.values() if e.dtype == d)
            for d in dict.fromkeys(e.dtype for e in KV_ELEMENTS.values())}  # fmt: skip
_BY_DTYPE = {dtype: held[0] for dtype, held in _HELD_AS.items() if len(held) == 1}


def kv_element(store: KVStore) -> KVElement:
    """The element ``store`` names: itself, or the one element held as that dtype
    (``ValueError`` for uint8, which holds both q8_0 and q4_0: the element must be named;
    ``KeyError`` for a dtype no cache holds)."""
    if isinstance(store, KVElement):
        return store
    held = _HELD_AS.get(store, ())
    if len(held) > 1:
        raise ValueError(_ambiguous(store))
    return _BY_DTYPE[store]


def _ambiguous(dtype: torch.dtype) -> str:
    names = " and ".join(e.name for e in _HELD_AS[dtype])
    return (f"a bare {dtype} does not say what a KV cache holds: {dtype} holds both {names}; "
            "name the element (KV_Q8, KV_Q4)")  # fmt: skip


def kv_row_width(store: KVStore, head_dim: int) -> int:
    """Elements of ``store`` in one cache row of ``head_dim`` values: ``head_dim``, or for
    q8_0 / q4_0 its bytes (34 / 18 per 32 values)."""
    return kv_element(store).row_width(head_dim)
