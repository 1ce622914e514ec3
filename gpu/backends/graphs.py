"""Decode steps replayed from captured graphs: CUDA graphs on a GPU, the same
static-buffer step run eagerly elsewhere (so the CPU tests the logic a GPU replays).

A pure-decode step (every sequence adds one token, no prefill, no pooling, no hidden
states or prompt logprobs) is padded up to a captured shape ``(B, nb)``: ``B`` the next
batch size in ``batch_sizes`` at or above the step's sequences, ``nb`` the next power
of two at or above the longest context's blocks. Each shape has its graph, captured the
first time it is needed (a CUDA graph fixes every tensor's shape and address), over
static buffers the step writes in place (``_Buffers``): its ids and positions, the cache
slots of its new K/V, and the block rows and additive masks of the gather + ``bmm``
decode of ``PagedKVCache``, which needs no host synchronisation; the LM head writes
every row's logits into one too, read back as ``logits[:D]``.

Padding rows point at a scratch block that no sequence owns (``PagedKVCache`` is built
with one extra block for it: ``scratch_block``), with a context of one key, so they
compute finite values that nobody reads. Graphs share one memory pool, captured
largest first when warmed up together, and their static buffers are views of one set
made at the largest shape (a step's logits are read before the next replay). How a
shape is captured is its ``GraphBackend``'s: ``EagerBackend`` or ``CudaBackend``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from gpu.cache.kv_cache import PagedKVCache, decode_bias, decode_layout
from gpu.kernels.host import decode_slots, flat_tables, ints, pinned, put_futures
from wire.worker_options import GRAPH_MODES

__all__ = [
    "DEFAULT_BATCH_SIZES",
    "CudaBackend",
    "EagerBackend",
    "GraphBackend",
    "StepGraphs",
    "graph_backend",
    "pad_shape",
]

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class GraphBackend(Protocol):
    kind: str

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]: ...


class EagerBackend:
    """No capture: the replay runs ``fn`` (the CPU, and a GPU with graphs turned off)."""

    kind = "eager"

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        return fn


class CudaBackend:
    """``torch.cuda.CUDAGraph`` per capture, all in one memory pool: ``fn`` warmed up on a
    side stream, captured under ``torch.cuda.graph``, replayed."""

    kind = "cuda_graph"

    def __init__(self, device: torch.device, warmup_runs: int = 2) -> None:
        self.device = device
        self.warmup_runs = warmup_runs
        self.pool: Any = torch.cuda.graph_pool_handle()
        # The pool lives while a graph captured into it does: a backend that outlives
        # its graphs (one per StepGraphs) would capture into a freed pool.
        self.graphs: list[Any] = []

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # allocator and lazy inits settle off the graph
            for _ in range(self.warmup_runs):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            fn()
        self.graphs.append(graph)
        return graph.replay


def graph_backend(mode: str, device: torch.device) -> GraphBackend | None:
    """``--decode-graphs``: ``auto`` is CUDA graphs on a CUDA device and off elsewhere;
    ``on`` insists on CUDA graphs; ``eager`` runs the static-buffer step without capture
    (any device: what the CPU tests check); ``off`` is the plain step."""
    if mode not in GRAPH_MODES:
        raise ValueError(f"decode graphs must be one of {', '.join(GRAPH_MODES)}, got {mode!r}")
    if mode == "off" or (mode == "auto" and device.type != "cuda"):
        return None
    if mode == "eager":
        return EagerBackend()
    if device.type != "cuda":
        raise ValueError("CUDA graphs need a CUDA device (use --decode-graphs eager or off)")
    return CudaBackend(device)


def pad_shape(n: int, max_blocks: int, batch_sizes: Sequence[int], block_size: int,
              ctx: int) -> tuple[int, int] | None:  # fmt: skip
    """The captured shape ``(B, nb)`` for ``n`` sequences whose longest context is
    ``ctx`` tokens; None when ``n`` is over the largest batch size."""
    b = next((s for s in batch_sizes if s >= n), None)
    if b is None:
        return None
    need = max(1, -(-ctx // block_size))
    nb = 1 << (need - 1).bit_length()  # the next power of two
    return b, min(nb, max_blocks) if need <= max_blocks else need


class _Buffers:
    """The static buffers, once, at the largest shape: every captured shape reads views
    of their heads (the same addresses each replay), so shapes cost no memory of their
    own beyond the graph pool, and a step's result is read before the next replay."""

    def __init__(self, cache: PagedKVCache, max_b: int, max_nb: int, vocab: int) -> None:
        dev, kv, bs = cache.device, cache.n_kv_heads, cache.block_size
        self.ids = torch.zeros(max_b, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(max_b, dtype=torch.int64, device=dev)
        self.slots = torch.zeros(max_b, dtype=torch.int64, device=dev)
        self.rows = torch.zeros(kv * max_b * max_nb, dtype=torch.int64, device=dev)
        self.bias = torch.zeros(kv * max_b * max_nb * bs, dtype=cache.dtype, device=dev)
        # the sliding-window layers' mask, when the model has them
        self.bias_window = torch.zeros_like(self.bias) if cache.window else None
        self.logits = torch.zeros(max_b * vocab, dtype=torch.float32, device=dev)
        # The Triton decode kernel's block tables and lengths (``--kernels triton``)
        triton = cache.triton_decode
        self.tables = torch.zeros(max_b * max_nb, dtype=torch.int32, device=dev) if triton else None
        self.lens = torch.ones(max_b, dtype=torch.int32, device=dev) if triton else None


class _Shape:
    """One captured shape: views of the shared buffers, and its replay."""

    def __init__(self, b: int, nb: int, cache: PagedKVCache, vocab: int, buf: _Buffers) -> None:
        kv, bs = cache.n_kv_heads, cache.block_size
        self.b, self.nb = b, nb
        self.ids, self.pos, self.slots = buf.ids[:b], buf.pos[:b], buf.slots[:b]
        self.rows = buf.rows[: kv * b * nb]
        bias_shape = (kv * b, 1, nb * bs)
        self.bias = buf.bias[: kv * b * nb * bs].view(bias_shape)
        window = buf.bias_window
        self.bias_window = None if window is None else window[: kv * b * nb * bs].view(bias_shape)
        self.logits = buf.logits[: b * vocab].view(b, vocab)
        self.tables = None if buf.tables is None else buf.tables[: b * nb].view(b, nb)
        self.lens = None if buf.lens is None else buf.lens[:b]
        self.layout = decode_layout(self.slots, b, self.rows, nb * bs, self.bias,
                                    self.bias_window, self.tables, self.lens)  # fmt: skip
        self.replay: Callable[[], None] | None = None


class StepGraphs:
    """Pure-decode steps through captured shapes; ``run`` returns logits ``[D, vocab]``.
    ``model``: a ``gpu.model.decoder.Llama``; ``trunk``: its torch path over ``cache``
    (``gpu.runtime.runner.trunk_for``)."""

    def __init__(self, model: Any, cache: PagedKVCache, trunk: Callable[[Tensor, Tensor], Tensor],
                 backend: GraphBackend, max_batch: int, max_context: int,
                 batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES, max_graphs: int = 128,
                 ) -> None:  # fmt: skip
        if cache.scratch_block is None:
            raise ValueError("StepGraphs needs a PagedKVCache with a scratch block")
        self.model, self.cache, self.trunk, self.backend = model, cache, trunk, backend
        sizes = sorted({s for s in batch_sizes if s < max_batch} | {max_batch})
        self.batch_sizes = tuple(sizes)
        self.max_blocks = -(-max_context // cache.block_size)
        self.max_graphs = max_graphs
        self.vocab = (
            model.config.vocab_size
        )  # the head's rows (modelfile/check.py holds the file to it)
        self.shapes: dict[tuple[int, int], _Shape] = {}
        self._buffers: _Buffers | None = None  # made with the first capture
        self.replays = 0
        self.captures = 0

    @property
    def kind(self) -> str:
        return self.backend.kind

    def shape_for(self, decodes: Sequence[tuple[Sequence[int], int]]) -> tuple[int, int] | None:
        if not decodes:
            return None
        ctx = max(c for _, c in decodes)
        shape = pad_shape(len(decodes), self.max_blocks, self.batch_sizes,
                          self.cache.block_size, ctx)  # fmt: skip
        if shape is None or shape[1] > self.max_blocks:
            return None
        if shape not in self.shapes and len(self.shapes) >= self.max_graphs:
            return None  # the budget of captures is spent: this step runs eagerly
        return shape

    def run(self, ids: Sequence[int], pos: Sequence[int],
            decodes: Sequence[tuple[Sequence[int], int]],
            future: tuple[list[int], list[int], Tensor] | None = None) -> Tensor | None:  # fmt: skip
        """Logits ``[len(decodes), vocab]`` for one pure-decode step, or None when no
        captured shape fits it (the caller runs the step eagerly). ``future``: rows whose
        input the previous step sampled on the device (``StepInput.future``)."""
        key = self.shape_for(decodes)
        if key is None:
            return None
        shape = self.shapes.get(key) or self._capture(*key)
        self._fill(shape, ids, pos, decodes)
        if future is not None:
            put_futures(shape.ids, future)  # in place: the graph reads these addresses
        assert shape.replay is not None
        shape.replay()
        self.replays += 1
        return shape.logits[: len(decodes)]

    def warm_up(self, shapes: Sequence[tuple[int, int]]) -> None:
        """Capture these shapes now (largest first: the pool then fits the rest)."""
        for b, nb in sorted(shapes, reverse=True):
            if (b, nb) not in self.shapes:
                self._capture(b, nb)

    # -- inside ---------------------------------------------------------------------------
    def _capture(self, b: int, nb: int) -> _Shape:
        if self._buffers is None:
            self._buffers = _Buffers(self.cache, self.batch_sizes[-1], self.max_blocks, self.vocab)
        shape = _Shape(b, nb, self.cache, self.vocab, self._buffers)
        self._fill(shape, [0] * b, [0] * b, [])  # every row a padding row while capturing

        def step() -> None:
            self.cache.use_layout(shape.layout)
            x = self.trunk(shape.ids, shape.pos)
            shape.logits.copy_(self.model.logits(x))

        shape.replay = self.backend.capture(step)
        self.shapes[(b, nb)] = shape
        self.captures += 1
        return shape

    def _fill(self, shape: _Shape, ids: Sequence[int], pos: Sequence[int],
              decodes: Sequence[tuple[Sequence[int], int]]) -> None:  # fmt: skip
        """Write one step into the shape's buffers in place (host to device copies, no
        new device tensors: the graph reads these addresses)."""
        b, nb, bs = shape.b, shape.nb, self.cache.block_size
        kv, scratch = self.cache.n_kv_heads, self.cache.scratch_block
        assert scratch is not None
        d = len(decodes)
        pad = b - d
        # Every table cut or padded (with the scratch block) to nb: one flat list and one
        # conversion (gpu/kernels/host.py).
        flat = flat_tables((table for table, _ in decodes), nb, scratch)
        blocks = ints(flat + [scratch] * (nb * pad))
        lens = ints([*(ctx for _, ctx in decodes), *[1] * pad])
        rows = (torch.arange(kv)[:, None] * self.cache.num_blocks + blocks[None, :]).reshape(-1)
        dev = shape.ids.device

        def put(dst: Tensor, src: Tensor) -> None:
            # From pinned memory, so the copy does not wait for the step before (host.py).
            dst.copy_(pinned(src, dev), non_blocking=True)

        put(shape.ids, ints([*ids[:d], *[0] * pad]))
        put(shape.pos, ints([*pos[:d], *[0] * pad]))
        put(shape.slots, ints(decode_slots(decodes, bs) + [scratch * bs] * pad))
        put(shape.rows, rows)
        put(shape.bias, decode_bias(lens, nb * bs, kv, shape.bias.dtype).view(shape.bias.shape))
        if shape.tables is not None and shape.lens is not None:
            put(shape.tables, blocks.view(b, nb).to(torch.int32))
            put(shape.lens, lens.to(torch.int32))
        if shape.bias_window is not None:
            window = decode_bias(lens, nb * bs, kv, shape.bias.dtype, self.cache.window)
            put(shape.bias_window, window.view(shape.bias.shape))

    def info(self) -> dict[str, Any]:
        return {"kind": self.kind, "batch_sizes": list(self.batch_sizes),
                "captured": sorted(self.shapes), "captures": self.captures,
                "replays": self.replays}  # fmt: skip
