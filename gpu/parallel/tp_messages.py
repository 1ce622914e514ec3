"""What rank 0 tells its tensor-parallel followers: ops as flat int lists (no I/O here).

One message is a run of ops, each a kind then its fields; lists are length-prefixed.
The cache ops (``Prepare``, ``CopyBlock``, ``CopyRows``) are the engine's calls on its
``PagedKVCache``; ``Forward`` and ``Logits`` its calls on the model, each of which the
followers must join (collectives); ``CacheSpec`` comes first (the followers' cache size)
and ``Stop`` last.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import IntEnum

from gpu.cache.kv_cache import PrefillChunk

__all__ = [
    "CacheSpec",
    "CopyBlock",
    "CopyRows",
    "Forward",
    "Kind",
    "Logits",
    "Op",
    "Prepare",
    "Stop",
    "decode_ops",
    "encode_cache",
    "encode_copy_block",
    "encode_copy_rows",
    "encode_forward",
    "encode_logits",
    "encode_prepare",
    "encode_stop",
]


class Kind(IntEnum):
    CACHE = 1
    PREPARE = 2
    COPY_BLOCK = 3
    COPY_ROWS = 4
    FORWARD = 5
    LOGITS = 6
    STOP = 7


@dataclass(frozen=True, slots=True)
class CacheSpec:
    kv_blocks: int
    block_size: int


@dataclass(frozen=True, slots=True)
class Prepare:
    decodes: list[tuple[list[int], int]]  # (block table, context length)
    prefills: list[PrefillChunk]


@dataclass(frozen=True, slots=True)
class CopyBlock:
    src: int
    dst: int


@dataclass(frozen=True, slots=True)
class CopyRows:
    src: int
    dst: int
    n: int


@dataclass(frozen=True, slots=True)
class Forward:
    ids: list[int]
    positions: list[int]


@dataclass(frozen=True, slots=True)
class Logits:
    rows: list[int]


@dataclass(frozen=True, slots=True)
class Stop:
    pass


Op = CacheSpec | Prepare | CopyBlock | CopyRows | Forward | Logits | Stop


def encode_cache(kv_blocks: int, block_size: int) -> list[int]:
    return [Kind.CACHE, kv_blocks, block_size]


def encode_prepare(
    decodes: Sequence[tuple[Sequence[int], int]], prefills: Sequence[PrefillChunk]
) -> list[int]:
    out = [Kind.PREPARE, len(decodes)]
    for table, ctx in decodes:
        out += [ctx, len(table), *table]
    out.append(len(prefills))
    for c in prefills:
        out += [c.start, c.n, len(c.block_table), *c.block_table]
    return out


def encode_copy_block(src: int, dst: int) -> list[int]:
    return [Kind.COPY_BLOCK, src, dst]


def encode_copy_rows(src: int, dst: int, n: int) -> list[int]:
    return [Kind.COPY_ROWS, src, dst, n]


def encode_forward(ids: Sequence[int], positions: Sequence[int]) -> list[int]:
    if len(ids) != len(positions):
        raise ValueError(f"{len(ids)} ids but {len(positions)} positions")
    return [Kind.FORWARD, len(ids), *ids, *positions]


def encode_logits(rows: Sequence[int]) -> list[int]:
    return [Kind.LOGITS, len(rows), *rows]


def encode_stop() -> list[int]:
    return [Kind.STOP]


def decode_ops(ints: Sequence[int]) -> Iterator[Op]:
    """The ops of one message, in order."""
    i, n = 0, len(ints)

    def take(k: int) -> list[int]:
        nonlocal i
        if i + k > n:
            raise ValueError(f"message ends inside an op ({n} ints)")
        out = list(ints[i : i + k])
        i += k
        return out

    while i < n:
        (kind,) = take(1)
        if kind == Kind.CACHE:
            yield CacheSpec(*take(2))
        elif kind == Kind.PREPARE:
            decodes = []
            for _ in range(take(1)[0]):
                ctx, nb = take(2)
                decodes.append((take(nb), ctx))
            prefills = []
            for _ in range(take(1)[0]):
                start, count, nb = take(3)
                prefills.append(PrefillChunk(take(nb), start, count))
            yield Prepare(decodes, prefills)
        elif kind == Kind.COPY_BLOCK:
            yield CopyBlock(*take(2))
        elif kind == Kind.COPY_ROWS:
            yield CopyRows(*take(3))
        elif kind == Kind.FORWARD:
            t = take(1)[0]
            yield Forward(take(t), take(t))
        elif kind == Kind.LOGITS:
            yield Logits(take(take(1)[0]))
        elif kind == Kind.STOP:
            yield Stop()
        else:
            raise ValueError(f"unknown op kind {kind}")
