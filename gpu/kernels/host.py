"""Host-side building of a step's integer inputs.

``torch.tensor`` of a Python list converts element by element, about 100 ns each on the
CPU (a batch of 256 decodes with 9-block tables: 0.27 ms for the tables alone); ``struct``
packs the same list about 8x faster (numpy's conversion: 3x), and ``torch.frombuffer``
shares its buffer. Every per-step list of ids, positions, slots, tables and lengths goes
through here.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

__all__ = [
    "HostInts",
    "decode_slots",
    "flat_tables",
    "floats",
    "ints",
    "pinned",
    "put_futures",
    "to_device",
]

_CODE = {torch.int64: "q", torch.int32: "i"}  # struct's


def ints(
    values: Sequence[int],
    dtype: torch.dtype = torch.int64,
    device: torch.device | str | None = None,
) -> Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)`` for a flat list of ints, packed
    by ``struct`` into a buffer the tensor keeps: 2-3x numpy's conversion where the ints
    are past 256 (block tables, slots), as fast below."""
    n = len(values)
    if n == 0:
        return torch.empty(0, dtype=dtype, device=device)
    buf = bytearray(n * dtype.itemsize)
    struct.pack_into(f"={n}{_CODE[dtype]}", buf, 0, *values)
    t = torch.frombuffer(buf, dtype=dtype)
    return t if device is None else to_device(t, device)


def floats(values: Sequence[float], dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)`` through ``to_device``."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def to_device(t: Tensor, device: torch.device | str) -> Tensor:
    """A fresh CPU tensor on ``device`` (on the CPU itself, with no op: a step makes
    several). To CUDA through pinned memory, asynchronously: a copy from pageable memory
    waits for every kernel queued before it, and an overlapped step's inputs are built
    while the step before still runs (``gpu/runtime/overlap.py``). The caching host
    allocator keeps the pinned buffer until the copy is done."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return t
    return pinned(t, dev).to(dev, non_blocking=dev.type == "cuda")


def pinned(t: Tensor, device: torch.device) -> Tensor:
    """``t`` in pinned memory when it is to be copied to a CUDA ``device`` (``to_device``'s
    reason), else itself."""
    return t.pin_memory() if device.type == "cuda" else t


def flat_tables(tables: Iterable[Sequence[int]], nb: int, pad: int) -> list[int]:
    """Every block table cut or padded (with block ``pad``) to ``nb`` blocks, row after
    row, in one flat list: the per-row work kept to list extends (a decode step's tables
    are built every step)."""
    flat: list[int] = []
    fill = [pad] * nb
    for t in tables:
        k = len(t)
        if k >= nb:
            flat += t if k == nb else t[:nb]
        else:
            flat += t
            flat += fill[k:]
    return flat


def decode_slots(decodes: Iterable[tuple[Sequence[int], int]], block_size: int) -> list[int]:
    """Each decode's one new KV slot, ``(block table, keys after the step)`` each: where
    its last key goes."""
    bs = block_size
    return [t[(ctx - 1) // bs] * bs + (ctx - 1) % bs for t, ctx in decodes]


def put_futures(ids: Tensor, future: tuple[list[int], list[int], Tensor]) -> None:
    """Rows ``rows`` of a step's input ``ids`` (on the device) take tokens ``src`` of the
    previous step's sampled ``tokens``, still on the device (an overlapped step's inputs:
    the host has not read those tokens yet)."""
    rows, src, tokens = future
    dev = ids.device
    ids[ints(rows, device=dev)] = tokens[ints(src, device=tokens.device)].to(dev, ids.dtype)


class HostInts:
    """A device tensor of ints on its way to the host. On CUDA the copy is queued at once
    (pinned memory, non-blocking) with an event after it, so ``tolist`` waits for that
    copy alone, not for what was queued later (the next step's kernels); on the CPU it is
    the tensor itself."""

    def __init__(self, t: Tensor) -> None:
        self.on_device = t
        self._event: torch.cuda.Event | None = None
        if t.device.type == "cuda":
            self._host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self._host.copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = t

    def tolist(self) -> list[int]:
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()  # type: ignore[no-any-return]
