"""What a worker says of itself (``gpu/worker/process.py``): HELLO, once a connection is
authenticated (its model, and the capacity and backends its engine runs with), and the
body of a STATS reply (the engine's load, its integrity check, memory, step figures)."""

from __future__ import annotations

import os
from typing import Any

import wire
from gpu.cache.memory import device_memory
from gpu.runtime.engine import Engine
from modelfile.source import model_bytes

__all__ = ["hello", "stats"]


def hello(engine: Engine) -> wire.Hello:
    """The worker's HELLO: its model and what it runs it with (specs/wire.cddl)."""
    lm, mc, c = engine.loaded, engine.mc, engine.config
    model = {
        "name": mc.name,
        "path": str(lm.path),
        "file_bytes": model_bytes(lm.path),  # with path: the model's identity in traces
        "arch": mc.arch,
        "vocab_size": mc.vocab_size,
        "context_length": mc.context_length,
        "eos_id": mc.eos_id,
        "eog_ids": list(mc.eog_ids),
        "device": str(lm.device),
        "dtype": str(lm.dtype).removeprefix("torch."),
        "pid": os.getpid(),
        "hidden_size": mc.hidden,
    }
    if engine.model.plan is not None:  # a tensor-parallel rank's shard
        model["tp"] = engine.model.plan.world
    capacity: dict[str, Any] = {
        "max_running": c.max_running,
        "max_pending": c.max_pending,
        "kv_blocks": c.kv_blocks,
        "block_size": c.block_size,
        "max_context": engine.max_context,
        **engine.runner.backends(),
        "overlap": engine.overlap,
        "weights": "quantized" if engine.model.quantized() else "dense",
        "kv_dtype": engine.cache.element,
        "kv_bytes_per_token": engine.cache.bytes_per_token(),  # q8_0: 0.53x fp16's
    }
    if engine.disk is not None:  # the prefix cache's disk tier (--prefix-cache-dir)
        capacity["prefix_cache_dir"] = str(engine.disk.store.root)
        capacity["prefix_cache_disk_mib"] = c.prefix_cache_disk_mib
    if (spec := c.speculation).on:  # --speculative and its bounds
        capacity["speculative"] = {"mode": spec.mode, "tokens": spec.tokens,
                                   "ngram": [spec.ngram_min, spec.ngram_max]}  # fmt: skip
        if engine.drafter is not None:
            capacity["speculative"]["draft"] = str(engine.drafter.model.path)
    if engine.kv_plan is not None:
        capacity.update(engine.kv_plan.info())
    return wire.Hello(model, capacity)


def stats(engine: Engine) -> dict[str, Any]:
    """A STATS reply: the engine's load, integrity, memory and step figures."""
    load = engine.load()
    problems = engine.check()
    load["integrity_ok"] = not problems
    if problems:
        load["integrity_problems"] = problems[:8]
    footprint = engine.footprint()
    # RSS now (STATS is asked for, not periodic), and on CUDA the card's memory.
    load["memory"] = {**footprint.split(), **device_memory(footprint.device)}
    load.update(engine.step_stats.to_wire())  # the steps since start-up (wire/stats.py)
    return load
