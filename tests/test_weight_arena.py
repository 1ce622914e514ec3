"""The packed weights' memory (gpu/kernels/arena.py): carved in order, in huge pages where
the platform advises them, held by the tensors, counted once; and the bundled model's
layers lie in it in the order a step reads them."""

from __future__ import annotations

import gc
from typing import cast

import pytest
import torch

from gpu.kernels.arena import (
    ALIGN,
    CHUNK_BYTES,
    HUGE_PAGE,
    TorchArena,
    WeightArena,
    huge_pages_advisable,
    weight_arena,
)
from gpu.kernels.cpu_runtime import trim_heap
from gpu.kernels.native import load_kernels
from gpu.model.loader import load_model
from gpu.model.quant import QuantLinear

needs_packing = pytest.mark.skipif(
    (k := load_kernels()) is None or not k.packs, reason="this build does not pack weights"
)


def _huge_kib(addr: int) -> int:
    """AnonHugePages (KiB) of the mapping of this process holding ``addr``."""
    current = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                current = lo <= addr < hi
            elif current and head == "AnonHugePages:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {addr:#x}")


def test_tensors_are_carved_in_order_aligned_and_disjoint() -> None:
    arena = WeightArena(chunk_bytes=4 * HUGE_PAGE)
    sizes = [(3, 1000), (1, 64), (5, 7), (2, 100_000), (1, 1)]
    got = [arena.empty(s) for s in sizes]
    assert [tuple(t.shape) for t in got] == sizes and all(t.dtype == torch.uint8 for t in got)
    assert got[0].data_ptr() % HUGE_PAGE == 0  # a chunk starts on a huge page
    for a, b in zip(got, got[1:], strict=False):
        assert b.data_ptr() == a.data_ptr() + -(-a.numel() // ALIGN) * ALIGN
    for i, t in enumerate(got):
        t.fill_(i + 1)
    assert [int(t.min()) for t in got] == [int(t.max()) for t in got] == [1, 2, 3, 4, 5]


def test_a_new_chunk_where_a_tensor_does_not_fit() -> None:
    arena = WeightArena(chunk_bytes=HUGE_PAGE)
    a = arena.empty((HUGE_PAGE - 100,))
    b = arena.empty((200,))  # does not fit after a: the next chunk
    big = arena.empty((3, HUGE_PAGE))  # larger than a chunk: one of its own size
    c = arena.empty((10,))
    assert b.data_ptr() % HUGE_PAGE == 0 and b.data_ptr() != a.data_ptr()
    assert big.data_ptr() % HUGE_PAGE == 0 and big.untyped_storage().nbytes() == 4 * HUGE_PAGE
    assert c.data_ptr() % HUGE_PAGE == 0  # big filled its chunk
    big.fill_(9)
    assert int(big.sum()) == 9 * 3 * HUGE_PAGE


def test_memory_outlives_the_arena() -> None:
    arena = WeightArena()
    t = arena.empty((1000,))
    t.copy_(torch.arange(1000) % 251)
    del arena
    gc.collect()
    assert torch.equal(t, (torch.arange(1000) % 251).to(torch.uint8))


def test_bad_sizes_refused() -> None:
    with pytest.raises(ValueError, match="multiple of"):
        WeightArena(chunk_bytes=HUGE_PAGE + 4096)
    with pytest.raises(ValueError, match="negative"):
        WeightArena().empty((2, -1))


def test_the_platform_decides_the_arena() -> None:
    assert isinstance(weight_arena(), WeightArena if huge_pages_advisable() else TorchArena)
    assert tuple(TorchArena().empty((2, 3)).shape) == (2, 3)


@pytest.mark.skipif(not huge_pages_advisable(), reason="huge pages cannot be advised here")
def test_touched_chunks_are_backed_by_huge_pages() -> None:
    t = WeightArena().empty((8 * HUGE_PAGE,))
    t.fill_(1)
    assert _huge_kib(t.data_ptr()) >= HUGE_PAGE // 1024


@needs_packing
def test_the_bundled_models_weights_lie_in_step_order() -> None:
    """Layer by layer, q/k/v, o, gate/up, down, then the embedding (the tied head): each
    right after the one before it (a new chunk where it does not fit), every one read
    where it lies (a layer's parts too), in huge pages where they can be had;
    ``weight_bytes`` counts each byte once."""
    lm = load_model(None, device="cpu", weights="quantized")
    lins = [cast(QuantLinear, lin) for lin in lm.model.linears()]
    tensors = [b for lin in lins[:-1] for b in lin.blocks] + [lm.model.embed]
    assert cast(QuantLinear, lm.model.head).blocks[0].data_ptr() == lm.model.embed.data_ptr()
    runs = [[tensors[0]]]  # consecutive tensors of one chunk
    for t in tensors[1:]:
        same = t.untyped_storage().data_ptr() == runs[-1][-1].untyped_storage().data_ptr()
        runs[-1].append(t) if same else runs.append([t])
    chunks = {t.untyped_storage().data_ptr() for t in tensors}
    assert len(runs) == len(chunks)  # a chunk once left is never returned to
    for run in runs:  # each right after the one before it
        for a, b in zip(run, run[1:], strict=False):
            assert b.data_ptr() == a.data_ptr() + -(-a.nbytes // ALIGN) * ALIGN
    total = sum(t.nbytes for t in tensors)
    if huge_pages_advisable():
        assert len(chunks) <= -(-total // CHUNK_BYTES) + 1  # few chunks, not one per tensor
        assert _huge_kib(lm.model.embed.data_ptr()) > 0
    others = [t for t in (*lm.model.parameters(), *lm.model.buffers())
              if t.untyped_storage().data_ptr() not in chunks]  # fmt: skip
    assert lm.model.weight_bytes() == total + sum(t.nbytes for t in others)


def test_trim_heap_runs() -> None:
    assert trim_heap() is True or not __import__("sys").platform.startswith("linux")
