"""What one tensor-parallel rank holds of a model (``--tp K``): Megatron's split, by KV
groups, and the file as that rank reads it.

Each of K ranks holds a contiguous run of KV heads and the query heads that read them
(q/k/v projection rows, o projection columns), a contiguous slice of the MLP's
intermediate columns (gate/up rows, down columns) and a contiguous vocabulary range of
the embedding and the LM head. Runs are as even as they can be, the larger first:
SmolLM2-135M's 3 KV heads (9 query heads) at K = 2 are {0, 1} (6 query heads) on rank 0
and {2} (3) on rank 1, so every rank's KV cache holds only its own heads and K may be
anything up to the number of KV heads. ``load_model(rank=, world=)`` reads a rank's
slices through ``ShardSource`` and builds the decoder with its parallel linears
(``gpu/model/linear.py``): no rank holds the whole model at any time.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from modelfile.config import ModelConfig
from modelfile.gguf_meta import ModelFileError
from modelfile.source import ModelSource

__all__ = ["ShardPlan", "ShardSource", "even_runs", "shard_plan"]


def even_runs(n: int, parts: int) -> list[range]:
    """``range(n)`` cut into ``parts`` contiguous runs whose sizes differ by at most one,
    the larger runs first."""
    base, extra = divmod(n, parts)
    starts = [r * base + min(r, extra) for r in range(parts + 1)]
    return [range(a, b) for a, b in itertools.pairwise(starts)]


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """What rank ``rank`` of ``world`` holds of a model."""

    rank: int
    world: int
    kv_heads: range
    q_heads: range
    ffn: range  # the MLP's intermediate columns
    vocab: range  # embedding rows and LM-head rows
    vocab_rows: int  # every rank's vocabulary slice padded to this (the gather's size)

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The config the shard's decoder and KV cache see: its own heads and MLP width;
        the vocabulary, context and everything the engine reads unchanged."""
        return dataclasses.replace(
            config, n_heads=len(self.q_heads), n_kv_heads=len(self.kv_heads), ffn=len(self.ffn)
        )


def shard_plan(config: ModelConfig, world: int, rank: int) -> ShardPlan:
    """The split of ``config`` over ``world`` ranks; refuses a world larger than the number
    of KV heads (a rank without a KV head would have no attention to compute)."""
    if world < 1:
        raise ValueError(f"--tp must be at least 1, got {world}")
    if world > config.n_kv_heads:
        raise ValueError(
            f"--tp {world} exceeds the {config.n_kv_heads} KV heads of {config.name}: "
            f"tensor parallelism splits by KV head, so use --tp {config.n_kv_heads} or fewer"
        )
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of {world}")
    group = config.n_heads // config.n_kv_heads
    kv = even_runs(config.n_kv_heads, world)[rank]
    q = range(kv.start * group, kv.stop * group)
    vocab_rows = -(-config.vocab_size // world)
    vocab = range(rank * vocab_rows, min((rank + 1) * vocab_rows, config.vocab_size))
    return ShardPlan(rank, world, kv, q, even_runs(config.ffn, world)[rank], vocab, vocab_rows)


class ShardSource:
    """A model file as one rank reads it (``modelfile.source.ModelSource``): each tensor
    the plan splits comes back as this rank's slice (``_cut``: q/k/v by whole heads, so
    llama's permuted q/k rows un-permute within them as before; Phi-3's fused q/k/v and
    gate/up each part's slice, joined), the embedding and an untied LM head as its
    vocabulary rows zero-padded to ``vocab_rows``. Everything else is the file's."""

    def __init__(self, f: ModelSource, config: ModelConfig, plan: ShardPlan) -> None:
        self._f, self._c, self._plan, self.path = f, config, plan, f.path

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def blocks(self, name: str) -> np.ndarray:
        raise ModelFileError(self.path, "tensor-parallel shards are read as floats")

    def _cut(self, name: str) -> tuple[int, list[slice]] | None:
        """How ``name`` is cut: (its axis, 0 for rows or 1 for columns; the slices joined
        along it), or None (whole)."""
        c, p, hd = self._c, self._plan, self._c.head_dim
        q = slice(p.q_heads.start * hd, p.q_heads.stop * hd)
        kv = slice(p.kv_heads.start * hd, p.kv_heads.stop * hd)
        f = slice(p.ffn.start, p.ffn.stop)
        q_rows, kv_rows = c.n_heads * hd, c.n_kv_heads * hd
        cuts = {
            "attn_q": (0, [q]),
            "attn_k": (0, [kv]),
            "attn_v": (0, [kv]),
            "attn_qkv": (0, [q, _shift(kv, q_rows), _shift(kv, q_rows + kv_rows)]),
            "attn_output": (1, [q]),
            "ffn_gate": (0, [f]),
            "ffn_up": (0, [f, _shift(f, c.ffn)] if c.fused_gate_up else [f]),  # Phi-3: gate, up
            "ffn_down": (1, [f]),
        }
        return cuts.get(name.split(".")[2]) if name.startswith("blk.") else None

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        shape = self._f.tensor_shape(name)
        if name in _VOCAB_TENSORS:
            return (self._plan.vocab_rows, *shape[1:])
        if (cut := self._cut(name)) is None:
            return shape
        n = sum(s.stop - s.start for s in cut[1])
        return (n, *shape[1:]) if cut[0] == 0 else (shape[0], n)

    def dequantize(self, name: str) -> np.ndarray:
        full = self._f.dequantize(name)
        if name in _VOCAB_TENSORS:
            v = self._plan.vocab
            out = np.zeros((self._plan.vocab_rows, *full.shape[1:]), np.float32)
            out[: len(v)] = full[v.start : v.stop]
            return out
        if (cut := self._cut(name)) is None:
            return full
        axis, slices = cut
        parts = [full[s] if axis == 0 else full[:, s] for s in slices]
        return np.ascontiguousarray(np.concatenate(parts, axis=axis), dtype=np.float32)


_VOCAB_TENSORS = ("token_embd.weight", "output.weight")


def _shift(s: slice, by: int) -> slice:
    return slice(s.start + by, s.stop + by)
