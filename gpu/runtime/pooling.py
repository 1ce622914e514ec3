"""Embed requests: their vectors from a step's final hidden rows (``Engine.step``)."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from gpu.runtime.scheduler import Sequence

__all__ = ["pool"]


def pool(
    final_norm: Callable[[Tensor], Tensor], x: Tensor, pooling: list[tuple[Sequence, int, int]]
) -> list[tuple[Sequence, Tensor]]:
    """Pool this step's final hidden rows ``x`` (each embed request: its sequence, first
    row, rows); the vectors of those whose prefill this step completes. Mean pooling sums
    over the chunks, in fp32."""
    done = []
    for seq, row, n in pooling:
        last = seq.num_computed + n == len(seq.tokens)
        if seq.options.embed is None or seq.options.embed.pooling == "last":
            if last:
                done.append((seq, final_norm(x[row + n - 1]).float()))
            continue
        part = final_norm(x[row : row + n]).float().sum(0)
        seq.pooled = part if seq.pooled is None else seq.pooled + part
        if last:
            done.append((seq, seq.pooled / len(seq.tokens)))
    return done
