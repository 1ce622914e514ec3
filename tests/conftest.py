"""Shared fixtures: a tiny GGUF per session, and the real default model loaded once."""

from __future__ import annotations

import pathlib

import pytest

from tests.tiny_gguf import TinyModel, write_tiny_gguf


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """A 2-layer random llama with a byte-level BPE vocab (written once per session)."""
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="session")
def smollm2():  # -> gpu.loader.LoadedModel
    """The bundled SmolLM2-135M, loaded once per session (tests marked ``model``)."""
    from gpu.loader import load_model

    return load_model(device="cpu")


@pytest.fixture(scope="session")
def smollm2_path() -> pathlib.Path:
    from gpu.gguf_file import default_model_path

    return default_model_path()
