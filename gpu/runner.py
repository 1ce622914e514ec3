"""The model side of a step: one batch of rows in, the last layer's rows and the logits
of the rows that need them out.

``Engine.step`` reads schedule, run, postprocess; ``ModelRunner.run`` is the middle.
It owns what depends on the device and the weights rather than on the requests:

- the KV cache layout of the step (``PagedKVCache.prepare``: decode rows and prompt
  chunks, their block tables);
- CUDA graph replay (``gpu/graphs.py``) when the step is a captured shape: pure decode,
  every row sampled, no hidden states asked; any other step, with graphs on, replays
  piecewise around an eager attention (``gpu/piecewise.py``);
- the trunk, whose fused native or torch path the model chooses itself
  (``Llama.trunk``: the fused trunk for quantized weights on the CPU, docs/determinism.md);
  a tensor-parallel shard announces the step to its followers inside its trunk
  (``gpu/tp_model.py``);
- the LM head on just the rows that need logits (the largest matmul of the model).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from gpu.graphs import StepGraphs
from gpu.host import ints, put_futures
from gpu.kv_cache import PagedKVCache, PrefillChunk
from gpu.model import Llama
from gpu.piecewise import MixedGraphs

__all__ = ["ModelRunner", "StepInput", "StepOutput"]


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


@dataclass(slots=True)
class StepOutput:
    """``x``: every row's last-layer output (None after a graph replay, which keeps only
    the logits); ``logits`` of ``logit_rows`` (None when none were asked); ``hidden``."""

    x: Tensor | None
    logits: Tensor | None
    hidden: Tensor | None


class ModelRunner:
    def __init__(
        self,
        model: Llama,
        cache: PagedKVCache,
        graphs: StepGraphs | None,
        mixed: MixedGraphs | None = None,
    ) -> None:
        self.model = model
        self.cache = cache
        self.graphs = graphs
        self.mixed = mixed

    def run(self, step: StepInput) -> StepOutput:
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
            x = self.model.trunk(ids, ints(step.pos, device=dev), self.cache)
        if not step.logit_rows:  # a step of embed prefills alone needs no LM head
            return StepOutput(x, None, None)
        idx = ints(step.logit_rows, device=dev)
        out = self.model.logits(x, idx, step.want_hidden)
        logits, hidden = out if isinstance(out, tuple) else (out, None)
        return StepOutput(x, logits, hidden)
