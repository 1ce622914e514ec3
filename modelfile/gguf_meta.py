"""A GGUF file's metadata and tensor directory, read without gguf-py and without the weights.

The frontend needs the tokenizer, the chat template and the config, never a tensor.
``gguf.GGUFReader`` builds numpy views for every part of every field on open (about
150,000 of them for SmolLM2's vocabulary and merges: over 3 s); this reader walks the
key/value section once with ``struct`` and turns string arrays straight into ``str``
(tens of milliseconds). Layout: the GGUF spec, ``docs/gguf.md`` in ggml, versions 2
and 3, little-endian (a big-endian file is refused as an unsupported version, as
gguf-py reads its version field).
"""

from __future__ import annotations

import pathlib
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["GGUFMetadata", "ModelFileError", "TensorEntry"]

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_STRING, _ARRAY = 8, 9
_FIRST_READ = 4 << 20
# value type -> (struct code, numpy dtype); GGUF value types 0-12 but string and array
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("B", "<u1"),
    1: ("b", "<i1"),
    2: ("H", "<u2"),
    3: ("h", "<i2"),
    4: ("I", "<u4"),
    5: ("i", "<i4"),
    6: ("f", "<f4"),
    7: ("?", "<u1"),
    10: ("Q", "<u8"),
    11: ("q", "<i8"),
    12: ("d", "<f8"),
}


class ModelFileError(Exception):
    """The model file is missing, damaged or not something this runtime can run."""

    def __init__(self, path: str | pathlib.Path, problem: str) -> None:
        self.path = pathlib.Path(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of the directory: GGUF order dims (``ne``), type, absolute byte offset."""

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int


class _Truncated(Exception):
    pass


class _Cursor:
    """Little-endian reads from a buffer, refusing to run past its end."""

    def __init__(self, buf: Any) -> None:
        self.buf, self.at, self.size = buf, 0, len(buf)

    def take(self, n: int) -> int:
        at = self.at
        if n < 0 or at + n > self.size:
            raise _Truncated
        self.at = at + n
        return at

    def scalar(self, code: str) -> Any:
        size = struct.calcsize(code)
        return struct.unpack_from("<" + code, self.buf, self.take(size))[0]

    def string(self) -> str:
        n = self.scalar("Q")
        at = self.take(n)
        return bytes(self.buf[at : at + n]).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            return self.array()
        if vtype not in _SCALARS:
            raise ValueError(f"unknown metadata value type {vtype}")
        return self.scalar(_SCALARS[vtype][0])

    def array(self) -> list[str] | np.ndarray | list[Any]:
        etype, n = self.scalar("I"), self.scalar("Q")
        if etype == _STRING:
            return [self.string() for _ in range(n)]
        if etype in _SCALARS:
            dtype = np.dtype(_SCALARS[etype][1])
            at = self.take(n * dtype.itemsize)
            out = np.frombuffer(self.buf, dtype=dtype, count=n, offset=at).copy()
            return out.astype(bool) if etype == 7 else out
        return [self.value(etype) for _ in range(n)]  # nested arrays: rare, kept simple


class GGUFMetadata:
    """Metadata by key and the tensor directory (names, shapes, types, where each tensor's
    bytes start); ``GGUFFile`` adds the tensors' data on top."""

    def __init__(self, path: str | pathlib.Path) -> None:
        self.path = pathlib.Path(path)
        if not self.path.is_file():
            raise ModelFileError(self.path, "file not found")
        if self.path.stat().st_size == 0:
            raise ModelFileError(self.path, "empty file")
        try:
            self._fields, self.tensors = _read(self.path)
        except _Truncated:
            size = self.path.stat().st_size
            problem = f"truncated or corrupt GGUF file ({size:,} bytes; metadata runs past the end)"
            raise ModelFileError(self.path, problem) from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise ModelFileError(self.path, f"corrupt GGUF metadata: {exc}") from None

    def has(self, key: str) -> bool:
        return key in self._fields

    def get(self, key: str, default: Any = None) -> Any:
        """A scalar or string value; arrays come back as lists (use ``strings``/``array``)."""
        value = self._fields.get(key, default)
        return value.tolist() if isinstance(value, np.ndarray) else value

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelFileError(self.path, f"required metadata key {key!r} is missing")
        return value

    def strings(self, key: str) -> list[str]:
        value = self._fields.get(key)
        return list(value) if isinstance(value, list) else []

    def array(self, key: str) -> np.ndarray | None:
        value = self._fields.get(key)
        if value is None:
            return None
        return value if isinstance(value, np.ndarray) else np.asarray(value)

    @property
    def tensor_names(self) -> list[str]:
        return list(self.tensors)

    def has_tensor(self, name: str) -> bool:
        return name in self.tensors


def _read(path: pathlib.Path) -> tuple[dict[str, Any], dict[str, TensorEntry]]:
    """Parse a prefix of the file, longer each time the metadata runs past it (the
    metadata sits before the tensor data and is a few MiB at most)."""
    size, want = path.stat().st_size, _FIRST_READ
    while True:
        with open(path, "rb") as fh:
            head = fh.read(want)
        try:
            return _parse(path, head)
        except _Truncated:
            if want >= size:
                raise
            want *= 4


def _parse(path: pathlib.Path, buf: bytes) -> tuple[dict[str, Any], dict[str, TensorEntry]]:
    cur = _Cursor(buf)
    at = cur.take(4)
    if bytes(buf[at : at + 4]) != _MAGIC:
        raise ModelFileError(path, "not a GGUF file (bad magic)")
    version = cur.scalar("I")
    if version not in _VERSIONS:
        raise ModelFileError(path, f"unsupported GGUF version ({version})")
    n_tensors, n_fields = cur.scalar("Q"), cur.scalar("Q")
    fields: dict[str, Any] = {}
    for _ in range(n_fields):
        key = cur.string()
        fields[key] = cur.value(cur.scalar("I"))
    entries = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = tuple(cur.scalar("Q") for _ in range(cur.scalar("I")))
        entries.append((name, dims, cur.scalar("I"), cur.scalar("Q")))
    align = int(fields.get("general.alignment", 32))
    if align <= 0 or align & (align - 1):
        raise ValueError(f"general.alignment {align} is not a power of two")
    data_start = -(-cur.at // align) * align
    tensors = {n: TensorEntry(n, d, t, data_start + off) for n, d, t, off in entries}
    return fields, tensors
