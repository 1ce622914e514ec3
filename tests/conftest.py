"""Session-wide fixtures: the real default model is loaded at most once per test run."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest

from tests.tiny_gguf import TinyModel, write_tiny_gguf

# The package's own plugin (lifecycle/testing/pytest_plugin.py); loaded here when the installed
# copy predates its pytest11 entry point.
if not any(ep.value == "lifecycle.testing.pytest_plugin" for ep in entry_points(group="pytest11")):
    pytest_plugins = ["lifecycle.testing.pytest_plugin"]


@pytest.fixture
def strict_fields():  # noqa: ANN201
    """This process's parsers refuse unknown body fields (``--strict-fields``) for the test."""
    from lifecycle.core import fields

    previous = fields.install(fields.UnknownFields(strict=True))
    yield
    fields.install(previous)


@pytest.fixture(scope="session")
def cpu_model():  # noqa: ANN201 (gpu.model.loader.LoadedModel; imported lazily so collection stays cheap)
    """The default GGUF model, fp32 on CPU, shared by every test that needs it."""
    from gpu.model.loader import load_model

    return load_model(device="cpu")


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """A 2-layer random llama with a byte-level BPE vocab (written once per session)."""
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="session")
def model_server():  # noqa: ANN201 (str: the base URL)
    """One ``lifecycle serve`` process on the real model, shared by the end-to-end modules.

    fp32 weights: these modules check results across batch shapes and cached prefixes
    to 1e-5, which keeps the fp32 path (CUDA's, --tp's) covered end to end; the quantized
    default holds the same results bit for bit (docs/determinism.md) and is served end
    to end by tests/test_determinism_served.py and the modules that start their own
    server."""
    from tests.scripted import lifecycle_server

    with lifecycle_server(
        "--device", "cpu", "--max-running", "8", "--kv-cache-tokens", "8192", "--weights", "fp32"
    ) as base:
        yield base
