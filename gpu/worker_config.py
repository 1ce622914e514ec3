"""What a worker runs with: its options (``WorkerConfig``, the command line of
``python -m gpu.worker``) and the ``Engine`` they build: the model (on K ranks under
``--tp``), the KV cache's size (tokens, MiB, or a share of a CUDA card's memory:
``gpu/memory.py``) and the decode path (``--decode-graphs``: ``gpu/graphs.py``).
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, replace

import torch

import wire
from gpu.engine import DEFAULT_BLOCK_SIZE, Engine, EngineConfig
from gpu.graphs import GRAPH_MODES
from gpu.loader import WEIGHT_MODES, load_model
from gpu.memory import DEFAULT_MEM_FRACTION, cuda_free_bytes, plan_kv

__all__ = [
    "CPU_MIXED_PREFILL_TOKENS",
    "WorkerConfig",
    "build_engine",
    "kv_blocks_for",
    "mixed_prefill_tokens",
    "parse_config",
]

log = logging.getLogger("gpu.worker")

# 14,560 tokens of SmolLM2 in fp32 (46,080 bytes each): with the quantized weights (96 MiB)
# and the rest (~260 MiB) the worker stays near llama-server's own resident size with
# its default 32k-token f16 cache (862 MiB here), where 1024 MiB made it 1.6x that.
DEFAULT_CPU_KV_MIB = 640
_DESCRIPTION = "The worker process: python -m gpu.worker --listen unix:/path | tcp:HOST:PORT."


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    model_path: str | None = None
    device: str | None = None  # None: CUDA when present, else CPU
    dtype: str | None = None  # None: bf16 on CUDA, fp32 on CPU
    listen: str = "unix:/tmp/lifecycle-worker.sock"
    kv_cache_tokens: int | None = None  # None: sized from kv_memory_mib or mem_fraction
    kv_memory_mib: int | None = None  # None: DEFAULT_CPU_KV_MIB on the CPU; on CUDA, mem_fraction
    mem_fraction: float | None = None  # CUDA: share of free memory after the weights (0.85)
    decode_graphs: str = "auto"  # auto | on | eager | off (gpu/graphs.py)
    weights: str = "auto"  # auto | quantized | fp32 | q8_0 | q4_0 (gpu/loader.py; --tp > 1: fp32)
    context_length: int | None = None  # tokens served; None: the model's (with_context)
    block_size: int = DEFAULT_BLOCK_SIZE
    max_running: int = 64
    max_pending: int = 256
    step_tokens: int = 512
    # Prompt tokens per step while others decode; None: CPU_MIXED_PREFILL_TOKENS on the
    # CPU, step_tokens on CUDA (where a step's time hardly grows with its rows).
    mixed_prefill_tokens: int | None = None
    threads: int | None = None  # torch intra-op threads; None: torch's default (all cores)
    tp: int = 1  # tensor-parallel ranks (gpu/tp.py), each a process; 1: this one alone
    token: str | None = None  # serve only a frontend that proves it (None: LIFECYCLE_WORKER_TOKEN)
    tls_cert: str | None = None  # TLS on the TCP link with this certificate chain (PEM)
    tls_key: str | None = None  # its private key, when not in the certificate file


# On the CPU a step's time grows with its rows (about 1.8 ms a row at 32-64 rows), so a
# prompt chunk that joins the decodes lengthens every stream's gap. Capping a mixed
# step's prompt tokens at 32, measured 2026-12-04 (64 tokens in, 64 out, streaming):
# at 32 streams ITL p50 / p99 104 / 126 ms at 277 tok/s, against 75 / 144 at cap 64
# (305 tok/s) and 77 / 654 with no cap (512: waves of new prompts make 0.7 s steps);
# at 4 and 16 streams throughput and TTFT p50 as without a cap.
CPU_MIXED_PREFILL_TOKENS = 32


def mixed_prefill_tokens(config: WorkerConfig, device: torch.device) -> int:
    """``--mixed-prefill-tokens``, or the device's default when it is not given."""
    if config.mixed_prefill_tokens is not None:
        return config.mixed_prefill_tokens
    return config.step_tokens if device.type == "cuda" else CPU_MIXED_PREFILL_TOKENS


def kv_blocks_for(config: WorkerConfig, n_layers: int, n_kv: int, head_dim: int, elem: int) -> int:
    """KV blocks for ``kv_cache_tokens`` (rounded down to whole blocks), else for
    ``kv_memory_mib`` (default ``DEFAULT_CPU_KV_MIB``) of K and V of every layer; at least one."""
    tokens = config.kv_cache_tokens
    if tokens is None:
        mib = config.kv_memory_mib if config.kv_memory_mib is not None else DEFAULT_CPU_KV_MIB
        tokens = mib * 2**20 // (2 * n_layers * n_kv * head_dim * elem)
    return max(1, tokens // config.block_size)


def _sized_by_fraction(config: WorkerConfig, device: torch.device) -> bool:
    """The KV cache takes a share of the card when it is on CUDA and neither a token
    count nor a size in MiB was given (or a fraction was)."""
    if config.mem_fraction is not None:
        return True
    return device.type == "cuda" and config.kv_cache_tokens is None and not config.kv_memory_mib


def parse_config(argv: list[str] | None) -> WorkerConfig:
    d = WorkerConfig()
    p = argparse.ArgumentParser(prog="python -m gpu.worker", description=_DESCRIPTION)
    p.add_argument("--model", dest="model_path", default=d.model_path)
    p.add_argument("--device", default=d.device)
    p.add_argument("--dtype", default=d.dtype)
    p.add_argument("--listen", default=d.listen)
    p.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=d.kv_cache_tokens,
        help="tokens the KV cache holds, in whole blocks (SGLang's --max-total-tokens)",
    )
    p.add_argument(
        "--kv-memory-mib",
        type=int,
        default=d.kv_memory_mib,
        help=f"KV cache size in MiB (default: {DEFAULT_CPU_KV_MIB} on the CPU; on CUDA, --mem-fraction)",
    )
    p.add_argument(
        "--mem-fraction",
        type=float,
        default=d.mem_fraction,
        help=f"CUDA: the KV cache's share of free memory after the weights, less a "
        f"step's working set and the graph pool (default {DEFAULT_MEM_FRACTION})",
    )
    p.add_argument(
        "--decode-graphs",
        choices=GRAPH_MODES,
        default=d.decode_graphs,
        help="decode steps replayed from captured graphs: auto = CUDA graphs on CUDA",
    )
    p.add_argument(
        "--context-length",
        type=int,
        default=d.context_length,
        help="tokens a request may span, prompt and output (default: the model's; higher "
        "only with RoPE scaling in the file)",
    )
    p.add_argument(
        "--weights",
        choices=WEIGHT_MODES,
        default=d.weights,
        help="auto: on the CPU keep the GGUF's quantized blocks and compute on them "
        "(native kernels), else dequantize to --dtype; quantized: blocks for every "
        "projection (floats requantized to Q8_0); fp32: dequantize all; q8_0 / q4_0: "
        "quantize every matrix to that type at load (CPU)",
    )
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--max-running", type=int, default=d.max_running)
    p.add_argument("--max-pending", type=int, default=d.max_pending)
    p.add_argument("--step-tokens", type=int, default=d.step_tokens)
    p.add_argument(
        "--mixed-prefill-tokens",
        type=int,
        default=d.mixed_prefill_tokens,
        help="prompt tokens per step while other requests decode (bounds their ITL; "
        f"default {CPU_MIXED_PREFILL_TOKENS} on the CPU, --step-tokens on CUDA)",
    )
    p.add_argument("--threads", type=int, default=d.threads)
    p.add_argument(
        "--tp",
        type=int,
        default=d.tp,
        help="tensor-parallel ranks, one process each (at most the model's KV heads; "
        "one torch thread per rank unless --threads)",
    )
    p.add_argument(
        "--token",
        default=d.token,
        help=f"serve only a frontend that knows this secret (default: ${wire.TOKEN_ENV})",
    )
    p.add_argument("--tls-cert", default=d.tls_cert, help="TLS on the TCP link (PEM chain)")
    p.add_argument("--tls-key", default=d.tls_key, help="the certificate's key (PEM)")
    config = WorkerConfig(**vars(p.parse_args(argv)))
    if config.tp < 1:
        p.error(f"--tp must be at least 1, got {config.tp}")
    if config.kv_cache_tokens is not None and config.kv_memory_mib is not None:
        p.error("size the KV cache by --kv-cache-tokens or by --kv-memory-mib, not both")
    for flag, value in (("--kv-cache-tokens", config.kv_cache_tokens),
                        ("--kv-memory-mib", config.kv_memory_mib),
                        ("--step-tokens", config.step_tokens),
                        ("--mixed-prefill-tokens", config.mixed_prefill_tokens)):  # fmt: skip
        if value is not None and value < 1:
            p.error(f"{flag} must be at least 1, got {value}")
    try:
        token = wire.resolve_token(config.token)
    except ValueError as exc:
        p.error(str(exc))
    return replace(config, token=token)


def build_engine(config: WorkerConfig) -> Engine:
    if config.threads:
        # On a CPU shared with other busy processes, one thread avoids stalls at every
        # op's barrier (measured 3-8x faster under load); two win on a quiet machine.
        torch.set_num_threads(config.threads)
    followers = None
    if config.tp > 1 and config.weights in ("quantized", "q8_0", "q4_0"):
        raise SystemExit(f"--tp > 1 splits fp32 weights: --weights {config.weights} runs at --tp 1")
    if config.tp > 1:
        from gpu import tp  # spawns the other ranks; never imported at --tp 1

        lm, followers = tp.start_leader(
            config.tp, config.model_path, config.device, config.dtype, config.threads
        )
    else:
        lm = load_model(
            config.model_path, device=config.device, dtype=config.dtype, weights=config.weights,
            context_length=config.context_length,
        )  # fmt: skip
    mc = lm.config  # at --tp > 1 rank 0's shard: the KV budget is per rank
    elem = lm.dtype.itemsize  # the KV cache's element: the compute dtype
    plan = None
    if _sized_by_fraction(config, lm.device):
        if lm.device.type != "cuda":
            raise SystemExit("--mem-fraction sizes the KV cache on a CUDA device; "
                             "use --kv-cache-tokens or --kv-memory-mib on the CPU")  # fmt: skip
        plan = plan_kv(
            cuda_free_bytes(lm.device),
            config.mem_fraction or DEFAULT_MEM_FRACTION,
            mc, elem, config.block_size, config.step_tokens, config.max_running,
            graphs=config.decode_graphs in ("auto", "on"),
        )  # fmt: skip
        blocks = plan.blocks
        log.info("KV cache: %s", plan.info())
    else:
        blocks = kv_blocks_for(config, mc.n_layers, mc.n_kv_heads, mc.head_dim, elem)
    engine = Engine(
        lm,
        EngineConfig(
            blocks,
            config.block_size,
            config.max_running,
            config.max_pending,
            config.step_tokens,
            mixed_prefill_tokens(config, lm.device),
            config.decode_graphs,
        ),
    )
    engine.kv_plan = plan
    if followers is not None:
        tp.lead(engine, followers)
    return engine
