"""``--context-length``: lower the model's context, or raise it where the file's RoPE
scaling allows; the served context is what /v1/models reports and what requests are
checked against, and the worker's start-up line states it with the KV cache's size."""

from __future__ import annotations

import pathlib
import subprocess
import sys
from dataclasses import replace

import httpx
import pytest

from modelfile.config import RopeScaling, with_context
from modelfile.gguf_meta import GGUFMetadata, ModelFileError
from modelfile.vocab import vocab_parts
from tests.scripted import ROOT, lifecycle_server
from tests.tiny_gguf import TinyModel


def test_with_context_lowers_and_raises_only_with_scaling(tiny_gguf: TinyModel) -> None:
    _, _, config = vocab_parts(GGUFMetadata(tiny_gguf.path))
    assert config.context_length == 256
    assert with_context(config, None) is config
    assert with_context(config, 64).context_length == 64
    with pytest.raises(ModelFileError, match="exceeds the model's 256 tokens"):
        with_context(config, 1024)
    with pytest.raises(ModelFileError, match="must be positive"):
        with_context(config, 0)
    yarn = replace(config, rope_scaling=RopeScaling("yarn", 4.0, 256))
    assert with_context(yarn, 1024).context_length == 1024
    llama3 = replace(config, rope_freq_factors=True)
    assert with_context(llama3, 1024).context_length == 1024


def test_served_context_is_the_option(tiny_gguf: TinyModel) -> None:
    with lifecycle_server("--model", str(tiny_gguf.path), "--device", "cpu",
                          "--context-length", "64") as base:  # fmt: skip
        models = httpx.get(base + "/v1/models", timeout=10).json()["data"]
        assert [m["max_model_len"] for m in models] == [64]
        ok = httpx.post(
            base + "/generate",
            json={"text": "hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
            timeout=30,
        )
        assert ok.status_code == 200, ok.text
        r = httpx.post(
            base + "/generate",
            json={"text": "hello world " * 20, "sampling_params": {"max_new_tokens": 40}},
            timeout=30,
        )  # about 40 prompt tokens + 40: past 64
        assert r.status_code == 400, r.text
        assert "64" in r.text


def test_raising_without_scaling_is_refused_before_listening(
    tiny_gguf: TinyModel, tmp_path: pathlib.Path
) -> None:
    argv = [sys.executable, "-m", "lifecycle", "serve", "--model", str(tiny_gguf.path),
            "--context-length", "4096", "--port", "0"]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "--context-length 4096 exceeds the model's 256 tokens" in lines[0]
    assert "listening" not in done.stderr
