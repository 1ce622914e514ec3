"""The tensors of ``.safetensors`` files: the directory from each file's header, the data
mapped from the file and widened to float32 numpy.

Format (huggingface/safetensors, "Format"): an unsigned little-endian 64-bit header
length N, N bytes of JSON (``{name: {"dtype", "shape", "data_offsets": [begin, end]}}``
plus an optional ``__metadata__`` of strings), then the data, little-endian and
row-major, offsets relative to the byte after the header. Read here with ``json`` and
``np.memmap`` rather than the ``safetensors`` package: the frontend checks a folder's
tensors without the worker's dependencies, and the package's numpy reader has no
bfloat16 (numpy has no such type), the dtype most published checkpoints use.
"""

from __future__ import annotations

import json
import math
import pathlib
from dataclasses import dataclass

import numpy as np

from modelfile.gguf_meta import ModelFileError

__all__ = ["FLOAT_DTYPES", "SafeTensor", "read_directory", "read_float32"]

# dtype -> bytes per element, for the dtypes this runtime reads (floats)
FLOAT_DTYPES = {"F32": 4, "F16": 2, "BF16": 2}
_MAX_HEADER = 100 << 20  # the reference implementation's own limit


@dataclass(frozen=True, slots=True)
class SafeTensor:
    """One tensor of one file: dtype name as the header gives it, shape, absolute byte
    offset of its data and its size in bytes."""

    file: pathlib.Path
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def read_directory(path: pathlib.Path) -> dict[str, SafeTensor]:
    """The tensors ``path`` holds, from its header; a damaged header or a tensor whose
    bytes run past the end of the file is a ``ModelFileError``."""
    if not path.is_file():
        raise ModelFileError(path, "file not found")
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or n > min(size - 8, _MAX_HEADER):
            raise ModelFileError(path, f"not a safetensors file (header of {n} bytes, file {size})")
        try:
            header = json.loads(fh.read(n))
        except (UnicodeDecodeError, ValueError) as exc:
            raise ModelFileError(path, f"corrupt safetensors header: {exc}") from None
    if not isinstance(header, dict):
        raise ModelFileError(path, "corrupt safetensors header: not a JSON object")
    header.pop("__metadata__", None)
    data_start, out = 8 + n, {}
    for name, info in header.items():
        try:
            dtype, shape = str(info["dtype"]), tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ModelFileError(path, f"corrupt safetensors header entry {name!r}") from None
        if not 0 <= begin <= end or data_start + end > size:
            raise ModelFileError(
                path, f"truncated: tensor {name!r} needs bytes up to {data_start + end}, "
                f"file has {size}",
            )  # fmt: skip
        width = FLOAT_DTYPES.get(dtype)
        if width is not None and math.prod(shape) * width != end - begin:
            raise ModelFileError(
                path, f"tensor {name!r}: {end - begin} bytes for {dtype} of shape {shape}"
            )
        out[name] = SafeTensor(path, dtype, shape, data_start + begin, end - begin)
    return out


def read_float32(t: SafeTensor) -> np.ndarray:
    """The tensor as float32, row-major: F32 as a read-only view of the file, F16 and
    BF16 widened (exactly: every value of either is a float32 value)."""
    if t.dtype not in FLOAT_DTYPES:
        raise ModelFileError(t.file, f"tensor dtype {t.dtype} is not a float type")
    if t.nbytes == 0:
        return np.zeros(t.shape, dtype=np.float32)
    code = {"F32": "<f4", "F16": "<f2", "BF16": "<u2"}[t.dtype]
    raw = np.memmap(t.file, dtype=np.dtype(code), mode="r", offset=t.offset, shape=t.shape)
    if t.dtype == "F32":
        return raw
    if t.dtype == "F16":
        return raw.astype(np.float32)
    return (raw.astype(np.uint32) << 16).view(np.float32)  # bf16: float32's top 16 bits
