"""The paged KV cache's bookkeeping: a block manager with a prefix cache (no tensors).

``BlockManager`` is pure bookkeeping (no tensors): fixed-size blocks with reference
counts; a full block whose KV has been written is registered under a hash of its tokens
chained with its parent's hash, so a later request with the same prefix reuses it
(``cached_tokens``). The computed head of a sequence's last, partly filled block is
published too when the sequence lets it go, so a prefix is matched to the token: a hit
that ends inside a block copies that block's matched rows into one of the request's
own (copy-on-write; partial blocks are never shared). Unreferenced published blocks stay
cached in LRU order and are evicted only when the free list runs dry.
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

__all__ = ["BlockManager", "NoFreeBlocks", "PrefixHit", "block_hash"]


class NoFreeBlocks(RuntimeError):
    """Raised by ``allocate`` when neither free nor evictable blocks remain."""


def block_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """Content hash of one full block, chained with its parent's: a stable digest (the
    same in every process and release), so it also names the block on disk
    (``gpu/cache/disk.py``)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(b"root" if parent is None else parent.to_bytes(16, "little"))
    h.update(struct.pack(f"<{len(tokens)}i", *tokens))
    return int.from_bytes(h.digest(), "little")


# What is told of a full cached block as ``allocate`` evicts it, while its KV is still
# valid: (block, its hash, its parent's hash, its tokens).
Evicted = Callable[[int, int, "int | None", tuple[int, ...]], object]


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """What ``match_prefix`` holds for a request: whole shared blocks, then maybe the
    first ``partial_len`` tokens of one more published block, to be copied (its KV rows)
    into a block of the request's own and then released."""

    blocks: list[int]
    hashes: list[int]
    partial: int | None = None
    partial_len: int = 0


class BlockManager:
    """Reference-counted blocks: free, held (ref > 0) or cached (ref 0, published).

    A published block is indexed by its parent's hash and its first token, holding
    either a full block (also under its own hash, shareable) or the computed head of a
    sequence's last block, published when the sequence lets it go (never written again;
    its rows are only ever copied).
    """

    def __init__(self, num_blocks: int, block_size: int, evicted: Evicted | None = None) -> None:
        """``evicted``: told of each full cached block ``allocate`` evicts (the disk tier's,
        ``gpu/runtime/disk_prefix.py``)."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks  # full published blocks only
        self._tokens: list[tuple[int, ...] | None] = [None] * num_blocks  # published blocks
        self._parent: list[int | None] = [None] * num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives block 0 first
        self._cached: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._by_hash: dict[int, int] = {}
        self._children: dict[tuple[int | None, int], set[int]] = {}  # (parent, 1st token)
        self.evicted = evicted

    @property
    def num_free(self) -> int:
        """Blocks an ``allocate`` can hand out: free plus evictable cached ones."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise NoFreeBlocks(f"need {n} blocks, {self.num_free} available")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:
                b, _ = self._cached.popitem(last=False)
                h, tokens = self._hash[b], self._tokens[b]
                if self.evicted is not None and h is not None and tokens is not None:
                    self.evicted(b, h, self._parent[b], tokens)
                self._unregister(b)
            self.ref[b] = 1
            out.append(b)
        return out

    def incref(self, blocks: Iterable[int]) -> None:
        """Share held blocks with another sequence (fork)."""
        for b in blocks:
            if self.ref[b] < 1:
                raise ValueError(f"block {b} is not held")
            self.ref[b] += 1

    def release(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            r = self.ref[b] - 1
            if r < 0:
                raise ValueError(f"block {b} released more often than held")
            self.ref[b] = r
            if r == 0:
                if self._tokens[b] is not None:
                    self._cached[b] = None
                else:
                    self._free.append(b)

    def _hold(self, b: int) -> None:
        if self.ref[b] == 0:
            del self._cached[b]
        self.ref[b] += 1

    def match_prefix(self, tokens: Sequence[int], max_tokens: int) -> PrefixHit:
        """Hold the longest cached prefix of ``tokens[:max_tokens]``, to the token.

        Whole published blocks first (their reference counts raised); where the chain
        stops, the published block sharing the most next tokens, held until the caller
        has copied its rows and released it.
        """
        bs, parent = self.block_size, None
        limit = min(max_tokens, len(tokens))
        blocks: list[int] = []
        hashes: list[int] = []
        for i in range(limit // bs):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            h = block_hash(parent, chunk)
            b = self._by_hash.get(h)
            if b is None or self._tokens[b] != chunk:
                break
            self._hold(b)
            blocks.append(b)
            hashes.append(h)
            parent = h
        done = len(blocks) * bs
        want = tuple(tokens[done : min(limit, done + bs)])
        best, best_len = None, 0
        for b in self._children.get((parent, want[0]), ()) if want else ():
            m = _common(self._tokens[b] or (), want)
            if m > best_len:
                best, best_len = b, m
        if best is not None:
            self._hold(best)
        return PrefixHit(blocks, hashes, best, best_len)

    def register(self, block: int, parent: int | None, tokens: Sequence[int]) -> int:
        """Publish a held full block whose KV is written; returns its hash.

        When an identical block is already published this one stays private.
        """
        chunk = tuple(tokens)
        h = block_hash(parent, chunk)
        if self._tokens[block] is None and h not in self._by_hash:
            self._hash[block] = h
            self._by_hash[h] = block
            self._publish(block, parent, chunk)
        return h

    def publish_partial(self, block: int, parent: int | None, tokens: Sequence[int]) -> None:
        """Publish the computed head (``tokens``, shorter than a block) of a held last
        block its only holder is about to release; skipped when a published block
        already starts with the same tokens."""
        head = tuple(tokens)
        if not 0 < len(head) < self.block_size or self._tokens[block] is not None:
            return
        if self.ref[block] != 1:
            return  # shared (never by our own rules): publishing it would let it be rewritten
        for c in self._children.get((parent, head[0]), ()):
            if _common(self._tokens[c] or (), head) == len(head):
                return
        self._publish(block, parent, head)

    def _publish(self, block: int, parent: int | None, tokens: tuple[int, ...]) -> None:
        key = (parent, tokens[0])
        # An unreferenced partial block this one extends holds nothing new: free it.
        for c in [c for c in self._children.get(key, ()) if self._hash[c] is None]:
            head = self._tokens[c] or ()
            if self.ref[c] == 0 and tokens[: len(head)] == head:
                del self._cached[c]
                self._unregister(c)
                self._free.append(c)
        self._children.setdefault(key, set()).add(block)
        self._tokens[block] = tokens
        self._parent[block] = parent

    def cached_full(self) -> Iterator[tuple[int, int, int | None, tuple[int, ...]]]:
        """Every cached full block, most recently used first, as ``Evicted`` is told of
        one (the disk tier's spill at shutdown)."""
        for b in reversed(self._cached):
            h, tokens = self._hash[b], self._tokens[b]
            if h is not None and tokens is not None:
                yield b, h, self._parent[b], tokens

    def flush(self) -> int:
        """Drop every unreferenced cached block; returns how many."""
        n = len(self._cached)
        while self._cached:
            b, _ = self._cached.popitem(last=False)
            self._unregister(b)
            self._free.append(b)
        return n

    def _unregister(self, b: int) -> None:
        h, tokens = self._hash[b], self._tokens[b]
        if h is not None and self._by_hash.get(h) == b:
            del self._by_hash[h]
        if tokens is not None:
            key = (self._parent[b], tokens[0])
            kids = self._children[key]
            kids.discard(b)
            if not kids:
                del self._children[key]
        self._hash[b] = None
        self._tokens[b] = None
        self._parent[b] = None

    def check(self, tables: Iterable[Sequence[int]]) -> list[str]:
        """Integrity problems given every live sequence's block table (empty list: sound)."""
        held = Counter(b for t in tables for b in t)
        problems = []
        free, cached = set(self._free), set(self._cached)
        if len(free) != len(self._free):
            problems.append("a block is on the free list twice")
        if free & cached:
            problems.append(f"blocks both free and cached: {sorted(free & cached)[:8]}")
        indexed = {b for kids in self._children.values() for b in kids}
        for b in range(self.num_blocks):
            if self.ref[b] != held[b]:
                problems.append(f"block {b}: refcount {self.ref[b]}, held {held[b]} times")
            if self.ref[b] and (b in free or b in cached):
                problems.append(f"block {b} is held and also free/cached")
            published = self._tokens[b] is not None
            if published != (b in indexed) or (b in cached and not published):
                problems.append(f"block {b}: published {published}, indexed {b in indexed}")
            if published and self._hash[b] is None and self.ref[b]:
                problems.append(f"block {b} is a published partial block and held")
        n_held = sum(1 for r in self.ref if r > 0)
        if len(free) + len(cached) + n_held != self.num_blocks:
            problems.append(
                f"free {len(free)} + cached {len(cached)} + held {n_held} != {self.num_blocks}"
            )
        return problems


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two token runs."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
