"""The offline ``generate`` command, on tiny GGUF files."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from gpu.worker.generate import run_generate
from tests.tiny_gguf import TinyModel, TinySpec, write_tiny_gguf

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_cli_prints_a_continuation(tiny_gguf: TinyModel) -> None:
    cmd = [sys.executable, "-m", "lifecycle", "generate", "hello", "--chat", "--model", str(tiny_gguf.path),
           "--max-new-tokens", "6", "--device", "cpu"]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith("\n") and len(done.stdout) > 1


def test_lifecycle_generate_passes_its_arguments_on() -> None:
    """Issue 57: ``lifecycle generate`` declared ``gpu.worker.generate``'s flags again. It
    declares none: what follows ``generate`` reaches that module's parser as it is."""
    from lifecycle.cli import _build_parser, parse_args

    argv = ["hi there", "--chat", "--max-new-tokens=3", "--model", "m.gguf", "--device", "cpu"]
    args, rest = parse_args(["generate", *argv])
    assert (args.command, rest) == ("generate", argv)
    generate = _build_parser()._subparsers._group_actions[0].choices["generate"]  # type: ignore[union-attr]
    assert generate._actions == []


def test_generate_and_the_worker_run_the_engine_not_the_dense_oracle() -> None:
    # One inference path (issue 16): offline generation is the worker's engine on the
    # paged cache; the dense cache is only the tests' oracle (tests/dense_cache.py), and
    # nothing of the tests is loaded by the product.
    code = (
        "import sys, gpu.worker.generate, gpu.worker; "
        "assert 'gpu.runtime.engine' in sys.modules; "
        "assert not [m for m in sys.modules if m.split('.')[0] == 'tests'], sys.modules"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_same_prompt_same_output(tiny_gguf: TinyModel, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_generate("hello world", model=str(tiny_gguf.path), max_new_tokens=5) == 0
    first = capsys.readouterr().out
    assert run_generate("hello world", model=str(tiny_gguf.path), max_new_tokens=5) == 0
    assert capsys.readouterr().out == first


def test_bad_file_is_one_line_and_exit_2(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "missing.gguf"
    assert run_generate("hi", model=str(path)) == 2
    err = capsys.readouterr().err
    assert err == f"error: {path}: file not found\n"


def test_chat_without_template(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    tiny = write_tiny_gguf(tmp_path / "notpl.gguf", TinySpec(chat_template=None))
    assert run_generate("hi", model=str(tiny.path), chat=True) == 1
    assert "has no chat template" in capsys.readouterr().err


def test_prompt_longer_than_context(
    tiny_gguf: TinyModel, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_generate("a " * 300, model=str(tiny_gguf.path)) == 1
    assert "fills the 256-token context" in capsys.readouterr().err


def test_generation_is_capped_by_the_context(
    tiny_gguf: TinyModel, capsys: pytest.CaptureFixture[str]
) -> None:
    # 250 prompt tokens + up to 100 new ones would overrun 256 positions: capped, not an error.
    assert run_generate("a" * 250, model=str(tiny_gguf.path), max_new_tokens=100) == 0
