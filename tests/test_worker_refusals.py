"""Worker options that cannot go together (``wire.worker_options.refused_combination``):
``lifecycle serve`` says why in one line and exits 2 before it listens or spawns; a
worker that finds out only at start (the device it resolved) exits 2 with the same
line, and its supervisor does not restart it: ``/health`` says it failed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.scripted import ROOT
from tests.tiny_gguf import TinyModel
from wire.worker_options import refused_combination


@pytest.mark.parametrize(
    ("values", "why"),
    [
        ({"tp": 2, "weights": "q8_0"}, "--tp > 1 splits fp32 weights"),
        ({"tp": 2, "kv_cache_dtype": "fp16"}, "leave --kv-cache-dtype at auto"),
        ({"tp": 2, "kernels": "triton"}, "leave --kernels at torch"),
        ({"device": "cpu", "decode_graphs": "on"}, "CUDA graphs need a CUDA device"),
        ({"device": "cpu", "mem_fraction": 0.5}, "--mem-fraction sizes the KV cache on a CUDA"),
    ],
)
def test_each_rule_names_what_to_change(values: dict, why: str) -> None:
    got = refused_combination(values)
    assert got is not None and why in got


def test_what_goes_together_is_taken() -> None:
    assert refused_combination({}) is None  # the defaults
    assert refused_combination({"tp": 2, "weights": "fp32", "kernels": None}) is None
    assert refused_combination({"device": "cuda", "decode_graphs": "on", "kernels": "triton",
                                "mem_fraction": 0.5}) is None  # fmt: skip
    assert refused_combination({"device": None, "kernels": "triton"}) is None  # not known yet


def test_triton_on_the_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "needs a CUDA device" in (refused_combination({"device": "cpu", "kernels": "triton"})
                                     or "")  # fmt: skip
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert refused_combination({"device": "cpu", "kernels": "triton"}) is None


def test_serve_refuses_before_listening(tiny_gguf: TinyModel) -> None:
    argv = [sys.executable, "-m", "lifecycle", "serve", "--model", str(tiny_gguf.path),
            "--tp", "2", "--kv-cache-dtype", "fp16", "--port", "0"]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines == ["error: --tp > 1 keeps the KV cache in --dtype: leave --kv-cache-dtype at "
                     "auto"], done.stderr  # fmt: skip
    assert "listening" not in done.stderr


def test_a_worker_that_refuses_at_start_ends_serve_before_it_listens(
    tiny_gguf: TinyModel,
) -> None:
    """``--mem-fraction`` with no ``--device``: the frontend cannot know the device; the
    worker resolves the CPU and refuses (exit 2, one line) before it listens, so serve
    never binds its port and exits 2 (issue 53: a failed start, not a live process that
    is never ready), and the worker is not started again."""
    argv = [sys.executable, "-m", "lifecycle", "serve", "--model", str(tiny_gguf.path),
            "--mem-fraction", "0.5", "--port", "0"]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "error: --mem-fraction sizes the KV cache on a CUDA device" in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("error: the worker refused")
    assert done.stderr.count("starting worker") == 1  # not restarted
    assert "listening on http" not in done.stderr
