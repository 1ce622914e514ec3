"""The kit that proves the CUDA path on a GPU machine the bundled model cannot travel to
(tools/gpu_check.sh): the model's metadata dumped (tools/model_meta.py), a random model
of the same shape written from it (tools/random_gguf.py) and loaded by the worker's
loader and the frontend's tokenizer, and bench/gpu_step.py on the CPU. Built from the
tiny GGUF's metadata, so no test here needs the 98 MB file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from gpu.model.loader import load_model
from gpu.runtime.engine import Engine, EngineConfig
from modelfile.gguf_file import GGUFFile
from modelfile.vocab import load_tokenizer
from tests.tiny_gguf import TinyModel
from wire import SubmitEntry, ids_to_list, pack_ids

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import model_meta  # noqa: E402
import random_gguf  # noqa: E402


@pytest.fixture(scope="module")
def meta(tiny_gguf: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The tiny model's metadata, through the gzipped JSON file and back."""
    path = tmp_path_factory.mktemp("meta") / "meta.json.gz"
    model_meta.write_meta(model_meta.dump_meta(tiny_gguf.path), path)
    return model_meta.read_meta(path)


@pytest.fixture(scope="module")
def random_model(meta: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_gguf.write_random_gguf(meta, tmp_path_factory.mktemp("rand") / "r.gguf")


def _greedy(path: Path, prompts: list[list[int]], n: int) -> dict[int, list[int]]:
    engine = Engine(load_model(path, device="cpu"), EngineConfig(64, 16, 4, 16, 512, 512))
    sampling = {"temperature": 0, "ignore_eos": True, "max_new_tokens": n}
    errors, _ = engine.submit(
        [SubmitEntry(i + 1, pack_ids(p), sampling, {}) for i, p in enumerate(prompts)]
    )
    assert not errors
    out: dict[int, list[int]] = {}
    while engine.has_work:
        for e in engine.step():
            out.setdefault(e.rid, []).extend(ids_to_list(e.new_ids))
    return out


def test_meta_keeps_every_key_and_tensor(tiny_gguf: TinyModel, meta: dict[str, Any]) -> None:
    keys = {e["key"]: e for e in meta["kv"]}
    assert keys["tokenizer.ggml.tokens"]["value"] == tiny_gguf.tokens
    assert keys["tokenizer.ggml.tokens"]["sub_type"] == "STRING"
    assert keys["tokenizer.ggml.token_type"]["sub_type"] == "INT32"
    assert keys["tokenizer.ggml.add_bos_token"] == {
        "key": "tokenizer.ggml.add_bos_token", "type": "BOOL", "sub_type": None, "value": False,
    }  # fmt: skip
    assert "tokenizer.chat_template" in keys and "tokenizer.ggml.merges" in keys
    f = GGUFFile(tiny_gguf.path)
    assert {t["name"]: tuple(t["shape"]) for t in meta["tensors"]} == {
        n: f.tensor_shape(n) for n in f.tensor_names
    }
    assert {t["ggml_type"] for t in meta["tensors"]} == {"F32", "Q8_0", "Q4_1"}


def test_random_model_has_the_same_shape_and_tokenizer(
    tiny_gguf: TinyModel, random_model: Path
) -> None:
    tok, chat, config = load_tokenizer(tiny_gguf.path)
    rtok, rchat, rconfig = load_tokenizer(random_model)
    assert rconfig == config.__class__(**{**_fields(config), "name": rconfig.name})
    assert rconfig.name.endswith("(random weights)")
    text = "hello world <|im_end|>"
    assert rtok.encode(text) == tok.encode(text)
    assert chat is not None and rchat is not None and rchat.source == chat.source
    f = GGUFFile(random_model)
    for name in f.tensor_names:
        shape = f.tensor_shape(name)
        assert f.tensor_type(name).name == ("F32" if len(shape) == 1 else "F16")
        w = f.dequantize(name)
        if len(shape) == 1:
            assert np.all(w == (1.0 if name.endswith("norm.weight") else 0.0))
        else:
            assert abs(float(w.std()) - random_gguf.STD) < 0.1 * random_gguf.STD


def _fields(config: Any) -> dict[str, Any]:
    return {k: getattr(config, k) for k in config.__slots__}


def test_random_model_generates_finite_logits_and_tokens(random_model: Path) -> None:
    lm = load_model(random_model, device="cpu")
    from gpu.cache.kv_cache import PagedKVCache, PrefillChunk
    from tests.model_steps import forward

    ids = [5, 40, 77, 100, 200, 30]
    cache = PagedKVCache(lm.config, 1, 16)
    cache.prepare([], [PrefillChunk([0], 0, len(ids))])
    with torch.inference_mode():
        logits = forward(lm.model, cache, torch.tensor(ids), torch.arange(len(ids)))
    assert torch.isfinite(logits).all()
    assert 0.05 < float(logits.std()) < 5.0  # spread out, neither flat nor exploding
    out = _greedy(random_model, [ids, ids[:3]], 6)
    assert sorted(out) == [1, 2] and all(len(t) == 6 for t in out.values())
    assert all(0 <= t < lm.config.vocab_size for t in out[1] + out[2])


def test_shrink_keeps_the_first_blocks(meta: dict[str, Any], tmp_path: Path) -> None:
    small = random_gguf.shrink(meta, 1)
    path = random_gguf.write_random_gguf(small, tmp_path / "one.gguf", dtype="f32", seed=3)
    lm = load_model(path, device="cpu")
    assert lm.config.n_layers == 1 and len(lm.model.layers) == 1
    assert not any(t["name"].startswith("blk.1.") for t in small["tensors"])
    assert GGUFFile(path).tensor_type("token_embd.weight").name == "F32"


def test_gpu_step_runs_on_the_cpu(random_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "step.json"
    argv = [sys.executable, str(ROOT / "bench" / "gpu_step.py"), "--model", str(random_model),
            "--device", "cpu", "--batches", "1", "3", "--context", "20", "--prompt", "16",
            "--runs", "2", "--warmup", "1", "--copy-mib", "8", "--json", str(out)]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["backend"] == "eager" and res["bandwidth_bytes_per_s"] > 0
    assert [r["batch"] for r in res["decode"]] == [1, 3]
    for row in res["decode"]:
        assert row["shape"][0] == row["batch"]  # the batch is a captured size: no padding
        assert row["argmax_agree"] == 1.0 and row["max_abs_logit_diff"] < 1e-3
        assert row["eager"]["min_ms"] > 0 and row["graphs"]["ratio_w"] > 0
        assert "replay" not in row  # CUDA only
    assert res["prefill"]["tokens"] == 16
    assert "graphs vs eager" in proc.stdout
