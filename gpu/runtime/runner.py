"""The model side of a step: one batch of rows in, the last layer's rows and the logits
of the rows that need them out.

``Engine.step`` reads schedule, run, postprocess; ``ModelRunner.run`` is the middle.
It owns what depends on the device and the weights rather than on the requests:

- the KV cache layout of the step (``PagedKVCache.prepare``: decode rows and prompt
  chunks, their block tables);
- CUDA graph replay (``gpu/backends/graphs.py``) when the step is a captured shape: pure decode,
  every row sampled, no hidden states asked; any other step, with graphs on, replays
  piecewise around an eager attention (``gpu/backends/piecewise.py``);
- the trunk, chosen once when the runner is built (``trunk_for``): the native fused
  trunk (``gpu/backends/fused.py``) for quantized weights on the CPU's native attention
  (docs/determinism.md), else the model's torch path through the kernels chosen
  (torch's or Triton's);
- the LM head on just the rows that need logits (the largest matmul of the model);
- the step's KV loads and copies (``StepInput.loads``, ``.copies``), made before the
  model runs;
- under ``--tp``, rank 0 tells its followers each step, which run it on the same runner
  over their shards (``gpu/parallel/tp.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from functools import partial
from typing import cast

from torch import Tensor

from gpu.backends.fused import FusedTrunk
from gpu.backends.graphs import StepGraphs, graph_backend
from gpu.backends.piecewise import MixedGraphs
from gpu.cache.kv_cache import PagedKVCache, PrefillChunk, kv_storage_dtype
from gpu.kernels.host import ints, put_futures
from gpu.kernels.kernel_choice import triton_ops
from gpu.kernels.native import load_kernels
from gpu.model.decoder import Llama, LlamaWeights, Ops
from gpu.model.loader import LoadedModel
from gpu.runtime.engine_config import EngineConfig
from modelfile.layer_spec import refusal
from wire.worker_options import MIXED_GRAPH_MODES

__all__ = [
    "Followers",
    "ModelRunner",
    "NativeTrunk",
    "StepInput",
    "StepOutput",
    "Trunk",
    "trunk_for",
]

# A step's trunk over the declared cache: token ids and positions in, every row's
# last-layer output ``[T, hidden]`` out.
Trunk = Callable[[Tensor, Tensor], Tensor]
# Rank 0's tensor-parallel followers: a step told to them, which they run on the same
# runner while rank 0 runs it within this context (``gpu/parallel/tp.py``).
Followers = Callable[["StepInput"], AbstractContextManager[object]]


@dataclass(frozen=True, slots=True)
class NativeTrunk:
    """A step's layers in one native call (``gpu/backends/fused.py``), every row one query over
    the cache's declared layout."""

    model: Llama
    cache: PagedKVCache
    fused: FusedTrunk

    def __call__(self, ids: Tensor, positions: Tensor) -> Tensor:
        rows = self.cache.row_queries()
        assert rows is not None, "the native kernels lay every step out as row queries"
        return self.fused(self.model.embed_rows(ids), positions, *rows)


def trunk_for(model: Llama, cache: PagedKVCache, ops: Ops = None, fuse: bool = True) -> Trunk:
    """The trunk of ``model``'s steps on ``cache``, chosen once: the native fused trunk
    when ``fuse`` and it applies (quantized weights, the cache on the CPU's native
    attention kernel, ``FusedTrunk.applies``), else the torch path through ``ops``.
    ``fuse`` False keeps every step on the torch path (``EngineConfig.fuse_trunk``:
    benchmarks and tests compare the two)."""
    layers = [cast(LlamaWeights, layer) for layer in model.layers]
    kernels = load_kernels()
    if (
        fuse
        and kernels is not None
        and model.quantized()
        and FusedTrunk.applies(model.config, model.spec, layers, cache)
    ):
        rope = [model.rope_table(i) for i in range(model.config.n_layers)]
        fused = FusedTrunk(model.config, model.spec, layers, rope, cache, kernels)
        return NativeTrunk(model, cache, fused)
    return partial(model.trunk, attn=cache, ops=ops)


@dataclass(slots=True)
class StepInput:
    """A step's rows: token ids and positions in row order, the decode rows' (block
    table, keys after the step) and the prompt chunks, in the order their rows come."""

    ids: list[int] = field(default_factory=list)
    pos: list[int] = field(default_factory=list)
    decodes: list[tuple[list[int], int]] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    logit_rows: list[int] = field(default_factory=list)  # rows that need logits, in order
    want_hidden: bool = False  # the final hidden state of the logit rows too
    all_sampled_decodes: bool = False  # every row a decode row that samples
    # Rows whose input is a token the previous step sampled and the host has not read
    # (an overlapped step, ``Engine``): (rows, their indices in it, its tokens on the
    # device). Those rows of ``ids`` hold a placeholder until the device fills them.
    future: tuple[list[int], list[int], Tensor] | None = None
    # KV rows to copy before the model runs, in order: (src block, dst block, rows), the
    # scheduler's copy-on-write (``Scheduler.copy_rows``).
    copies: list[tuple[int, int, int]] = field(default_factory=list)
    # Blocks read back from the prefix cache's disk tier (``gpu/runtime/disk_prefix.py``):
    # (block, K rows, V rows), written before the copies.
    loads: list[tuple[int, Tensor, Tensor]] = field(default_factory=list)


@dataclass(slots=True)
class StepOutput:
    """``x``: every row's last-layer output (None after a graph replay, which keeps only
    the logits); ``logits`` of ``logit_rows`` (None when none were asked); ``hidden``."""

    x: Tensor | None
    logits: Tensor | None
    hidden: Tensor | None


class ModelRunner:
    """The model side of an engine's steps, every device decision made here once: the
    kernels of the torch path (``--kernels``), the KV cache, the trunk (``trunk_for``),
    decode graphs and piecewise graphs (``--decode-graphs``, ``--mixed-graphs``)."""

    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig,
        max_context: int,
        cache_type: Callable[..., PagedKVCache] = PagedKVCache,
        followers: Followers | None = None,
    ) -> None:
        """``cache_type``: what makes the cache (``Engine``); ``followers``: rank 0's of
        ``--tp``, told every step before it runs (``gpu/parallel/tp.py``)."""
        self.followers = followers
        if config.mixed_graphs not in MIXED_GRAPH_MODES:
            raise ValueError(f"mixed graphs must be one of {', '.join(MIXED_GRAPH_MODES)}, "
                             f"got {config.mixed_graphs!r}")  # fmt: skip
        dev, model = loaded.device, loaded.model
        self.model = model
        backend = graph_backend(config.decode_graphs, dev)
        self.ops = triton_ops(config.kernels, dev)
        # every backend asked for runs every feature of the model's layers, or the
        # engine is not made (modelfile/layer_spec.py; the fused trunk gives way instead)
        chosen = ("torch", *(("triton",) if self.ops else ()), *(("graphs",) if backend else ()))
        for name in chosen:
            if (why := refusal(name, model.spec)) is not None:
                raise ValueError(why)
        kv_dtype = kv_storage_dtype(config.kv_cache_dtype, dev, loaded.dtype, model.quantized())
        self.cache = cache = cache_type(
            loaded.config, config.kv_blocks, config.block_size, dev, loaded.dtype,
            scratch=backend is not None, kv_dtype=kv_dtype, ops=self.ops,
        )  # fmt: skip
        self.trunk = trunk_for(model, cache, self.ops, config.fuse_trunk)
        self.graphs: StepGraphs | None = None
        self.mixed: MixedGraphs | None = None
        if backend is not None:  # they capture the torch path (their layouts are not
            torch_trunk = trunk_for(model, cache, self.ops, fuse=False)  # the native kernel's)
            self.graphs = StepGraphs(
                model, cache, torch_trunk, backend, config.max_running, max_context
            )
            if config.mixed_graphs == "auto":
                self.mixed = MixedGraphs(model, cache, self.ops, backend, config.step_tokens)

    def backends(self) -> dict[str, str]:
        """What was chosen, as HELLO's capacity names it."""
        return {
            "decode_graphs": self.graphs.kind if self.graphs is not None else "off",
            "mixed_graphs": self.mixed.kind if self.mixed is not None else "off",
            "kernels": "triton" if self.ops is not None else "torch",
            "trunk": "fused" if isinstance(self.trunk, NativeTrunk) else "torch",
        }

    def run(self, step: StepInput) -> StepOutput:
        """The step's KV copies, then its model call (a graph replay, piecewise or the
        trunk) and the LM head on the rows that need logits; on rank 0 of ``--tp`` inside
        ``followers`` (which has the other ranks run it too)."""
        if self.followers is None:
            return self._run(step)
        with self.followers(step):
            return self._run(step)

    def _run(self, step: StepInput) -> StepOutput:
        for block, k, v in step.loads:
            self.cache.write_block(block, k, v)
        for src, dst, n in step.copies:
            self.cache.copy_rows(src, dst, n)
        if (
            self.graphs is not None
            and step.all_sampled_decodes
            and not step.want_hidden
            and step.logit_rows == list(range(len(step.ids)))
        ):
            logits = self.graphs.run(step.ids, step.pos, step.decodes, step.future)
            if logits is not None:
                return StepOutput(None, logits, None)
        dev = self.cache.device
        x = None
        if self.mixed is not None:
            x = self.mixed.run(step.ids, step.pos, step.decodes, step.prefills, step.future)
        if x is None:
            self.cache.prepare(step.decodes, step.prefills)
            ids = ints(step.ids, device=dev)
            if step.future is not None:
                put_futures(ids, step.future)
            x = self.trunk(ids, ints(step.pos, device=dev))
        if not step.logit_rows:  # a step of embed prefills alone needs no LM head
            return StepOutput(x, None, None)
        idx = ints(step.logit_rows, device=dev)
        out = self.model.logits(x, idx, step.want_hidden)
        logits, hidden = out if isinstance(out, tuple) else (out, None)
        return StepOutput(x, logits, hidden)
