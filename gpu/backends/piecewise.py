"""Steps that carry prompt chunks, replayed piecewise: captured graphs around an eager
attention (CUDA graphs on a GPU, the same pieces run without capture elsewhere, so the
CPU tests the logic a GPU replays).

A pure-decode step replays whole (``gpu/backends/graphs.py``): its attention has the shape of a
padded batch. The attention of a step with prompt chunks depends on every chunk's length
and context, so only the rest of the model is captured: everything a layer does row by
row. The step's rows (``T`` tokens: decode rows and prompt chunks, as
``PagedKVCache.prepare`` declares them) are padded up to the next of ``token_sizes``
(powers of two from 16 up to ``--step-tokens``), and each padded size ``P`` has
``L + 1`` pieces over static buffers of ``P`` rows:

- piece 0: the embedding of ``ids``, each RoPE table's rows at ``pos``, and layer 0 up
  to its attention (``Llama.attention_in``): ``q``, ``k``, ``v``;
- piece ``i`` (1 to ``L - 1``): layer ``i - 1`` from its attention's output ``o`` on
  (``Llama.attention_out``), then layer ``i`` up to its attention;
- piece ``L``: the last layer from ``o`` on, into ``x``: the trunk's rows.

Between two pieces layer ``i``'s attention runs eagerly over the ``T`` real rows (the
cache's own paths, which also write their K and V), its output copied into ``o``. The
LM head then runs eagerly on the rows that need logits. Padding rows (stale ids and
positions of earlier steps, zeros at first: finite values) pass through the pieces
only: every op there is row-wise, so they touch no real row, and they never reach the
attention or the cache.

A decode step replays one graph; a mixed step of a 30-layer model replays 31 and runs
30 attentions eagerly, where without the pieces it launches every op of every layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from gpu.backends.graphs import GraphBackend
from gpu.cache.kv_cache import PagedKVCache, PrefillChunk
from gpu.kernels.host import ints, pinned, put_futures
from gpu.model.decoder import Llama, Ops

__all__ = ["MixedGraphs", "token_sizes"]

MIN_TOKENS = 16


def token_sizes(max_tokens: int) -> tuple[int, ...]:
    """The padded step sizes: powers of two from 16, then ``max_tokens`` itself."""
    sizes, n = [], MIN_TOKENS
    while n < max_tokens:
        sizes.append(n)
        n *= 2
    sizes.append(max(max_tokens, 1))
    return tuple(sizes)


class _Statics:
    """The static buffers, once, at the largest size: every size's pieces read and write
    views of their heads (the same addresses each replay)."""

    def __init__(self, model: Llama, rows: int, device: torch.device, dtype: torch.dtype) -> None:
        c = model.config
        self.ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.pos = torch.zeros(rows, dtype=torch.int64, device=device)
        self.x = torch.zeros(rows, c.hidden, dtype=dtype, device=device)
        self.q = torch.zeros(rows, c.n_heads, c.head_dim, dtype=dtype, device=device)
        self.k = torch.zeros(rows, c.n_kv_heads, c.head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.o = torch.zeros(rows, c.n_heads * c.head_dim, dtype=dtype, device=device)
        # Each RoPE table's rows (sliding-window layers may have their own; a layer
        # without RoPE none: ``table_of`` None), as the model's spec numbers them.
        self.table_of = model.spec.rope_of
        shape = (rows, 1, c.head_dim)
        n = len(model.spec.rope_tables)
        self.cos = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n)]
        self.sin = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n)]


class MixedGraphs:
    """Any step of at most ``max_tokens`` rows through its padded size's pieces;
    ``run`` returns the step's output, or None when it is too large (run it eagerly)."""

    def __init__(
        self, model: Llama, cache: PagedKVCache, ops: Ops, backend: GraphBackend, max_tokens: int
    ) -> None:
        """``ops``: the kernels of the model's torch path (``gpu.runtime.runner.ModelRunner``)."""
        self.model, self.cache, self.ops, self.backend = model, cache, ops, backend
        self.sizes = token_sizes(max_tokens)
        self.pieces: dict[int, list[Callable[[], None]]] = {}
        self._statics: _Statics | None = None  # made with the first capture
        self.replays = 0  # steps replayed
        self.captures = 0  # sizes captured

    @property
    def kind(self) -> str:
        return self.backend.kind

    def size_for(self, rows: int) -> int | None:
        return next((s for s in self.sizes if s >= rows), None)

    def run(self, ids: Sequence[int], pos: Sequence[int],
            decodes: Sequence[tuple[Sequence[int], int]], prefills: Sequence[PrefillChunk],
            future: tuple[list[int], list[int], Tensor] | None = None) -> Tensor | None:  # fmt: skip
        """The trunk's rows ``[T, hidden]`` of one step (``StepInput``'s fields), or
        None when it has more rows than the largest size (the caller runs it eagerly)."""
        t = len(ids)
        size = self.size_for(t)
        if size is None or t == 0:
            return None
        pieces = self.pieces.get(size) or self._capture(size)
        st = self._statics
        assert st is not None
        dev = st.ids.device
        self.cache.prepare(decodes, prefills)
        st.ids[:t].copy_(pinned(ints(ids), dev), non_blocking=True)
        st.pos[:t].copy_(pinned(ints(pos), dev), non_blocking=True)
        if future is not None:
            put_futures(st.ids[:t], future)  # in place: piece 0 reads these addresses
        q, k, v, o = st.q[:t], st.k[:t], st.v[:t], st.o[:t]
        pieces[0]()
        for i in range(self.model.config.n_layers):
            o.copy_(self.cache(i, q, k, v).reshape(t, -1))
            pieces[i + 1]()
        self.replays += 1
        return st.x[:t].clone()  # the next step writes the buffer again

    def info(self) -> dict[str, Any]:
        return {"kind": self.kind, "sizes": list(self.sizes), "captured": sorted(self.pieces),
                "replays": self.replays}  # fmt: skip

    # -- inside ---------------------------------------------------------------------------
    def _capture(self, size: int) -> list[Callable[[], None]]:
        model, ops = self.model, self.ops
        if self._statics is None:
            self._statics = _Statics(model, self.sizes[-1], self.cache.device, self.cache.dtype)
        st = self._statics
        ids, pos, x, o = st.ids[:size], st.pos[:size], st.x[:size], st.o[:size]
        q, k, v = st.q[:size], st.k[:size], st.v[:size]
        cos, sin = [c[:size] for c in st.cos], [s[:size] for s in st.sin]
        n_layers = model.config.n_layers
        # the first layer of each table used: its rows are the table's for the step
        first_of = {t: st.table_of.index(t) for t in set(st.table_of) if t is not None}

        def piece(i: int) -> Callable[[], None]:  # piece i, as the module's docstring says
            def run() -> None:
                if i == 0:
                    rows = model.embed_rows(ids)
                    step_rope = model.rope_rows(pos, rows.dtype)
                    for t, layer in first_of.items():
                        table = step_rope[layer]
                        assert table is not None
                        cos[t].copy_(table[0])
                        sin[t].copy_(table[1])
                else:
                    rows = model.attention_out(i - 1, x, o, ops)
                x.copy_(rows)
                if i < n_layers:
                    n = st.table_of[i]
                    rope = None if n is None else (cos[n], sin[n])
                    qi, ki, vi = model.attention_in(i, rows, rope, ops)
                    q.copy_(qi)
                    k.copy_(ki)
                    v.copy_(vi)

            return run

        pieces = [self.backend.capture(piece(i)) for i in range(n_layers + 1)]
        self.pieces[size] = pieces
        self.captures += 1
        return pieces
