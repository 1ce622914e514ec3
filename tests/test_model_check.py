"""A model file the runtime cannot run is refused before anything listens: ``lifecycle
serve``, ``lifecycle generate`` and ``python -m gpu.worker`` print one line naming the
file and the problem, exit with status 2, and show no traceback (``modelfile.check``).
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
from gguf import GGMLQuantizationType as Q

from modelfile.check import check_model, expected_tensors
from modelfile.gguf_meta import ModelFileError
from tests.tiny_gguf import TinyModel, TinySpec, write_tiny_gguf

ROOT = pathlib.Path(__file__).resolve().parent.parent

BAD = {
    "mamba": (TinySpec(arch="mamba"), "unsupported architecture 'mamba' (supported: gemma2"),
    "f64": (
        TinySpec(quant={"ffn_down": Q.F64}),
        "tensor 'blk.0.ffn_down.weight' has unsupported type F64 (supported: F32, F16",
    ),
    "tokenizer": (
        TinySpec(tokenizer_model="t5"),
        "unsupported tokenizer.ggml.model 't5' (supported: 'bert', 'gemma4', 'gpt2', 'llama')",
    ),
    "pre": (TinySpec(pre="qwen9"), "unsupported tokenizer.ggml.pre 'qwen9' (supported: "),
    "missing": (
        TinySpec(omit_tensors=("blk.1.ffn_up.weight",)),
        "tensor 'blk.1.ffn_up.weight' is missing (the llama architecture reads it)",
    ),
}


def _bad_file(tmp_path: pathlib.Path, name: str) -> tuple[pathlib.Path, str]:
    spec, problem = BAD[name]
    return write_tiny_gguf(tmp_path / f"{name}.gguf", spec).path, problem


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def _assert_one_line(done: subprocess.CompletedProcess[str], path: pathlib.Path,
                     problem: str) -> None:  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr == f"error: {path}: {done.stderr.split(': ', 2)[2]}", done.stderr
    assert done.stderr.count("\n") == 1 and problem in done.stderr, done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert "listening" not in done.stderr + done.stdout


@pytest.mark.parametrize("name", sorted(BAD))
def test_serve_refuses_before_listening(name: str, tmp_path: pathlib.Path) -> None:
    path, problem = _bad_file(tmp_path, name)
    done = _run("-m", "lifecycle", "serve", "--model", str(path), "--port", "0",
                "--device", "cpu")  # fmt: skip
    _assert_one_line(done, path, problem)


@pytest.mark.parametrize("name", ["mamba", "missing"])
def test_generate_refuses(name: str, tmp_path: pathlib.Path) -> None:
    path, problem = _bad_file(tmp_path, name)
    done = _run("-m", "lifecycle", "generate", "hi", "--model", str(path), "--device", "cpu")
    _assert_one_line(done, path, problem)


@pytest.mark.parametrize("name", ["f64", "pre"])
def test_worker_refuses(name: str, tmp_path: pathlib.Path) -> None:
    path, problem = _bad_file(tmp_path, name)
    done = _run("-m", "gpu.worker", "--model", str(path), "--device", "cpu",
                "--listen", f"unix:{tmp_path / 'w.sock'}")  # fmt: skip
    _assert_one_line(done, path, problem)
    assert not (tmp_path / "w.sock").exists()


def test_a_missing_default_is_one_line_too(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "nope.gguf"
    done = _run("-m", "lifecycle", "serve", "--model", str(path), "--port", "0")
    _assert_one_line(done, path, "file not found")


def test_check_reads_what_the_frontend_needs(tiny_gguf: TinyModel) -> None:
    checked = check_model(tiny_gguf.path)
    assert checked.path == tiny_gguf.path and checked.chat is not None
    assert checked.tokenizer.encode("hello") == [tiny_gguf.tokens.index("hello")]
    assert set(expected_tensors(checked.config)) == set(tiny_gguf.weights)


def test_check_names_a_wrong_shape(tmp_path: pathlib.Path) -> None:
    tiny = write_tiny_gguf(tmp_path / "shape.gguf", TinySpec())
    with open(tiny.path, "r+b") as fh:
        data = fh.read()
        key = b"llama.feed_forward_length"
        fh.seek(data.index(key) + len(key) + 4)  # past the uint32 value-type tag
        fh.write((96).to_bytes(4, "little"))
    with pytest.raises(ModelFileError, match=r"'blk.0.ffn_gate.weight' has shape \(128, 64\)"):
        check_model(tiny.path)
