"""What an engine is made with (``gpu/runtime/engine.py``; the worker fills it from its options,
``gpu/worker/config.py``): the cache's size, the scheduler's bounds, and the backends its
runner chooses once (``gpu/runtime/runner.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from gpu.runtime.speculation import Speculation
from wire.worker_options import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_PENDING,
    DEFAULT_MAX_RUNNING,
    DEFAULT_PREFIX_CACHE_DISK_MIB,
    DEFAULT_STEP_TOKENS,
)

__all__ = ["EngineConfig"]


@dataclass(frozen=True, slots=True)
class EngineConfig:
    kv_blocks: int
    block_size: int = DEFAULT_BLOCK_SIZE
    max_running: int = DEFAULT_MAX_RUNNING
    max_pending: int = DEFAULT_MAX_PENDING
    step_tokens: int = DEFAULT_STEP_TOKENS
    # the worker's own default depends on the device (gpu/worker/config.py)
    mixed_prefill_tokens: int = DEFAULT_STEP_TOKENS
    decode_graphs: str = "auto"  # auto (CUDA graphs on CUDA, off elsewhere) | on | eager | off
    overlap: str = "auto"  # auto (on CUDA, off elsewhere) | on | off: Engine.step
    kv_cache_dtype: str = (
        "auto"  # what K and V are stored as: gpu/cache/kv_cache.py, kv_storage_dtype
    )
    # auto: with the decode graphs, every other step replays piecewise (gpu/backends/piecewise.py)
    mixed_graphs: str = "auto"
    kernels: str = "torch"  # torch | triton: the torch path's ops (gpu/kernels/kernel_choice.py)
    # The native fused trunk where it applies (gpu/runtime/runner.py, trunk_for); False keeps
    # every step on the torch path (benchmarks and tests compare the two).
    fuse_trunk: bool = True
    # The prefix cache's disk tier (gpu/runtime/disk_prefix.py): its directory (None: none)
    # and its bound in MiB.
    prefix_cache_dir: str | None = None
    prefix_cache_disk_mib: int = DEFAULT_PREFIX_CACHE_DISK_MIB
    # Speculative decoding (gpu/runtime/speculation.py): off unless asked.
    speculation: Speculation = Speculation()
