"""Driving the worker's pieces by hand in tests: a model step without an engine, and a
sampler row as plain data (the engine passes its sequences)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from gpu.cache.kv_cache import PagedKVCache
from gpu.model.decoder import Llama
from gpu.runtime.runner import trunk_for
from wire.sampling import SamplingParams


def forward(
    model: Llama,
    cache: PagedKVCache,
    ids: Tensor,
    positions: Tensor,
    logits_indices: Tensor | None = None,
    fuse: bool = True,
) -> Tensor:
    """One step of ``model`` on ``cache`` (declared with ``prepare``) as an engine runs
    it: the trunk ``trunk_for`` chooses, then the logits of rows ``logits_indices`` (all
    rows if None). A loop of steps keeps one ``trunk_for``."""
    out = model.logits(trunk_for(model, cache, fuse=fuse)(ids, positions), logits_indices)
    assert isinstance(out, Tensor)
    return out


@dataclass(slots=True)
class SampleRow:
    """A ``gpu.runtime.sampling.Row`` as plain data."""

    params: SamplingParams
    prompt: Sequence[int]
    output: Sequence[int]
    generator: torch.Generator | None
    eog_ids: Sequence[int] = ()
    greedy: bool = field(init=False)
    plain: bool = field(init=False)

    def __post_init__(self) -> None:
        self.greedy = self.params.greedy
        self.plain = not self.params.adjusts_logits
