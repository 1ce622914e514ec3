"""The prefix cache beyond memory (``--prefix-cache-dir``): cached full blocks go to disk
as the block manager evicts them (their KV still valid then: nothing writes a cached
block until it is handed out again and a step runs) and at shutdown (``spill``); a new
request's prefix continues from disk where the blocks in memory stop (``extend``).

A block read back is held by the request and published at once; its rows are a step
cache operation like the copies (``StepInput.loads``): the runner writes them before
the model runs, ahead of the copies, so every reader in that step sees them. A block
whose load is still pending is never written back to disk.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from torch import Tensor

from gpu.cache.blocks import BlockManager, block_hash
from gpu.cache.disk import DiskLayout, DiskPrefixCache, model_identity
from gpu.cache.kv_cache import PagedKVCache

__all__ = ["DiskPrefix", "disk_prefix_for"]

log = logging.getLogger(__name__)


class DiskPrefix:
    """The disk tier of one engine's prefix cache: its store and KV tensors. The engine's
    block manager is made with ``write`` as what it tells of an eviction."""

    def __init__(self, store: DiskPrefixCache, cache: PagedKVCache) -> None:
        self.store = store
        self.cache = cache
        self._loads: dict[int, tuple[Tensor, Tensor]] = {}  # block -> rows, next step's

    def _rows(self, block: int) -> tuple[Tensor, Tensor]:
        bs = self.cache.block_size
        s = block * bs
        return self.cache.k[:, :, s : s + bs], self.cache.v[:, :, s : s + bs]

    def write(self, block: int, h: int, parent: int | None, tokens: tuple[int, ...]) -> bool:
        """Keep a full cached block on disk (it is being evicted, or the worker stops);
        False when it is not written."""
        if block in self._loads or h in self.store:
            return False  # its rows are not in the cache yet / already on disk
        return self.store.put(h, parent, tokens, *self._rows(block))

    def extend(
        self,
        manager: BlockManager,
        tokens: Sequence[int],
        blocks: list[int],
        hashes: list[int],
        limit: int,
    ) -> int:
        """Continue a prefix hit (``blocks``, ``hashes``: the whole blocks held) with the
        blocks on disk, up to ``limit`` tokens; each read back is held, published and
        appended. Returns how many were read."""
        bs = manager.block_size
        parent = hashes[-1] if hashes else None
        n = 0
        for i in range(len(blocks), limit // bs):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            h = block_hash(parent, chunk)
            if h not in self.store or not manager.num_free:
                break
            rows = self.store.get(h, parent, chunk)
            if rows is None:
                break
            (b,) = manager.allocate(1)
            self._loads[b] = rows
            manager.register(b, parent, chunk)
            blocks.append(b)
            hashes.append(h)
            parent = h
            n += 1
        return n

    def take_loads(self) -> list[tuple[int, Tensor, Tensor]]:
        """The blocks read back since the last step, to write before it runs."""
        loads, self._loads = self._loads, {}
        return [(b, k, v) for b, (k, v) in loads.items()]

    def spill(self, manager: BlockManager) -> int:
        """Write every cached full block that is not on disk yet, as many as the bound
        holds (older files make way), at the worker's shutdown; returns how many. The
        most recently used go first, so a worker stopped mid-spill (the supervisor waits
        a few seconds) has kept those, and their files are dated newest."""
        size = self.store.layout.payload_bytes + 1024  # a file: payload, header, digest
        chosen = list(manager.cached_full())[: self.store.max_bytes // size]
        now, n = time.time_ns(), 0
        for i, (b, h, parent, tokens) in enumerate(chosen):
            n += self.write(b, h, parent, tokens)
            self.store.touch(h, now - i * 1000)  # dated by use, the newest last
        log.info("prefix cache: %d blocks written to %s at shutdown", n, self.store.root)
        return n


def disk_prefix_for(
    directory: str | None,
    disk_mib: int,
    model_path: str,
    cache: PagedKVCache,
) -> DiskPrefix | None:
    """The disk tier for ``--prefix-cache-dir``, or None without one."""
    if directory is None:
        return None
    c = cache
    n_layers, n_kv = c.k.shape[:2]  # the rows' width is the element's (q8_0: bytes)
    layout = DiskLayout(model_identity(model_path), c.element, n_layers, n_kv, c.block_size,
                        c.head_dim)  # fmt: skip
    store = DiskPrefixCache(directory, disk_mib * 2**20, layout)
    log.info("prefix cache on disk: %s, %d blocks, %d of %d MiB", directory, len(store),
             store.bytes >> 20, disk_mib)  # fmt: skip
    return DiskPrefix(store, cache)
