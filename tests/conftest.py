"""Session-wide fixtures: the real default model is loaded at most once per test run."""

from __future__ import annotations

import pytest

from tests.tiny_gguf import TinyModel, write_tiny_gguf


@pytest.fixture(scope="session")
def cpu_model():  # noqa: ANN201 (gpu.loader.LoadedModel; imported lazily so collection stays cheap)
    """The default GGUF model, fp32 on CPU, shared by every test that needs it."""
    from gpu.loader import load_model

    return load_model(device="cpu")


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """A 2-layer random llama with a byte-level BPE vocab (written once per session)."""
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
