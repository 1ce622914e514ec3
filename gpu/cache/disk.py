"""The prefix cache's disk tier (``--prefix-cache-dir``): full KV blocks kept as files, so
a prefix outlives the worker that computed it.

One file per block, named by the block's chained hash (``gpu/cache/blocks.py``,
``block_hash``: a stable digest): a header (``MAGIC``, then JSON: the layout version, the
model file's identity, the KV element, the block's shape, its hash, its parent's hash,
its tokens, the payload's length), the payload (K then V, ``[n_layers, n_kv, block_size,
head_dim]`` each, the cache's own bytes: a q8_0 or q4_0 cache's rows are ``head_dim / 32``
blocks of 34 or 18 bytes, copied as they are) and a blake2b digest of everything before it.
``get`` serves a file only when every one of those matches what is asked: a corrupt,
truncated or foreign file (another model, KV element, shape or layout version) is logged,
removed and read as a miss, never served. A file is written under a temporary name and
renamed into place (``os.replace`` is atomic), so a crash mid-write leaves no half file
under a block's name; leftovers are removed at start. The directory is bounded
(``--prefix-cache-disk-mib``): the least recently written or read files go first.

No fsync: a file torn by a power loss fails its digest and is dropped like any other.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor

from gpu.kernels.kv_element import KV_ELEMENTS, KVElement

__all__ = ["LAYOUT_VERSION", "MAGIC", "DiskLayout", "DiskPrefixCache", "model_identity"]

log = logging.getLogger(__name__)

MAGIC = b"LCKVBLK\x00"
# What a file's payload means; raise it whenever the KV layout or the rows' meaning
# changes (a file of another version is foreign). 2: q8_0 and q4_0 rows hold the rotated
# K and V (paged_attention.c's kv_rotate), not K and V.
LAYOUT_VERSION = 2
_DIGEST = 32  # bytes of the blake2b digest that ends every file
_SUFFIX = ".kvb"
_SAMPLE = 1 << 20  # bytes read from each end of a model file for its identity


def model_identity(path: str | os.PathLike[str]) -> str:
    """A digest naming a model's weights: each file's name, size, and first and last MiB
    (a GGUF's header, metadata and tensor directory lead the file; its last tensors end
    it). Another model, or the same name rewritten with other weights, differs."""
    p = Path(path)
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    h = hashlib.blake2b(digest_size=16)
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}\0{size}\0".encode())
        with f.open("rb") as fh:
            h.update(fh.read(_SAMPLE))
            if size > _SAMPLE:
                fh.seek(max(_SAMPLE, size - _SAMPLE))
                h.update(fh.read(_SAMPLE))
    return h.hexdigest()


@dataclass(frozen=True, slots=True)
class DiskLayout:
    """What a block file must have been written with to be read here."""

    model: str  # ``model_identity``
    kv_dtype: str  # the cache's element: float16, bfloat16, float32, q8_0, q4_0
    n_layers: int
    n_kv_heads: int
    block_size: int
    head_dim: int
    version: int = LAYOUT_VERSION

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """A block's K (or V) rows as the cache holds them (``dtype``)."""
        width = self.element.row_width(self.head_dim)
        return (self.n_layers, self.n_kv_heads, self.block_size, width)

    @property
    def element(self) -> KVElement:
        """The element ``kv_dtype`` names (``PagedKVCache.kv_element``)."""
        return KV_ELEMENTS[self.kv_dtype]

    @property
    def dtype(self) -> torch.dtype:
        """The cache tensors' dtype: the element's, or uint8 for q8_0's and q4_0's bytes."""
        return self.element.dtype

    @property
    def payload_bytes(self) -> int:
        return 2 * math.prod(self.shape) * self.dtype.itemsize


class DiskPrefixCache:
    """Block files in ``root``, at most ``max_bytes`` of them, for one ``layout``."""

    def __init__(self, root: str | os.PathLike[str], max_bytes: int, layout: DiskLayout) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.layout = layout
        self.writes = self.reads = self.dropped = 0
        self._files: OrderedDict[int, int] = OrderedDict()  # key -> bytes, oldest first
        self.bytes = 0
        self._scan()

    def _scan(self) -> None:
        """The index from the directory (no file is read: each is checked when asked
        for); temporary files a crash left are removed, then the bound applied."""
        found = []
        for f in self.root.iterdir():
            if f.name.endswith(".tmp"):
                f.unlink(missing_ok=True)
                continue
            try:
                key = int(f.name.removesuffix(_SUFFIX), 16) if f.suffix == _SUFFIX else None
                st = f.stat()
            except (ValueError, OSError):
                continue
            if key is not None:
                found.append((st.st_mtime_ns, key, st.st_size))
        for _, key, size in sorted(found):
            self._files[key] = size
            self.bytes += size
        self._bound()

    def __contains__(self, key: int) -> bool:
        return key in self._files

    def __len__(self) -> int:
        return len(self._files)

    def path(self, key: int) -> Path:
        return self.root / f"{key:032x}{_SUFFIX}"

    def put(
        self, key: int, parent: int | None, tokens: Sequence[int], k: Tensor, v: Tensor
    ) -> bool:
        """Write one block's K and V rows (``layout.shape`` each) under ``key``; False
        when it is there already or larger than the whole bound."""
        if key in self._files:
            return False
        lay = self.layout
        payload = b"".join(
            t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes() for t in (k, v)
        )
        header = {**asdict(lay), "key": f"{key:032x}", "parent": _hex(parent),
                  "tokens": list(tokens), "payload": len(payload)}  # fmt: skip
        if tuple(k.shape) != lay.shape or len(payload) != lay.payload_bytes:
            raise ValueError(f"a block of {tuple(k.shape)} is not this cache's {lay.shape}")
        head = json.dumps(header, separators=(",", ":")).encode()
        body = MAGIC + len(head).to_bytes(4, "little") + head + payload
        data = body + hashlib.blake2b(body, digest_size=_DIGEST).digest()
        if len(data) > self.max_bytes:
            return False
        final = self.path(key)
        tmp = final.with_name(f"{final.name}.{os.getpid()}.tmp")
        try:
            tmp.write_bytes(data)
            os.replace(tmp, final)  # atomic: readers see the whole file or none
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            log.warning("prefix cache: could not write %s: %s", final, exc)
            return False
        self._files[key] = len(data)
        self.bytes += len(data)
        self.writes += 1
        self._bound()
        return True

    def get(
        self, key: int, parent: int | None, tokens: Sequence[int]
    ) -> tuple[Tensor, Tensor] | None:
        """The K and V rows stored for this block, or None: not there, or a file that
        fails any check (logged, removed)."""
        if key not in self._files:
            return None
        f = self.path(key)
        try:
            data = bytearray(f.read_bytes())
        except OSError as exc:
            self._drop(key, f"unreadable ({exc})")
            return None
        why = self._refusal(data, key, parent, tokens)
        if why is not None:
            self._drop(key, why)
            return None
        lay = self.layout
        n = lay.payload_bytes // 2 // lay.dtype.itemsize
        off = len(data) - _DIGEST - lay.payload_bytes
        k = torch.frombuffer(data, dtype=lay.dtype, count=n, offset=off).view(lay.shape)
        off += lay.payload_bytes // 2
        v = torch.frombuffer(data, dtype=lay.dtype, count=n, offset=off).view(lay.shape)
        self.touch(key)
        self.reads += 1
        return k, v

    def touch(self, key: int, ns: int | None = None) -> None:
        """Make a file the youngest (its modification time now, or ``ns``): the last
        to go under the bound, here and after a restart."""
        if key in self._files:
            self._files.move_to_end(key)
            if ns is None:
                os.utime(self.path(key))
            else:
                os.utime(self.path(key), ns=(ns, ns))

    def _refusal(
        self, data: bytearray, key: int, parent: int | None, tokens: Sequence[int]
    ) -> str | None:
        """Why a file's bytes are not this block's, or None."""
        if len(data) < len(MAGIC) + 4 + _DIGEST or not data.startswith(MAGIC):
            return "not a block file (truncated or foreign)"
        body, digest = bytes(data[:-_DIGEST]), bytes(data[-_DIGEST:])
        if hashlib.blake2b(body, digest_size=_DIGEST).digest() != digest:
            return "checksum mismatch (corrupt or truncated)"
        n = int.from_bytes(body[len(MAGIC) : len(MAGIC) + 4], "little")
        try:
            header = json.loads(body[len(MAGIC) + 4 : len(MAGIC) + 4 + n])
        except ValueError:
            return "unreadable header"
        want = {**asdict(self.layout), "key": f"{key:032x}", "parent": _hex(parent),
                "tokens": list(tokens), "payload": self.layout.payload_bytes}  # fmt: skip
        for name, value in want.items():
            if header.get(name) != value:
                return f"foreign: {name} {header.get(name)!r}, expected {value!r}"
        if len(body) != len(MAGIC) + 4 + n + self.layout.payload_bytes:
            return "payload length mismatch"
        return None

    def _drop(self, key: int, why: str) -> None:
        log.warning("prefix cache: removed %s: %s", self.path(key).name, why)
        self.dropped += 1
        self._remove(key)

    def _remove(self, key: int) -> None:
        self.bytes -= self._files.pop(key, 0)
        self.path(key).unlink(missing_ok=True)

    def _bound(self) -> None:
        """Remove the oldest files until the directory fits ``max_bytes``."""
        while self.bytes > self.max_bytes and self._files:
            self._remove(next(iter(self._files)))

    def info(self) -> dict[str, int]:
        return {"prefix_disk_blocks": len(self._files), "prefix_disk_bytes": self.bytes,
                "prefix_disk_reads": self.reads, "prefix_disk_writes": self.writes,
                "prefix_disk_dropped": self.dropped}  # fmt: skip


def _hex(h: int | None) -> str | None:
    return None if h is None else f"{h:032x}"
