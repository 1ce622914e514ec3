"""How big the KV cache is: sized by tokens or MiB on the CPU, by a fraction of the
card's free memory on a GPU (``--mem-fraction``, as SGLang's ``mem_fraction_static``
is read here: of the memory free once the weights are loaded, this share is static).

From that share ``plan_kv`` keeps back what a step needs besides the cache (the largest
step's working set and the captured graphs' pool, both allocated after it); what remains
is the KV cache, in whole blocks. The arithmetic is pure so that the CPU tests check it;
on a GPU ``cuda_free_bytes`` reads the card. Once built, ``MemoryFootprint`` splits the
worker's resident memory (RSS) into the weights, the KV cache's resident part and the
rest, for its log line and its STATS frames.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import psutil

from modelfile.config import ModelConfig

if TYPE_CHECKING:
    from torch import Tensor

__all__ = [
    "KVPlan",
    "MemoryFootprint",
    "decode_bytes",
    "device_memory",
    "kv_bytes_per_token",
    "plan_kv",
    "prefill_bytes",
    "resident_bytes",
]


def kv_bytes_per_token(mc: ModelConfig, elem: float) -> int:
    """K and V of every layer for one token, ``elem`` bytes a value (34 / 32 for q8_0, 18 / 32 for q4_0:
    ``gpu/cache/kv_cache.py``, ``kv_value_bytes``; exact, its head_dim a multiple of 32)."""
    return int(2 * mc.n_layers * mc.n_kv_heads * mc.head_dim * elem)


def _row_bytes(mc: ModelConfig, elem: int) -> int:
    """One row through the widest layer: residual, normed input, q/k/v, attention
    output, gate/up and their product."""
    qkv = (mc.n_heads + 2 * mc.n_kv_heads) * mc.head_dim
    return (3 * mc.hidden + qkv + mc.n_heads * mc.head_dim + 3 * mc.ffn) * elem


def prefill_bytes(mc: ModelConfig, step_tokens: int, max_running: int, elem: int) -> int:
    """An eager step's peak besides the cache and the weights: ``step_tokens`` rows
    through the widest layer (x2: an op's input and output live at once), one prefill
    chunk's attention scores, and fp32 logits for ``max_running`` rows three times
    over (head output, sampler, mask)."""
    scores = mc.n_heads * step_tokens * step_tokens * 4
    logits = 3 * max_running * mc.vocab_size * 4
    return 2 * step_tokens * _row_bytes(mc, elem) + scores + logits


def decode_bytes(mc: ModelConfig, rows: int, context: int, elem: int) -> int:
    """A decode step of ``rows`` sequences at ``context`` keys: each layer gathers their
    K and V blocks (``[n_kv * rows, context, head_dim]`` twice) and keeps fp32 scores
    and probabilities, besides the rows' activations and logits. A captured step's
    graph pool holds this much (its intermediates stay allocated between replays)."""
    gathered = 2 * mc.n_kv_heads * rows * context * mc.head_dim * elem
    scores = 2 * mc.n_heads * rows * context * 4
    logits = 3 * rows * mc.vocab_size * 4
    return gathered + scores + 2 * rows * _row_bytes(mc, elem) + logits


@dataclass(frozen=True, slots=True)
class KVPlan:
    blocks: int
    bytes: int  # the cache's size
    free_bytes: int  # free on the device when sized (after the weights)
    reserve_bytes: int  # kept back for activations and graphs
    fraction: float

    def info(self) -> dict[str, int | float]:
        return {
            "kv_cache_bytes": self.bytes,
            "mem_fraction": self.fraction,
            "mem_free_at_sizing": self.free_bytes,
            "mem_reserved_for_steps": self.reserve_bytes,
        }


def plan_kv(
    free_bytes: int,
    fraction: float,
    mc: ModelConfig,
    elem: int,
    block_size: int,
    step_tokens: int,
    max_running: int,
    graphs: bool,
) -> KVPlan:
    """The KV cache for ``fraction`` of ``free_bytes``, less the largest step's working
    set (eager prefill or decode of ``max_running`` sequences at the model's context)
    and, with ``graphs``, the graph pool (the larger of one such decode step and one
    piecewise step's layer at ``step_tokens`` rows, ``gpu/backends/piecewise.py``: the captures
    share the pool, and their static buffers are views of one set); at least one block.
    ``ValueError`` for a fraction outside (0, 1]."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"mem fraction must be in (0, 1], got {fraction}")
    decode = decode_bytes(mc, max_running, mc.context_length, elem)
    reserve = max(prefill_bytes(mc, step_tokens, max_running, elem), decode)
    pieces = 2 * step_tokens * _row_bytes(mc, elem)
    reserve += max(decode, pieces) if graphs else 0
    usable = max(0, int(free_bytes * fraction) - reserve)
    per_block = kv_bytes_per_token(mc, elem) * block_size
    blocks = max(1, usable // per_block)
    return KVPlan(blocks, blocks * per_block, free_bytes, reserve, fraction)


@dataclass(frozen=True, slots=True)
class MemoryFootprint:
    """What the weights and the KV cache take, and where they live.

    The weights are copied out of the file at load: allocated is resident. The KV cache
    is reserved whole (``kv_bytes``) but resident only where it was written: on the CPU
    its tensors come from calloc (``gpu/cache/kv_cache.py``), fresh pages the kernel maps on
    first write, so counting it resident at its reserved size made ``other`` negative
    (``other -375 MiB`` at start-up, issue 53). Its resident part is measured on each
    split (``kv_ranges``, ``resident_bytes``) and ``other`` is what is left of the RSS
    besides resident figures. On a GPU neither lives in the process's RSS: the split
    counts them as 0 there and gives their sizes on the card beside it. At ``--tp K``
    this is rank 0's process and shard."""

    weights_bytes: int
    kv_bytes: int  # reserved: the K and V tensors' bytes
    device: str  # "cpu", or the accelerator holding both (e.g. "cuda:0")
    kv_ranges: tuple[tuple[int, int], ...]  # K and V in this process's memory: (address, bytes)

    @classmethod
    def of(cls, weights_bytes: int, kv: Sequence[Tensor], device: str) -> MemoryFootprint:
        """The footprint of weights of ``weights_bytes`` and the cache's K and V
        tensors ``kv`` (contiguous, alive as long as the footprint is used) on
        ``device``."""
        ranges = tuple((t.data_ptr(), t.nbytes) for t in kv) if device == "cpu" else ()
        return cls(weights_bytes, sum(t.nbytes for t in kv), device, ranges)

    def split(self, rss: int | None = None) -> dict[str, int]:
        """``rss_bytes = weights_bytes + kv_resident_bytes + other_bytes`` (this process
        now, or ``rss``); ``kv_bytes`` is the cache's reserved size, ``kv_resident_bytes``
        how much of it is in RAM now; ``other`` is the interpreter, torch, the tokenizer,
        step buffers."""
        on_host = self.device == "cpu"
        # The cache first: a page a step writes meanwhile is in the RSS read after it.
        resident = resident_bytes(self.kv_ranges) if on_host else 0
        rss = psutil.Process().memory_info().rss if rss is None else rss
        weights, kv = (self.weights_bytes, self.kv_bytes) if on_host else (0, 0)
        out = {"rss_bytes": rss, "weights_bytes": weights, "kv_bytes": kv,
               "kv_resident_bytes": resident, "other_bytes": rss - weights - resident}  # fmt: skip
        if not on_host:
            out.update(device_weights_bytes=self.weights_bytes, device_kv_bytes=self.kv_bytes)
        return out

    def line(self, split: dict[str, int] | None = None) -> str:
        """``memory: rss R MiB = weights W MiB + kv K MiB resident of C MiB reserved +
        other O MiB`` (the worker log); on a GPU ``kv 0 MiB`` and the card's sizes."""
        s = self.split() if split is None else split
        mib = {k: v / 2**20 for k, v in s.items()}
        kv = (f"kv {mib['kv_resident_bytes']:.0f} MiB resident of {mib['kv_bytes']:.0f} MiB "
              "reserved" if self.device == "cpu" else "kv 0 MiB")  # fmt: skip
        text = (f"memory: rss {mib['rss_bytes']:.0f} MiB = weights {mib['weights_bytes']:.0f} "
                f"MiB + {kv} + other {mib['other_bytes']:.0f} MiB")  # fmt: skip
        if self.device != "cpu":
            text += (f" (on {self.device}: weights {self.weights_bytes / 2**20:.0f} MiB, "
                     f"kv {self.kv_bytes / 2**20:.0f} MiB)")  # fmt: skip
        return text


# mincore(2) answers a byte a page, of which only the low bit (resident) is defined; a
# chunk of 2^18 pages (1 GiB of 4 KiB pages) keeps its answer to 256 KiB.
_LOW_BIT = bytes(i & 1 for i in range(256))
_CHUNK_PAGES = 1 << 18


def resident_bytes(ranges: Iterable[tuple[int, int]]) -> int:
    """Bytes of these ``(address, bytes)`` ranges of this process's memory that are in
    RAM now, at most each range's own: mincore(2) over their pages, a walk of the page
    tables that touches none (about 1 ms for a 640 MiB cache; asked per STATS, never
    per step). A huge page counts whole, as the RSS does. A page only ever read (the
    kernel's shared zero page, which the RSS leaves out) would count too; attention
    reads only blocks a step wrote. /proc/self/smaps counts by mapping, and a small
    cache has none of its own (it is carved from the heap); touching every page to
    know would make the whole cache resident."""
    page, total = mmap.PAGESIZE, 0
    mincore = _mincore()
    for addr, length in ranges:
        at, end, pages = addr - addr % page, addr + length, 0
        while at < end:
            n = min(_CHUNK_PAGES, -(-(end - at) // page))
            flags = (ctypes.c_ubyte * n)()
            if mincore(at, n * page, flags) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"mincore: {os.strerror(err)}")
            pages += bytes(flags).translate(_LOW_BIT).count(1)
            at += n * page
        total += min(pages * page, length)
    return total


@functools.cache
def _mincore() -> Callable[..., int]:
    f = ctypes.CDLL(None, use_errno=True).mincore
    f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    f.restype = ctypes.c_int
    return f  # type: ignore[no-any-return]


def device_memory(device: str) -> dict[str, int]:
    """A CUDA device's memory now, for STATS (``{}`` elsewhere): what torch's allocator
    holds in tensors (``device_allocated_bytes``) and has reserved from the driver
    (``device_reserved_bytes``, the process's share as the card counts it, less the CUDA
    context), and the card's total (``device_total_bytes``). Cheap driver queries: read
    when STATS is asked for, never per step."""
    if not device.startswith("cuda"):
        return {}
    import torch

    _free, total = torch.cuda.mem_get_info(device)
    return {
        "device_allocated_bytes": int(torch.cuda.memory_allocated(device)),
        "device_reserved_bytes": int(torch.cuda.memory_reserved(device)),
        "device_total_bytes": int(total),
    }


def cuda_free_bytes(device: object) -> int:
    """Free memory on a CUDA device now (after the weights are on it)."""
    import torch

    free, _total = torch.cuda.mem_get_info(device)  # type: ignore[arg-type]
    return int(free)
