"""The tensor-parallel shard of ``Llama``: Megatron's split, by KV groups.

Each of K ranks holds a contiguous run of KV heads and the query heads that read them
(q/k/v projection rows, o projection columns), a contiguous slice of the MLP's
intermediate columns (gate/up rows, down columns) and a contiguous vocabulary range of
the embedding and the LM head. Runs are as even as they can be, the larger first:
SmolLM2-135M's 3 KV heads (9 query heads) at K = 2 are {0, 1} (6 query heads) on rank 0
and {2} (3) on rank 1, so every rank's KV cache holds only its own heads and K may be
anything up to the number of KV heads.

Per layer exactly two all-reduces (sum): after the o projection and after the down
projection, each rank having multiplied its slice of the inner dimension; both live in
``ReducingLinear`` so the unmodified layer (``Llama.attention_in``, ``attention_out``) runs
on the shard. The embedding is looked up in each rank's vocabulary range (zeros
elsewhere) and all-reduced: exact, as every row has a single non-zero term. The LM head computes each rank's vocabulary
slice (padded to equal size for the collective) and gathers it on rank 0, the only rank
that samples.

Each rank reads its own slices from the file as the loader reads it (``ShardSource``,
``load_model(shard=ShardLoad(world, rank))``): the loader and the decoder are the
single-process ones, and no rank holds the whole model at any time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar, cast

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import Tensor

from gpu.model.decoder import AttentionBackend, Llama, LlamaWeights, Ops, PackedLinear
from gpu.parallel.tp_messages import encode_forward, encode_logits
from modelfile.config import ModelConfig
from modelfile.gguf_meta import ModelFileError
from modelfile.source import ModelSource

__all__ = [
    "GatheringLinear",
    "ReducingLinear",
    "ShardLoad",
    "ShardPlan",
    "ShardSource",
    "ShardedLlama",
    "even_runs",
    "shard_plan",
]

_P = TypeVar("_P", bound=PackedLinear)

log = logging.getLogger("gpu.parallel.tp")


def even_runs(n: int, parts: int) -> list[range]:
    """``range(n)`` cut into ``parts`` contiguous runs whose sizes differ by at most one,
    the larger runs first."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for r in range(parts):
        size = base + (r < extra)
        out.append(range(start, start + size))
        start += size
    return out


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
        """The config the shard's ``Llama`` and ``PagedKVCache`` see: its own heads and
        MLP width; the vocabulary, context and everything the engine reads unchanged."""
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
    vocab_rows = -(-config.vocab_size // world)
    start = rank * vocab_rows
    return ShardPlan(
        rank,
        world,
        kv,
        range(kv.start * group, kv.stop * group),
        even_runs(config.ffn, world)[rank],
        range(start, min(start + vocab_rows, config.vocab_size)),
        vocab_rows,
    )


def _adopt(cls: type[_P], packed: PackedLinear) -> _P:
    """A ``cls`` sharing ``packed``'s weight and its packed copies (packed once only)."""
    out = cls.__new__(cls)
    for name in PackedLinear.__slots__:
        setattr(out, name, getattr(packed, name))
    return out


class ReducingLinear(PackedLinear):
    """A row-parallel projection: this rank's partial product, summed over the group."""

    __slots__ = ("group",)
    group: dist.ProcessGroup | None

    @classmethod
    def around(cls, packed: PackedLinear, group: dist.ProcessGroup | None) -> ReducingLinear:
        out = _adopt(cls, packed)
        out.group = group
        return out

    def __call__(self, x: Tensor) -> Tensor:
        out = super().__call__(x)
        dist.all_reduce(out, group=self.group)
        return out


class GatheringLinear(PackedLinear):
    """The vocabulary-parallel LM head: full logits ``[K, vocab]`` on rank 0; the other
    ranks return their own slice (nobody reads it)."""

    __slots__ = ("group", "rank", "vocab_size", "world")
    group: dist.ProcessGroup | None
    rank: int
    vocab_size: int
    world: int

    @classmethod
    def around(
        cls, packed: PackedLinear, plan: ShardPlan, vocab_size: int, group: dist.ProcessGroup | None
    ) -> GatheringLinear:
        out = _adopt(cls, packed)
        out.group = group
        out.rank, out.world, out.vocab_size = plan.rank, plan.world, vocab_size
        return out

    def __call__(self, x: Tensor) -> Tensor:
        part = super().__call__(x).contiguous()
        if self.rank != 0:
            dist.gather(part, None, dst=0, group=self.group)
            return part
        parts = [torch.empty_like(part) for _ in range(self.world)]
        dist.gather(part, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1)[:, : self.vocab_size]


class ShardedLlama(Llama):
    """One rank's ``Llama``: its own heads, MLP slice and vocabulary range.

    Only the embedding differs from ``Llama.trunk``; the layers' two all-reduces are in
    their ``o`` and ``down`` projections and the gather in ``head``.
    """

    def __init__(
        self,
        config: ModelConfig,
        plan: ShardPlan,
        embed: Tensor,
        layers: list[LlamaWeights],
        norm: Tensor,
        lm_head: Tensor | None,
        group: dist.ProcessGroup | None,
        rope_freqs: Tensor | None = None,
        announce: Callable[[list[int]], None] | None = None,
    ) -> None:
        """``announce``: rank 0's, which tells the followers each call before joining its
        collectives (None on a follower)."""
        super().__init__(config, embed, layers, norm, lm_head, rope_freqs)
        self.plan, self.group = plan, group
        self.announce = announce
        # The shards are fp32 slices (load_model(weights="fp32")): PackedLinear throughout.
        self.head = GatheringLinear.around(
            cast(PackedLinear, self.head), plan, config.vocab_size, group
        )
        for layer in layers:
            layer.o = ReducingLinear.around(cast(PackedLinear, layer.o), group)
            layer.down = ReducingLinear.around(cast(PackedLinear, layer.down), group)

    def trunk(
        self, input_ids: Tensor, positions: Tensor, attn: AttentionBackend, ops: Ops = None
    ) -> Tensor:
        if self.announce is not None:
            self.announce(encode_forward(input_ids.tolist(), positions.tolist()))
        with _in_step():
            x = self.embed_tokens(input_ids)
            if self.embed_scale is not None:
                x = x * self.embed_scale
            return self.run_layers(x, positions, attn, ops)

    def logits(
        self, x: Tensor, logits_indices: Tensor | None = None, return_hidden: bool = False
    ) -> Tensor | tuple[Tensor, Tensor]:
        if self.announce is not None:
            rows = range(x.shape[0]) if logits_indices is None else logits_indices.tolist()
            self.announce(encode_logits(rows))
        with _in_step():
            return super().logits(x, logits_indices, return_hidden)

    def embed_tokens(self, input_ids: Tensor) -> Tensor:
        """Rows of the full embedding: this rank's range looked up, zeros elsewhere, summed."""
        local = input_ids - self.plan.vocab.start
        mine = (local >= 0) & (local < len(self.plan.vocab))
        x = F.embedding(local.clamp(0, len(self.plan.vocab) - 1), self.embed)
        x = x * mine.unsqueeze(1).to(x.dtype)
        dist.all_reduce(x, group=self.group)
        return x


@contextlib.contextmanager
def _in_step() -> Iterator[None]:
    """A rank that fails inside a collective has left its group out of step, for good:
    the process exits (rank 0 takes the followers with it; a follower, rank 0)."""
    try:
        yield
    except Exception:
        log.critical("tensor-parallel rank failed inside a collective: exiting", exc_info=True)
        logging.shutdown()
        os._exit(1)


class ShardSource:
    """A model file as one rank reads it (``modelfile.source.ModelSource``): each
    tensor the plan splits comes back as this rank's slice, cut from the file's tensor
    as it is read, so no rank ever holds the whole model. Rows of the q/k/v projections
    (and biases) by head, whole heads, so llama's permuted q/k rows un-permute within
    them as before; columns of the o projection; rows of gate/up and columns of down by
    the MLP's slice (Phi-3's fused q/k/v and gate/up: each part's slice, joined); rows
    of the embedding and an untied LM head by the vocabulary range, zero-padded to
    ``vocab_rows``. Everything else (norms, RoPE factors) is the file's."""

    def __init__(self, f: ModelSource, config: ModelConfig, plan: ShardPlan) -> None:
        self._f, self._c, self._plan, self.path = f, config, plan, f.path

    def has_tensor(self, name: str) -> bool:
        return self._f.has_tensor(name)

    def stored_name(self, name: str) -> str:
        return self._f.stored_name(name)

    def tensor_type(self, name: str) -> GGMLQuantizationType:
        return self._f.tensor_type(name)

    def stored_bytes(self) -> dict[str, int]:
        return self._f.stored_bytes()

    def check_tensor_types(self) -> None:
        self._f.check_tensor_types()

    def blocks(self, name: str) -> np.ndarray:
        raise ModelFileError(self.path, "tensor-parallel shards are read as floats")

    def _cut(self, name: str) -> tuple[str, list[slice]] | None:
        """How ``name`` is cut: ("rows" or "cols", the slices joined), or None (whole)."""
        c, p, hd = self._c, self._plan, self._c.head_dim
        q = slice(p.q_heads.start * hd, p.q_heads.stop * hd)
        kv = slice(p.kv_heads.start * hd, p.kv_heads.stop * hd)
        f = slice(p.ffn.start, p.ffn.stop)
        q_rows, kv_rows = c.n_heads * hd, c.n_kv_heads * hd
        part = name.split(".")[2] if name.startswith("blk.") else ""
        if part == "attn_q":
            return "rows", [q]
        if part in ("attn_k", "attn_v"):
            return "rows", [kv]
        if part == "attn_qkv":
            at = q_rows + kv_rows
            return "rows", [q, _shift(kv, q_rows), _shift(kv, at)]
        if part == "attn_output":
            return "cols", [q]
        if part == "ffn_gate" or (part == "ffn_up" and not c.fused_gate_up):
            return "rows", [f]
        if part == "ffn_up":  # Phi-3: gate rows, then up rows
            return "rows", [f, _shift(f, c.ffn)]
        if part == "ffn_down":
            return "cols", [f]
        return None

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        shape = self._f.tensor_shape(name)
        if name in _VOCAB_TENSORS:
            return (self._plan.vocab_rows, *shape[1:])
        cut = self._cut(name)
        if cut is None:
            return shape
        n = sum(s.stop - s.start for s in cut[1])
        return (n, *shape[1:]) if cut[0] == "rows" else (shape[0], n)

    def dequantize(self, name: str) -> np.ndarray:
        full = self._f.dequantize(name)
        if name in _VOCAB_TENSORS:
            v = self._plan.vocab
            out = np.zeros((self._plan.vocab_rows, *full.shape[1:]), np.float32)
            out[: len(v)] = full[v.start : v.stop]
            return out
        cut = self._cut(name)
        if cut is None:
            return full
        axis = 0 if cut[0] == "rows" else 1
        parts = [full[s] if axis == 0 else full[:, s] for s in cut[1]]
        return np.ascontiguousarray(np.concatenate(parts, axis=axis), dtype=np.float32)


_VOCAB_TENSORS = ("token_embd.weight", "output.weight")


def _shift(s: slice, by: int) -> slice:
    return slice(s.start + by, s.stop + by)


class ShardLoad:
    """``load_model(shard=...)`` for rank ``rank`` of ``world``: the file read through
    ``ShardSource`` into a model of the rank's own heads, MLP slice and vocabulary rows,
    which ``model`` then turns into the ``ShardedLlama`` (the parallel linears)."""

    def __init__(self, world: int, rank: int) -> None:
        self.world, self.rank = world, rank
        self.plan: ShardPlan | None = None
        self.config: ModelConfig | None = None

    def __call__(self, f: ModelSource, config: ModelConfig) -> tuple[ShardSource, ModelConfig]:
        self.plan, self.config = shard_plan(config, self.world, self.rank), config
        local = self.plan.local_config(config)
        return ShardSource(f, config, self.plan), dataclasses.replace(
            local, vocab_size=self.plan.vocab_rows
        )

    def model(
        self,
        built: Llama,
        group: dist.ProcessGroup | None,
        announce: Callable[[list[int]], None] | None = None,
    ) -> ShardedLlama:
        """The rank's ``ShardedLlama`` over the weights ``load_model`` built (``announce``:
        rank 0's, ``ShardedLlama``)."""
        assert self.plan is not None and self.config is not None, "load_model first"
        tied = built.lm_head is built.embed
        return ShardedLlama(
            self.plan.local_config(self.config), self.plan, built.embed.data,
            [cast(LlamaWeights, layer) for layer in built.layers], built.norm.data,
            None if tied else built.lm_head.data, group, built.rope_freqs, announce,
        )  # fmt: skip
