"""How big the KV cache is: sized by tokens or MiB on the CPU, by a fraction of the
card's free memory on a GPU (``--mem-fraction``, as SGLang's ``mem_fraction_static``
is read here: of the memory free once the weights are loaded, this share is static).

From that share the worker keeps back what a step needs besides the cache: the
activations of the largest step (``step_tokens`` rows through the widest layer, the
LM head's logits for ``max_running`` rows and the sampler's copies of them) and the
captured decode graphs' pool, which are allocated after the cache. What remains is the
KV cache, in whole blocks. The arithmetic is pure so that the CPU tests check it; on a
GPU ``cuda_free_bytes`` reads the card.
"""

from __future__ import annotations

from dataclasses import dataclass

from modelfile.config import ModelConfig

__all__ = [
    "DEFAULT_MEM_FRACTION",
    "GRAPH_POOL_BYTES",
    "KVPlan",
    "activation_bytes",
    "kv_bytes_per_token",
    "plan_kv",
]

DEFAULT_MEM_FRACTION = 0.85
GRAPH_POOL_BYTES = 256 * 2**20  # the decode graphs' shared pool (a small model's steps)


def kv_bytes_per_token(mc: ModelConfig, elem: int) -> int:
    """K and V of every layer for one token."""
    return 2 * mc.n_layers * mc.n_kv_heads * mc.head_dim * elem


def activation_bytes(mc: ModelConfig, step_tokens: int, max_running: int, elem: int) -> int:
    """A step's peak working set besides the cache and the weights: the largest layer's
    tensors for ``step_tokens`` rows (residual, normed input, q/k/v, attention output,
    gate/up and their product), the attention scores of one prefill chunk, and fp32
    logits for ``max_running`` rows three times over (head output, sampler, mask)."""
    qkv = (mc.n_heads + 2 * mc.n_kv_heads) * mc.head_dim
    per_row = (3 * mc.hidden + qkv + mc.n_heads * mc.head_dim + 3 * mc.ffn) * elem
    scores = mc.n_heads * step_tokens * step_tokens * 4
    logits = 3 * max_running * mc.vocab_size * 4
    return 2 * step_tokens * per_row + scores + logits  # x2: an op's input and output live


@dataclass(frozen=True, slots=True)
class KVPlan:
    blocks: int
    bytes: int  # the cache's size
    free_bytes: int  # free on the device when sized (after the weights)
    reserve_bytes: int  # kept back for activations and graphs
    fraction: float

    def info(self) -> dict[str, int | float]:
        return {
            "kv_cache_bytes": self.bytes,
            "mem_fraction": self.fraction,
            "mem_free_at_sizing": self.free_bytes,
            "mem_reserved_for_steps": self.reserve_bytes,
        }


def plan_kv(
    free_bytes: int,
    fraction: float,
    mc: ModelConfig,
    elem: int,
    block_size: int,
    step_tokens: int,
    max_running: int,
    graphs: bool,
) -> KVPlan:
    """The KV cache for ``fraction`` of ``free_bytes``, less a step's working set and
    the graph pool; at least one block. ``ValueError`` for a fraction outside (0, 1]."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"mem fraction must be in (0, 1], got {fraction}")
    reserve = activation_bytes(mc, step_tokens, max_running, elem)
    reserve += GRAPH_POOL_BYTES if graphs else 0
    usable = max(0, int(free_bytes * fraction) - reserve)
    per_block = kv_bytes_per_token(mc, elem) * block_size
    blocks = max(1, usable // per_block)
    return KVPlan(blocks, blocks * per_block, free_bytes, reserve, fraction)


def cuda_free_bytes(device: object) -> int:
    """Free memory on a CUDA device now (after the weights are on it)."""
    import torch

    free, _total = torch.cuda.mem_get_info(device)  # type: ignore[arg-type]
    return int(free)
