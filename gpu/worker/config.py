"""What a worker runs with: its options (``WorkerConfig``, the command line of
``python -m gpu.worker``) and the ``Engine`` they build: the model (on K ranks under
``--tp``), the KV cache's size (tokens, MiB, or a share of a CUDA card's memory:
``gpu/cache/memory.py``) and the decode path (``--decode-graphs``: ``gpu/backends/graphs.py``).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, replace

import torch

import wire
from gpu.cache.kv_cache import kv_dtype_refusal, kv_storage_dtype, kv_value_bytes
from gpu.cache.memory import cuda_free_bytes, plan_kv
from gpu.model.loader import load_model, resolve_device
from gpu.runtime.drafter import DraftMismatch
from gpu.runtime.engine import Engine, EngineConfig
from gpu.runtime.speculation import Speculation
from wire.worker_options import (
    CPU_MIXED_PREFILL_TOKENS,
    DEFAULT_CPU_KV_MIB,
    DEFAULT_MEM_FRACTION,
    WORKER_OPTIONS,
    OneLineParser,
    refused_combination,
    value_parser,
    worker_defaults,
)

__all__ = [
    "WorkerConfig",
    "build_engine",
    "device_refused",
    "kv_blocks_for",
    "mixed_prefill_tokens",
    "parse_config",
    "refused_at_start",
]

log = logging.getLogger("gpu.worker")

_DESCRIPTION = "The worker process: python -m gpu.worker --listen unix:/path | tcp:HOST:PORT."
_D = worker_defaults()  # every default, from the one table (wire/worker_options.py)


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """The options of ``WORKER_OPTIONS``, by name (the help there says what each means)."""

    model_path: str | None = _D["model_path"]
    device: str | None = _D["device"]  # None: CUDA when present, else CPU
    dtype: str | None = _D["dtype"]  # None: bf16 on CUDA, fp32 on CPU
    listen: str = _D["listen"]
    kv_cache_tokens: int | None = _D["kv_cache_tokens"]  # None: from kv_memory_mib / mem_fraction
    kv_memory_mib: int | None = _D["kv_memory_mib"]  # None: DEFAULT_CPU_KV_MIB on the CPU
    kv_cache_dtype: str = _D["kv_cache_dtype"]  # gpu/cache/kv_cache.py, kv_storage_dtype
    mem_fraction: float | None = _D["mem_fraction"]  # CUDA: DEFAULT_MEM_FRACTION when unsized
    decode_graphs: str = _D["decode_graphs"]  # gpu/backends/graphs.py
    overlap: str = _D["overlap"]  # gpu/runtime/engine.py, Engine.step
    mixed_graphs: str = _D["mixed_graphs"]  # gpu/backends/piecewise.py
    kernels: str = _D["kernels"]  # gpu/kernels/kernel_choice.py
    weights: str = _D["weights"]  # gpu/model/loader.py; --tp > 1: fp32
    context_length: int | None = _D["context_length"]  # None: the model's (with_context)
    block_size: int = _D["block_size"]
    max_running: int = _D["max_running"]
    max_pending: int = _D["max_pending"]
    step_tokens: int = _D["step_tokens"]
    # None: CPU_MIXED_PREFILL_TOKENS on the CPU, step_tokens on CUDA
    mixed_prefill_tokens: int | None = _D["mixed_prefill_tokens"]
    threads: int | None = _D["threads"]  # None: gpu/worker/threads.py, resolve_threads
    tp: int = _D["tp"]  # tensor-parallel ranks (gpu/parallel/tp.py), each a process
    token: str | None = _D["token"]  # None: LIFECYCLE_WORKER_TOKEN
    tls_cert: str | None = _D["tls_cert"]
    tls_key: str | None = _D["tls_key"]  # when not in the certificate file
    prefix_cache_dir: str | None = _D["prefix_cache_dir"]  # gpu/runtime/disk_prefix.py
    prefix_cache_disk_mib: int = _D["prefix_cache_disk_mib"]
    speculative: str = _D["speculative"]  # gpu/runtime/speculation.py
    speculative_tokens: int = _D["speculative_tokens"]
    speculative_draft: str | None = _D["speculative_draft"]  # --speculative draft's model
    speculative_ngram_min: int = _D["speculative_ngram_min"]
    speculative_ngram_max: int = _D["speculative_ngram_max"]


def mixed_prefill_tokens(config: WorkerConfig, device: torch.device) -> int:
    """``--mixed-prefill-tokens``, or the device's default when it is not given."""
    if config.mixed_prefill_tokens is not None:
        return config.mixed_prefill_tokens
    return config.step_tokens if device.type == "cuda" else CPU_MIXED_PREFILL_TOKENS


def kv_blocks_for(
    config: WorkerConfig, n_layers: int, n_kv: int, head_dim: int, elem: float
) -> int:
    """KV blocks for ``kv_cache_tokens`` (rounded down to whole blocks), else for
    ``kv_memory_mib`` (default ``DEFAULT_CPU_KV_MIB``) of K and V of every layer, ``elem``
    bytes a value (``kv_value_bytes``: 34 / 32 for q8_0, 18 / 32 for q4_0); at least one."""
    tokens = config.kv_cache_tokens
    if tokens is None:
        mib = config.kv_memory_mib if config.kv_memory_mib is not None else DEFAULT_CPU_KV_MIB
        # exact: elem is a whole number of bytes, 17/16 or 9/16, head_dim then a multiple of 32
        tokens = int(mib * 2**20 // (2 * n_layers * n_kv * head_dim * elem))
    return max(1, tokens // config.block_size)


def _sized_by_fraction(config: WorkerConfig, device: torch.device) -> bool:
    """The KV cache takes a share of the card when it is on CUDA and neither a token
    count nor a size in MiB was given (or a fraction was)."""
    if config.mem_fraction is not None:
        return True
    return device.type == "cuda" and config.kv_cache_tokens is None and not config.kv_memory_mib


def parse_config(argv: list[str] | None) -> WorkerConfig:
    p = OneLineParser(prog="python -m gpu.worker", description=_DESCRIPTION)
    for o in WORKER_OPTIONS:
        p.add_argument(
            o.cli, dest=o.name, type=value_parser(o.type, o.refused), default=o.default,
            metavar="{" + ",".join(o.choices) + "}" if o.choices else None,
            help=o.help_with_default,
        )  # fmt: skip
    config = WorkerConfig(**vars(p.parse_args(argv)))
    try:
        token = wire.resolve_token(config.token)
    except ValueError as exc:
        p.error(str(exc))
    return replace(config, token=token)


def device_refused(device: str | None) -> str | None:
    """Why this torch cannot run ``--device`` (already of the form cpu, cuda or cuda:N:
    ``wire.worker_options``), in one line; None when it can."""
    if device is None or not device.startswith("cuda"):
        return None
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        why = "is built without CUDA" if torch.version.cuda is None else "finds no CUDA device"
        return f"--device {device}: this torch ({torch.__version__}) {why}; use --device cpu"
    index = int(device.partition(":")[2] or 0)
    if index >= count:
        return f"--device {device}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
    return None


def refused_at_start(config: WorkerConfig) -> str | None:
    """Why this worker cannot run its options on this torch, before it loads anything
    (the worker listens only once it may): the device (``device_refused``), then the
    options' rules with the device resolved (``--device`` unset: CUDA when present)."""
    if (refused := device_refused(config.device)) is not None:
        return refused
    device, _ = resolve_device(config.device, config.dtype)
    return refused_combination({**asdict(config), "device": device.type})


def speculation(config: WorkerConfig) -> Speculation:
    """``--speculative`` and its bounds as the engine takes them."""
    return Speculation(config.speculative, config.speculative_tokens,
                       config.speculative_ngram_min, config.speculative_ngram_max)  # fmt: skip


def build_engine(config: WorkerConfig) -> Engine:
    followers = None
    if (refused := refused_combination(asdict(config))) is not None:
        raise SystemExit(refused)
    if config.tp > 1:
        from gpu.parallel import tp  # spawns the other ranks; never imported at --tp 1

        lm, followers = tp.start_leader(
            config.tp, config.model_path, config.device, config.dtype, config.threads
        )
    else:
        lm = load_model(
            config.model_path, device=config.device, dtype=config.dtype, weights=config.weights,
            context_length=config.context_length,
        )  # fmt: skip
    # The same rules with the device the model went to (``--device`` unset: CUDA when present)
    if (refused := refused_combination({**asdict(config), "device": lm.device.type})) is not None:
        raise SystemExit(refused)
    mc = lm.config  # at --tp > 1 rank 0's shard: the KV budget is per rank
    quantized = lm.model.quantized()
    if (why := kv_dtype_refusal(config.kv_cache_dtype, lm.device, mc.head_dim)) is not None:
        raise SystemExit(why)
    kv_dtype = kv_storage_dtype(config.kv_cache_dtype, lm.device, lm.dtype, quantized)
    elem = kv_value_bytes(kv_dtype)  # bytes of one stored value (q8_0: 34 / 32, q4_0: 18 / 32)
    plan = None
    if _sized_by_fraction(config, lm.device):
        plan = plan_kv(
            cuda_free_bytes(lm.device),
            config.mem_fraction or DEFAULT_MEM_FRACTION,  # CUDA: never q8_0/q4_0 (refused)
            mc, int(elem), config.block_size, config.step_tokens, config.max_running,
            graphs=config.decode_graphs in ("auto", "on"),
        )  # fmt: skip
        blocks = plan.blocks
        log.info("KV cache: %s", plan.info())
    else:
        blocks = kv_blocks_for(config, mc.n_layers, mc.n_kv_heads, mc.head_dim, elem)
    graphs = config.decode_graphs
    if followers is not None:  # every step reaches the followers: no graph replays one
        graphs = tp.graphs_under_tp(graphs)
    engine_config = EngineConfig(
        blocks, config.block_size, config.max_running, config.max_pending, config.step_tokens,
        mixed_prefill_tokens(config, lm.device), graphs, config.overlap, config.kv_cache_dtype,
        config.mixed_graphs, config.kernels, prefix_cache_dir=config.prefix_cache_dir,
        prefix_cache_disk_mib=config.prefix_cache_disk_mib, speculation=speculation(config),
    )  # fmt: skip
    draft = None
    if config.speculative_draft is not None:  # --speculative draft's model, beside it
        draft = load_model(config.speculative_draft, device=str(lm.device), dtype=config.dtype,
                           weights=config.weights, context_length=config.context_length)  # fmt: skip
    try:
        engine = Engine(lm, engine_config, plan, followers=followers, draft=draft)
    except DraftMismatch as exc:  # a draft model that does not fit the served one
        raise SystemExit(str(exc)) from None
    if followers is not None:
        followers.start(engine_config, engine.max_context)  # they make the same runner
    return engine
