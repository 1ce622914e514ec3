"""Each architecture served end to end: ``lifecycle serve --model`` on one Q8_0 file per
architecture (tests/hf_reference.py's tiny random models; Llama 3 for llama) gives the
greedy tokens of the served path run in-process on the same file, token for token, and
answers ``/v1/chat/completions``. The served path against transformers on the same
files' weights: tests/test_families.py."""

from __future__ import annotations

import pathlib

import httpx
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from gpu.model.loader import load_model
from tests.family_helpers import paged_greedy, prompt_ids
from tests.hf_reference import FAMILIES, build_hf, write_family_gguf
from tests.scripted import lifecycle_server

pytest.importorskip("transformers")

SERVED = [
    "llama3",
    "qwen2",
    "qwen3",
    "phi3",
    "gemma2",
    "smollm3",
    "granite",
    "olmo2",
]  # one family per architecture, served for real


@pytest.fixture(scope="module")
def family_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    """One Q8_0 file per architecture (Llama 3 for llama)."""
    out = {}
    for name in SERVED:
        fam = FAMILIES[name]
        model = build_hf(fam, dtype=torch.float32)
        out[name] = write_family_gguf(
            fam, model, tmp_path_factory.mktemp("families") / f"{name}.gguf", Q.Q8_0
        )
    return out


@pytest.mark.parametrize("name", SERVED)
def test_each_architecture_is_served(name: str, family_files: dict[str, pathlib.Path]) -> None:
    """The server's greedy tokens are those of the served path run in-process on the same
    file, token for token (greedy decoding is deterministic: docs/determinism.md), so
    the figures against transformers in tests/test_families.py are the server's."""
    prompt = prompt_ids(20, 2)
    want = paged_greedy(load_model(family_files[name], device="cpu"), prompt, 8)[0]
    with lifecycle_server("--model", str(family_files[name]), "--device", "cpu") as base:
        r = httpx.post(
            base + "/generate",
            json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 8,
                  "temperature": 0, "ignore_eos": True}},
            timeout=60,
        )  # fmt: skip
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == want
        r = httpx.post(
            base + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8,
                  "temperature": 0},
            timeout=60,
        )  # fmt: skip
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] >= 1
        assert body["choices"][0]["finish_reason"] in ("stop", "length")
