"""Where a model comes from: a GGUF file or a Hugging Face folder, behind one interface.

``open_model(path)`` gives a ``GGUFFile`` for a file and an ``HFFolder`` for a
directory; both answer ``ModelSource`` (tensors by GGUF name, their types and shapes,
float32 data), which is all ``gpu/model/loader.py`` asks of either, and ``model_parts`` gives
their tokenizer, chat template and config.
"""

from __future__ import annotations

import pathlib
from typing import Protocol

import numpy as np
from gguf import GGMLQuantizationType

from modelfile.chat import ChatTemplate
from modelfile.config import ModelConfig
from modelfile.gguf_file import GGUFFile, default_model_path
from modelfile.hf_folder import HFFolder
from modelfile.tokenizer import Tokenizer
from modelfile.vocab import vocab_parts

__all__ = ["ModelSource", "model_bytes", "model_parts", "open_model"]


class ModelSource(Protocol):
    """Tensors by GGUF name (``blk.0.attn_q.weight``), as the loader reads them."""

    path: pathlib.Path

    def has_tensor(self, name: str) -> bool: ...
    def stored_name(self, name: str) -> str: ...
    def tensor_type(self, name: str) -> GGMLQuantizationType: ...
    def tensor_shape(self, name: str) -> tuple[int, ...]: ...
    def dequantize(self, name: str) -> np.ndarray: ...
    def blocks(self, name: str) -> np.ndarray: ...
    def stored_bytes(self) -> dict[str, int]: ...
    def check_tensor_types(self) -> None: ...


def open_model(path: str | pathlib.Path | None = None) -> GGUFFile | HFFolder:
    """The model at ``path`` (None: the bundled default): a directory is a Hugging Face
    folder, anything else a GGUF file. Raises ``ModelFileError``."""
    where = pathlib.Path(path) if path else default_model_path()
    return HFFolder(where) if where.is_dir() else GGUFFile(where)


def model_parts(src: GGUFFile | HFFolder) -> tuple[Tokenizer, ChatTemplate | None, ModelConfig]:
    """Tokenizer, chat template and config of an opened model."""
    return src.vocab_parts() if isinstance(src, HFFolder) else vocab_parts(src)


def model_bytes(path: str | pathlib.Path) -> int:
    """The model's size on disk: the file, or every file of the folder."""
    p = pathlib.Path(path)
    if p.is_dir():
        return sum(f.stat().st_size for f in p.iterdir() if f.is_file())
    return p.stat().st_size
