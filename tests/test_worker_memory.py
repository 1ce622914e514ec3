"""The worker's memory: the KV cache sized by a flag in tokens or MiB, and its RSS split
into weights, KV and the rest (the log line, STATS' ``memory``, ``/server_info``)."""

from __future__ import annotations

import pytest
import torch

from gpu.cache.memory import MemoryFootprint, kv_bytes_per_token
from gpu.kernels.native import load_kernels
from gpu.worker.config import (
    WorkerConfig,
    build_engine,
    kv_blocks_for,
    parse_config,
)
from tests.tiny_gguf import TinyModel
from wire.worker_options import DEFAULT_CPU_KV_MIB, refused_combination

MIB = 2**20


# -- the KV cache's size ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("tokens", "blocks"),
    [(1024, 64), (1000, 62), (15, 1), (1, 1)],  # whole blocks, rounded down; at least one
)
def test_kv_cache_tokens_become_whole_blocks(tokens: int, blocks: int) -> None:
    config = WorkerConfig(kv_cache_tokens=tokens)
    assert kv_blocks_for(config, n_layers=2, n_kv=2, head_dim=16, elem=4) == blocks


def test_kv_memory_mib_becomes_blocks_of_k_and_v_of_every_layer() -> None:
    per_token = 2 * 2 * 2 * 16 * 4  # K and V x 2 layers x 2 KV heads x 16 dims x fp32
    for mib, config in ((3, WorkerConfig(kv_memory_mib=3)), (DEFAULT_CPU_KV_MIB, WorkerConfig())):
        assert kv_blocks_for(config, 2, 2, 16, 4) == mib * MIB // per_token // 16


def test_the_worker_takes_one_kv_size_and_a_positive_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert parse_config(["--kv-memory-mib", "64"]).kv_memory_mib == 64
    both = {"kv_cache_tokens": 64, "kv_memory_mib": 64}  # refused at build_engine, and by serve
    assert "not both" in (refused_combination(both) or "")
    for argv, message in (
        (["--kv-cache-tokens", "0"], "--kv-cache-tokens: must be at least 1, got 0"),
        (["--kv-memory-mib", "-1"], "--kv-memory-mib: must be at least 1, got -1"),
        (["--step-tokens", "0"], "--step-tokens: must be at least 1"),
        (["--mixed-prefill-tokens", "0"], "--mixed-prefill-tokens: must be at least 1"),
        (["--max-running", "0"], "--max-running: must be at least 1"),
        (["--weights", "q5"], "--weights: invalid choice 'q5' (choose from auto, quantized"),
    ):
        with pytest.raises(SystemExit) as exit:
            parse_config(argv)
        assert exit.value.code == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err  # one line, no usage block


def test_serve_passes_either_size_to_the_worker() -> None:
    from lifecycle.runtime import AppConfig, worker_args

    assert worker_args(AppConfig(kv_memory_mib=64))[-2:] == ("--kv-memory-mib", "64")
    assert worker_args(AppConfig(kv_cache_tokens=100))[-2:] == ("--kv-cache-tokens", "100")


def test_an_engine_sized_in_tokens_has_that_cache(tiny_gguf: TinyModel) -> None:
    engine = build_engine(
        WorkerConfig(model_path=str(tiny_gguf.path), device="cpu", kv_cache_tokens=1000)
    )
    assert engine.config.kv_blocks == 62 and engine.load()["kv_blocks_total"] == 62
    fp = engine.footprint()
    # fp16 where the tiny GGUF's weights stay quantized (not with LIFECYCLE_NATIVE=0)
    elem = engine.cache.k.element_size()
    assert elem == (2 if engine.model.quantized() else 4)
    assert fp.kv_bytes == 62 * 16 * kv_bytes_per_token(engine.mc, elem) == engine.cache.nbytes()
    assert fp.weights_bytes == engine.model.weight_bytes() > 0 and fp.device == "cpu"


# -- the split --------------------------------------------------------------------------------
def test_the_split_adds_up_and_the_line_says_it() -> None:
    fp = MemoryFootprint(weights_bytes=96 * MIB, kv_bytes=640 * MIB, device="cpu", kv_ranges=())
    s = fp.split(rss=361 * MIB)
    assert s == {"rss_bytes": 361 * MIB, "weights_bytes": 96 * MIB, "kv_bytes": 640 * MIB,
                 "kv_resident_bytes": 0, "other_bytes": 265 * MIB}  # fmt: skip
    assert fp.line(s) == (
        "memory: rss 361 MiB = weights 96 MiB + kv 0 MiB resident of 640 MiB reserved "
        "+ other 265 MiB"
    )
    now = fp.split()  # this process
    assert now["rss_bytes"] > 0
    assert now["weights_bytes"] + now["kv_resident_bytes"] + now["other_bytes"] == now["rss_bytes"]


def test_a_kv_cache_is_resident_as_it_is_written_and_other_never_negative() -> None:
    """Issue 53: the cache is reserved whole but its pages are mapped as they are first
    written (calloc, ``gpu/cache/kv_cache.py``); counted resident at its reserved size, the
    start-up line said ``other -375 MiB``. A real cache of 64 MiB, not touched, then
    half written, in a fresh interpreter, as a worker makes its cache at start: in this
    one, what earlier tests freed may hand calloc memory that is already resident."""
    import subprocess
    import sys
    from pathlib import Path

    code = "from tests.test_worker_memory import kv_resident_as_written as f; f()"
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


def kv_resident_as_written() -> None:
    """The body of the test above, run in its own interpreter."""
    from gpu.cache.kv_cache import PagedKVCache
    from modelfile.config import ModelConfig

    mc = ModelConfig("llama", 2, 64, 128, 4, 2, 16, 1e4, 1e-5, 64, 32, True, 1, 2, (2,), False,
                     "m")  # fmt: skip
    blocks = 64 * MIB // (kv_bytes_per_token(mc, 4) * 16)
    cache = PagedKVCache(mc, blocks, 16, device="cpu", native=False)
    fp = MemoryFootprint.of(5 * MIB, (cache.k, cache.v), "cpu")
    assert fp.kv_bytes == cache.nbytes() == 64 * MIB
    untouched = fp.split()
    assert untouched["kv_bytes"] == 64 * MIB and untouched["kv_resident_bytes"] < 4 * MIB
    assert untouched["other_bytes"] >= 0
    assert "kv 0 MiB resident of 64 MiB reserved" in fp.line(untouched)
    k = cache.k.view(-1)
    k[: k.numel() // 2] = 1.0  # half of K, a quarter of the cache: 16 MiB in one run
    written = fp.split()
    # at most a huge page more at either end of the run, resident as the RSS counts it
    assert 16 * MIB <= written["kv_resident_bytes"] - untouched["kv_resident_bytes"] <= 20 * MIB
    assert written["rss_bytes"] - untouched["rss_bytes"] >= 16 * MIB  # the RSS agrees
    assert written["other_bytes"] >= 0
    w = written
    assert w["weights_bytes"] + w["kv_resident_bytes"] + w["other_bytes"] == w["rss_bytes"]
    cache.k.fill_(2.0)
    cache.v.fill_(2.0)
    full = fp.split()
    assert full["kv_resident_bytes"] == 64 * MIB and full["other_bytes"] >= 0
    assert "kv 64 MiB resident of 64 MiB reserved" in fp.line(full)


def test_resident_bytes_counts_whole_pages_within_each_range() -> None:
    import mmap

    import numpy as np

    from gpu.cache.memory import resident_bytes

    page = mmap.PAGESIZE
    buf = np.zeros(64 * page, dtype=np.uint8)  # calloc: fresh pages, or reused heap
    at = buf.ctypes.data
    buf[::page] = 1  # one byte a page: every page resident
    assert resident_bytes([(at, buf.nbytes)]) == buf.nbytes
    assert resident_bytes([(at + 1, 10)]) == 10  # never more than the range's own bytes
    assert resident_bytes([]) == 0


def test_on_a_card_weights_and_kv_are_not_in_the_rss() -> None:
    fp = MemoryFootprint(weights_bytes=300 * MIB, kv_bytes=8 * 2**30, device="cuda:0",
                         kv_ranges=())  # fmt: skip
    s = fp.split(rss=900 * MIB)
    assert s["weights_bytes"] == s["kv_bytes"] == s["kv_resident_bytes"] == 0
    assert s["other_bytes"] == 900 * MIB
    assert s["device_weights_bytes"] == 300 * MIB and s["device_kv_bytes"] == 8 * 2**30
    assert fp.line(s) == ("memory: rss 900 MiB = weights 0 MiB + kv 0 MiB + other 900 MiB "
                          "(on cuda:0: weights 300 MiB, kv 8192 MiB)")  # fmt: skip


def test_server_info_shows_each_workers_memory(tiny_gguf: TinyModel) -> None:
    """A real worker behind ``lifecycle serve``, its cache sized in MiB by serve's flag."""
    import httpx

    from tests.scripted import lifecycle_server

    with lifecycle_server("--model", str(tiny_gguf.path), "--device", "cpu",
                          "--kv-memory-mib", "3", "--worker-args", "--threads 1") as url:  # fmt: skip
        info = httpx.get(url + "/server_info", timeout=30).json()
        again = httpx.get(url + "/server_info", timeout=30).json()
    state = info["internal_states"][0]
    m = state["memory"]
    assert set(m) == {"rss_bytes", "weights_bytes", "kv_bytes", "kv_resident_bytes",
                      "other_bytes"}  # fmt: skip
    assert all(m[k] > 0 for k in m if k != "kv_resident_bytes"), m
    assert 0 <= m["kv_resident_bytes"] <= m["kv_bytes"]
    assert m["weights_bytes"] + m["kv_resident_bytes"] + m["other_bytes"] == m["rss_bytes"]
    cap = state["capacity"]
    per_token = m["kv_bytes"] // (cap["kv_blocks"] * cap["block_size"])
    assert m["kv_bytes"] == cap["kv_blocks"] * cap["block_size"] * per_token <= 3 * MIB
    assert (3 * MIB - m["kv_bytes"]) < per_token * cap["block_size"]  # 3 MiB in whole blocks
    assert info["kv_memory_mib"] == 3  # echoed with the server's arguments
    # Measured per STATS: the figures are fresh, the allocations the same.
    m2 = again["internal_states"][0]["memory"]
    assert (m2["weights_bytes"], m2["kv_bytes"]) == (m["weights_bytes"], m["kv_bytes"])
    assert m2["weights_bytes"] + m2["kv_resident_bytes"] + m2["other_bytes"] == m2["rss_bytes"]


def test_the_mixed_prefill_cap_defaults_by_device() -> None:
    """32 prompt tokens a mixed step on the CPU (ITL at 32 streams), the step budget on
    CUDA; a given value wins on both."""
    from gpu.worker.config import mixed_prefill_tokens
    from wire.worker_options import CPU_MIXED_PREFILL_TOKENS

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert mixed_prefill_tokens(WorkerConfig(), cpu) == CPU_MIXED_PREFILL_TOKENS == 32
    assert mixed_prefill_tokens(WorkerConfig(step_tokens=256), cuda) == 256
    for dev in (cpu, cuda):
        assert mixed_prefill_tokens(WorkerConfig(mixed_prefill_tokens=100), dev) == 100


# -- what the cache stores -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("weights", "kv_cache_dtype", "stored"),
    [
        ("auto", "auto", None),  # fp16 where the tiny GGUF's blocks stay quantized
        ("fp32", "auto", torch.float32),  # dequantized: the model's own dtype
        ("auto", "fp32", torch.float32),
        ("fp32", "fp16", torch.float16),
        ("fp32", "bf16", torch.bfloat16),  # read back through the torch path, not the kernel
    ],
)
def test_the_kv_cache_element_follows_the_weights_or_the_flag(
    tiny_gguf: TinyModel, weights: str, kv_cache_dtype: str, stored: torch.dtype | None
) -> None:
    """``--kv-cache-dtype auto`` stores fp16 for quantized weights on the CPU (llama.cpp's
    f16 cache) and the model's dtype otherwise; a named one is what is stored. Sized in
    MiB, an element of half the bytes holds twice the tokens; the engine answers either
    way, the same tokens on a second run."""
    config = WorkerConfig(model_path=str(tiny_gguf.path), device="cpu", weights=weights,
                          kv_cache_dtype=kv_cache_dtype, kv_memory_mib=1)  # fmt: skip
    engine = build_engine(config)
    if stored is None:  # the weights stay quantized only with the native kernels
        stored = torch.float16 if engine.model.quantized() else torch.float32
    assert engine.cache.k.dtype == engine.cache.v.dtype == stored
    assert engine.cache.element == str(stored).removeprefix("torch.")
    elem = stored.itemsize
    # K and V x 2 layers x 2 KV heads x 16 dims, 16 tokens a block
    assert engine.config.kv_blocks == kv_blocks_for(config, 2, 2, 16, elem) == MIB // (2048 * elem)
    native_attention = stored != torch.bfloat16 and load_kernels() is not None
    assert (engine.cache.kernels is not None) == native_attention
    from tests.engine_runs import run_to_end

    prompts = [[5, 6, 7, 8, 9] * 7, [40, 41]]
    params = [{"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}] * 2
    first = run_to_end(engine, prompts, params)
    assert first == run_to_end(engine, prompts, params) and all(len(t) == 6 for t in first)


def test_tensor_parallel_keeps_the_cache_in_the_models_dtype(tiny_gguf: TinyModel) -> None:
    config = WorkerConfig(model_path=str(tiny_gguf.path), device="cpu", tp=2, kv_cache_dtype="fp16")
    with pytest.raises(SystemExit, match="--tp > 1 keeps the KV cache in --dtype"):
        build_engine(config)
