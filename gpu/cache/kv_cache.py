"""The paged KV cache: a block manager with a prefix cache (``gpu/cache/blocks.py``,
re-exported here), and the attention backend.

``PagedKVCache`` holds the tensors (per layer ``[n_kv, num_blocks * block_size,
head_dim]``, kv head outermost; a q8_0 or q4_0 cache's rows are their bytes, ``head_dim /
32`` blocks of 34 or 18: ``kv_storage_dtype``) and implements the model's
``AttentionBackend``. A step lays tokens out as every decoding sequence first (one query
each) and then each prefill chunk (causal SDPA over its cached and new tokens). Decode attention on the CPU in fp32
runs in a C kernel that reads each sequence's blocks in place (``gpu/kernels/native.py``);
elsewhere, or without a C compiler, it is batched matmuls over a gather of whole blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from gpu.cache.blocks import BlockManager, NoFreeBlocks, PrefixHit, block_hash
from gpu.kernels.host import decode_slots, flat_tables, ints, to_device
from gpu.kernels.kv_element import KV_Q4, KV_Q8, Q8_BLOCK, KVElement, KVStore, kv_element
from gpu.kernels.native import load_kernels
from modelfile.config import ModelConfig
from modelfile.layer_spec import spec_of

__all__ = [
    "BlockManager",
    "NoFreeBlocks",
    "PagedKVCache",
    "PrefillChunk",
    "PrefixHit",
    "block_hash",
    "decode_bias",
    "decode_layout",
    "kv_dtype_refusal",
    "kv_storage_dtype",
    "kv_value_bytes",
]


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """One sequence's new tokens at positions ``start .. start+n-1`` in this step."""

    block_table: Sequence[int]
    start: int
    n: int


@dataclass(frozen=True, slots=True)
class _Layout:
    slots: Tensor  # [T] cache row of each new token
    n_decode: int
    # Each prompt chunk: (first row, rows, cache rows of all its keys, mask: None for
    # causal over its own keys, and the sliding-window layers' mask or None).
    prefills: tuple[tuple[int, int, Tensor, Tensor | None, Tensor | None], ...] = ()
    dec_rows: Tensor | None = None  # [n_kv * D * nb] rows of the flat per-layer cache to gather
    dec_len: int = 0  # L: keys per decode sequence (whole blocks)
    dec_bias: Tensor | None = None  # additive mask [n_kv * D, 1, L]: 0 or -inf past a context
    dec_bias_window: Tensor | None = None  # the same, keys beyond the window masked too
    dec_tables: Tensor | None = None  # paged kernels: int32 [D, nb] block tables (padded)
    dec_lens: Tensor | None = None  # paged kernels: int32 [D] keys per sequence
    # Every row as one query over its own keys (int32 tables [T, nb], lens [T]), prompt
    # tokens included, for gpu/backends/fused.py: a token's result then does not depend on
    # how its prompt was chunked or cached. None without the native kernels.
    row_queries: tuple[Tensor, Tensor] | None = None


def decode_layout(slots: Tensor, n: int, rows: Tensor, keys: int, bias: Tensor,
                  bias_window: Tensor | None = None, tables: Tensor | None = None,
                  lens: Tensor | None = None) -> _Layout:  # fmt: skip
    """A decode-only step over given tensors (what ``prepare`` builds for the gather +
    ``bmm`` path): ``n`` sequences, new-token ``slots [n]``, block ``rows [n_kv * n *
    nb]`` of ``keys`` keys each, additive ``bias [n_kv * n, 1, keys]`` (and
    ``bias_window``, the same for the sliding-window layers); or, for the Triton decode
    kernel, block ``tables [n, nb]`` and ``lens [n]`` (int32)."""
    return _Layout(slots, n, (), rows, keys, bias, bias_window, tables, lens)


def decode_bias(lens: Tensor, keys: int, n_kv: int, dtype: torch.dtype,
                window: int = 0) -> Tensor:  # fmt: skip
    """The additive mask ``[n_kv * D, 1, keys]`` of ``D`` one-query sequences of ``lens``
    keys each, laid out as gathered blocks: -inf past a context and, with a ``window``,
    more than ``window`` keys behind its query."""
    key = torch.arange(keys, device=lens.device)[None, :]
    masked = key >= lens[:, None]
    if window:
        masked |= key < lens[:, None] - window
    bias = torch.zeros(masked.shape, dtype=dtype, device=lens.device)
    bias.masked_fill_(masked, float("-inf"))
    return bias.expand(n_kv, *bias.shape).reshape(-1, 1, keys)


def capped_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float,
                     softcap: float) -> Tensor:  # fmt: skip
    """Attention with soft-capped scores (Gemma 2: ``cap * tanh(s / cap)`` before the mask
    and the softmax, which SDPA cannot do): ``q [B, H, Q, D]``, ``k``/``v [B, KV, L, D]``,
    bool ``mask`` broadcasting to ``[B, H, Q, L]``; softmax in fp32 as transformers'."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1, dtype=torch.float32).to(v.dtype), v)


def _zeros(shape: tuple[int, ...], device: torch.device | str | None, dtype: torch.dtype) -> Tensor:
    """Zeros; on the CPU in fp32 or fp16 from calloc (numpy), whose large blocks are fresh
    pages the kernel maps on first write: the cache's resident memory grows with the
    blocks sequences have used, not with its capacity (torch.zeros writes every page)."""
    if torch.device(device or "cpu").type == "cpu" and dtype in _NUMPY:
        return torch.from_numpy(np.zeros(shape, dtype=_NUMPY[dtype]))
    return torch.zeros(shape, device=device, dtype=dtype)


_NUMPY = {torch.float32: np.float32, torch.float16: np.float16, torch.uint8: np.uint8}


def kv_storage_dtype(
    choice: str, device: torch.device, dtype: torch.dtype, quantized: bool
) -> KVStore:
    """What the worker's paged cache stores K and V as (``--kv-cache-dtype``): ``auto`` is
    fp16 for quantized weights on the CPU (llama.cpp's f16 cache: half the memory a token
    of fp32, and next to the weights' own rounding a rounding of 2^-11 relative), else the
    model's ``dtype``; ``fp16`` / ``bf16`` / ``fp32`` name it. ``q8_0`` is llama.cpp's
    block_q8_0 per 32 values of a row (an fp16 scale, 32 int8: 1.0625 bytes a value),
    returned as ``KV_Q8`` (its element: the cache holds the blocks' bytes, uint8), read in
    place by the native kernels only (``kv_dtype_refusal``); ``q4_0`` likewise llama.cpp's
    block_q4_0 (an fp16 scale, 32 4-bit values: 0.5625 bytes a value), ``KV_Q4``. Every
    path attends to the stored values, read back as ``dtype``."""
    if choice == "auto":
        return torch.float16 if quantized and device.type == "cpu" else dtype
    return KV_DTYPES[choice]


KV_DTYPES: dict[str, KVStore] = {"fp16": torch.float16, "bf16": torch.bfloat16,
                                  "fp32": torch.float32, "q8_0": KV_Q8, "q4_0": KV_Q4}  # fmt: skip
MAX_BLOCKED_HEAD_DIM = 512  # paged_attention.c's kv_store_rows rotates a row in place
BLOCKED_KV = ("q8_0", "q4_0")  # --kv-cache-dtype's llama.cpp blocks: the native kernels'


def kv_value_bytes(store: KVStore) -> float:
    """Bytes one K or V value takes in a cache of ``store`` (``kv_storage_dtype``'s):
    the element's size, 34 / 32 for q8_0, 18 / 32 for q4_0."""
    return kv_element(store).value_bytes


def kv_dtype_refusal(choice: str, device: torch.device, head_dim: int) -> str | None:
    """Why ``--kv-cache-dtype choice`` cannot run here, in one line; None when it can. q8_0
    and q4_0 are written and read by the CPU's native kernels: under the fused trunk
    (quantized weights; ``gpu/backends/fused.py``) and on the torch path (fp32 weights,
    a model the fused trunk does not run) alike, and by nothing else."""
    if choice not in BLOCKED_KV:
        return None
    flag = f"--kv-cache-dtype {choice}"
    if device.type != "cpu":
        return f"{flag} is read by the CPU's native kernels: use --device cpu"
    if load_kernels() is None:
        return f"{flag} needs the native CPU kernels (a C compiler, LIFECYCLE_NATIVE on)"
    if head_dim % Q8_BLOCK:
        return f"{flag} stores blocks of 32 values: head_dim {head_dim} is not a multiple of 32"
    if head_dim > MAX_BLOCKED_HEAD_DIM:
        return (
            f"{flag} rotates rows of at most {MAX_BLOCKED_HEAD_DIM} values, not head_dim {head_dim}"
        )
    return None


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class PagedKVCache:
    """The paged ``AttentionBackend``: call ``prepare`` before each forward.

    K/V live per layer as ``[n_kv, rows, head_dim]`` (row = block * block_size + offset),
    so gathering whole blocks along dim 1 yields ``[n_kv * D, nb * block_size, head_dim]``
    for D decoding sequences with no further copy: the batch layout ``bmm`` wants.
    """

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        native: bool | None = None,
        scratch: bool = False,
        kv_dtype: KVStore | None = None,
        ops: Any = None,
    ) -> None:
        """``dtype``: what attention computes in; ``kv_dtype``: what K and V are stored as
        (None: ``dtype``; see ``kv_storage_dtype``). ``native``: decode attention through
        the C kernel (``gpu/kernels/native.py``); None: whenever it loads, the model is fp32
        on the CPU and the cache fp32 or fp16. ``scratch``: one more block,
        ``scratch_block``, that no sequence owns (padding rows of a captured decode step
        write there: ``gpu/backends/graphs.py``). ``ops``: ``gpu/kernels/triton_ops.py``
        (``--kernels triton``): decodes then read the cache in place, one kernel a layer,
        where the block and the head are powers of two (Triton's blocks are). A q8_0 or q4_0
        cache (``kv_dtype`` ``KV_Q8`` / ``KV_Q4``: their elements, both held as uint8
        bytes) is the native kernels' alone: fp32 on the CPU, head_dim a multiple of 32 up
        to 512, its rows rotated and quantized by their one writer (``kv_store``) on the
        fused trunk and the torch path alike."""
        self.scratch_block: int | None = num_blocks if scratch else None
        num_blocks += int(scratch)
        # What K and V hold, decided here once: the tensors' dtype cannot tell q8_0 from q4_0
        self.kv_element: KVElement = kv_element(kv_dtype or dtype)
        store = self.kv_element.dtype
        self.head_dim = config.head_dim
        width = self.kv_element.row_width(config.head_dim)
        shape = (config.n_layers, config.n_kv_heads, num_blocks * block_size, width)
        self.dtype = dtype
        self.k = _zeros(shape, device, store)
        self.v = _zeros(shape, device, store)
        # Per-layer views made once: indexing self.k[layer] every call is an extra op.
        self._k_layers = self.k.unbind(0)
        self._v_layers = self.v.unbind(0)
        self.n_kv_heads = config.n_kv_heads
        # What the layers' attention computes (modelfile/layer_spec.py): one scale, one cap and
        # one window width for every layer (``refusal`` turns a model away otherwise).
        spec = spec_of(config)
        first = spec.layers[0]
        self.scale = first.query_scale
        self.sdpa_scale = first.sdpa_scale
        self.softcap = first.attn_softcap
        self.windows = spec.windows
        self.window = spec.widest_window  # the masks' window; each layer's: ``windows``
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = self.k.device
        self._layout: _Layout | None = None
        self.ops = ops
        self.triton_decode = ops is not None and _pow2(block_size) and _pow2(config.head_dim)
        fp32_cpu = self.device.type == "cpu" and dtype == torch.float32
        use = native is not False and fp32_cpu and self.kv_element.kind is not None
        self.kernels = load_kernels() if use else None
        if native and self.kernels is None:
            raise RuntimeError("native kernels were asked for but are unavailable")
        if self.kv_element.blocked and (
            self.kernels is None or config.head_dim % Q8_BLOCK
            or config.head_dim > MAX_BLOCKED_HEAD_DIM
        ):  # fmt: skip
            raise ValueError(f"a {self.element} KV cache is read by the native kernels alone: "
                             "fp32 on the CPU, head_dim a multiple of 32 up to 512")  # fmt: skip
        # The C kernel on the CPU (told the element: uint8 rows are q8_0 or q4_0), the
        # Triton one with --kernels triton: the same call.
        self._paged: Callable[..., Tensor] | None = (
            partial(self.kernels.paged_attention, element=self.kv_element)
            if self.kernels is not None
            else ops.paged_decode if ops is not None else None
        )  # fmt: skip

    @property
    def element(self) -> str:
        """What K and V are stored as, by name: float16, bfloat16, float32, q8_0 or q4_0."""
        return self.kv_element.name

    def nbytes(self) -> int:
        """Bytes of the K and V tensors, the scratch block included."""
        return self.k.nbytes + self.v.nbytes

    def bytes_per_token(self) -> int:
        """K and V of every layer for one token, as stored."""
        n_layers, n_kv, _, width = self.k.shape
        return 2 * n_layers * n_kv * width * self.k.element_size()

    def _slots(self, table: Sequence[int], n: int) -> list[int]:
        """The cache rows of a sequence's first ``n`` positions."""
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(n)]

    def prepare(
        self, decodes: Sequence[tuple[Sequence[int], int]], prefills: Sequence[PrefillChunk]
    ) -> None:
        """Declare the step: ``decodes`` as (block_table, context length incl. the new token)."""
        dev, n = self.device, len(decodes)
        slots = decode_slots(decodes, self.block_size)
        rows = bias = bias_window = tables = lens = row_queries = None
        keys = 0
        if self.kernels is not None:
            # The native kernel reads each row's table and key count, decodes first.
            row_queries = self._row_queries(decodes, prefills)
            if decodes and row_queries is not None:
                tables, lens = row_queries[0][:n], row_queries[1][:n]
        elif decodes and self.triton_decode:
            dec = self._row_queries(decodes, [])
            assert dec is not None
            tables, lens = to_device(dec[0], dev), to_device(dec[1], dev)
        elif decodes:
            rows, keys, bias, bias_window = self._gather_layout(decodes)
        pre, row = [], n
        for c in prefills:
            every = self._slots(c.block_table, c.start + c.n)
            slots.extend(every[c.start :])
            index = ints(every, device=dev)
            key = torch.arange(c.start + c.n, device=dev)[None, :]
            query = (c.start + torch.arange(c.n, device=dev))[:, None]
            mask = key <= query if c.start else None
            # The window's mask is over every key of the sequence, cached or new.
            window = (key <= query) & (key > query - self.window) if self.window else None
            pre.append((row, c.n, index, mask, window))
            row += c.n
        self._layout = _Layout(ints(slots, device=dev), n, tuple(pre), rows, keys,
                               bias, bias_window, tables, lens, row_queries)  # fmt: skip

    def _gather_layout(
        self, decodes: Sequence[tuple[Sequence[int], int]]
    ) -> tuple[Tensor, int, Tensor, Tensor | None]:
        """The gather + ``bmm`` decode's layout: block rows, keys per sequence, the bias
        (and the sliding-window layers' bias, where the model has them)."""
        dev, n_kv = self.device, self.n_kv_heads
        # Keys are whole blocks, each table cut or padded (with block 0) to the longest
        # context's: the gather is then already contiguous for bmm, where a sliced view
        # measured 4x slower. The bias masks every key past a context, padding included.
        nb = -(-max(ctx for _, ctx in decodes) // self.block_size)
        blocks = ints(flat_tables((t for t, _ in decodes), nb, 0), device=dev)
        # Rows of the cache seen as [n_kv * num_blocks, block_size * head_dim]: a
        # dim-0 gather of whole contiguous rows is a memcpy each (2x faster than the
        # same gather along dim 1), and comes out in (kv head, sequence, block) order.
        rows = (torch.arange(n_kv, device=dev)[:, None] * self.num_blocks + blocks).reshape(-1)
        keys = nb * self.block_size
        lens = ints([ctx for _, ctx in decodes], device=dev)
        bias = decode_bias(lens, keys, n_kv, self.dtype)
        window = decode_bias(lens, keys, n_kv, self.dtype, self.window) if self.window else None
        return rows, keys, bias, window

    def _row_queries(
        self, decodes: Sequence[tuple[Sequence[int], int]], prefills: Sequence[PrefillChunk]
    ) -> tuple[Tensor, Tensor] | None:
        """Each row's table and key count: a decode reads its context, a prompt token the
        positions up to its own. A chunk's rows share one table (an expanded view, copied
        once by the concatenation)."""
        keys = [ctx for _, ctx in decodes] + [c.start + c.n for c in prefills]
        if not keys:
            return None
        nb = -(-max(keys) // self.block_size)
        tables: list[Tensor] = []
        lens: list[Tensor] = []
        if decodes:
            flat = flat_tables((t for t, _ in decodes), nb, 0)
            tables.append(ints(flat, torch.int32).view(len(decodes), nb))
            lens.append(ints(keys[: len(decodes)], torch.int32))
        for c in prefills:
            tables.append(ints(flat_tables([c.block_table], nb, 0), torch.int32).expand(c.n, nb))
            lens.append(torch.arange(c.start + 1, c.start + c.n + 1, dtype=torch.int32))
        return torch.cat(tables), torch.cat(lens)

    def row_queries(self) -> tuple[Tensor, Tensor, Tensor] | None:
        """``(slots, tables, lens)`` of the declared step when the native kernel can attend
        every row as one query (decodes and prompt tokens alike): what ``gpu/backends/fused.py``
        takes; None without the native kernels."""
        lay = self._layout
        if lay is None or lay.row_queries is None:
            return None
        return lay.slots, *lay.row_queries

    def use_layout(self, layout: _Layout) -> None:
        """Declare the step with a layout built elsewhere (``decode_layout``: a captured
        step's static buffers) instead of ``prepare``."""
        self._layout = layout

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        lay = self._layout
        if lay is None:
            raise RuntimeError("PagedKVCache.prepare() must be called before forward()")
        kc, vc = self._k_layers[layer], self._v_layers[layer]
        # Stored as the cache's element (rounded when it is narrower; q8_0 / q4_0 rows
        # rotated and quantized by the kernels' one writer), and every path attends to
        # the stored values (``.to`` of the same dtype is no copy).
        if self.kv_element.blocked:
            k, v = self._store_blocks(kc, k, lay.slots), self._store_blocks(vc, v, lay.slots)
        else:
            k, v = k.to(kc.dtype), v.to(vc.dtype)
            kc.index_copy_(1, lay.slots, k.transpose(0, 1))
            vc.index_copy_(1, lay.slots, v.transpose(0, 1))
        k, v = k.to(self.dtype), v.to(self.dtype)
        window = self.windows[layer]
        outs = []
        d = lay.n_decode
        if lay.dec_tables is not None and lay.dec_lens is not None and self._paged is not None:
            outs.append(self._paged(q[:d], kc, vc, lay.dec_tables, lay.dec_lens, self.block_size,
                                    self.scale, window, self.softcap))  # fmt: skip
        elif lay.dec_rows is not None and lay.dec_bias is not None:
            bias = lay.dec_bias_window if window else lay.dec_bias
            assert bias is not None
            outs.append(self._decode(kc, vc, q[:d], lay.dec_rows, bias))
        for row, n, index, causal, windowed in lay.prefills:
            mask = windowed if window else causal
            if mask is None or mask.shape[1] == n:  # nothing cached before the chunk: its
                keys, vals = k[row : row + n].transpose(0, 1), v[row : row + n].transpose(0, 1)
            else:  # own k/v are all the keys; else every key of the sequence, gathered
                keys, vals = (
                    self._values(kc.index_select(1, index)),
                    self._values(vc.index_select(1, index)),
                )
            outs.append(self._chunk(q[row : row + n], keys, vals, mask))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _store_blocks(self, cache: Tensor, x: Tensor, slots: Tensor) -> Tensor:
        """Rows ``x [T, n_kv, hd]`` written into a q8_0 or q4_0 layer ``cache`` at
        ``slots``; returns the values they now stand for (what attention reads)."""
        assert self.kernels is not None  # a blocked cache is built with them only
        b = self.kernels.kv_store(x.to(torch.float32), self.kv_element)
        cache.index_copy_(1, slots, b.transpose(0, 1))
        return self.kernels.kv_values(b, self.kv_element, self.head_dim)

    def _values(self, rows: Tensor) -> Tensor:
        """Cache rows gathered as stored, as the values attention reads, in ``dtype``."""
        if self.kv_element.blocked:
            assert self.kernels is not None
            return self.kernels.kv_values(rows, self.kv_element, self.head_dim).to(self.dtype)
        return rows.to(self.dtype)

    def _chunk(self, q: Tensor, keys: Tensor, vals: Tensor, mask: Tensor | None) -> Tensor:
        """One prompt chunk's attention: its queries ``[n, heads, hd]`` over ``keys`` /
        ``vals`` ``[kv, L, hd]`` under ``mask`` (None: causal over its own keys)."""
        n = q.shape[0]
        qh, kh, vh = q.transpose(0, 1).unsqueeze(0), keys.unsqueeze(0), vals.unsqueeze(0)
        if self.softcap:  # SDPA has no cap: the scores written out
            if mask is None:
                key = torch.arange(n, device=q.device)
                mask = key[None, :] <= key[:, None]
            o = capped_attention(qh, kh, vh, mask, self.scale, self.softcap)
        else:
            causal = mask is None and n > 1
            o = F.scaled_dot_product_attention(
                qh, kh, vh, attn_mask=mask, is_causal=causal, scale=self.sdpa_scale, enable_gqa=True
            )
        return o[0].transpose(0, 1)

    def _decode(self, kc: Tensor, vc: Tensor, q: Tensor, rows: Tensor, bias: Tensor) -> Tensor:
        """One query per sequence, GQA folded into ``baddbmm``/``bmm``.

        The G query heads sharing a kv head are G rows against its keys (no kv
        expansion). Batch index is (kv head, sequence), matching the block gather. On the
        2-core CPU this replaced SDPA's flash kernel over a row gather plus transposes.
        """
        d, h, hd = q.shape
        kv, flat = self.n_kv_heads, (self.n_kv_heads * self.num_blocks, self.block_size * hd)
        shape = (kv * d, -1, hd)
        keys = kc.view(flat).index_select(0, rows).view(shape).to(q.dtype)
        vals = vc.view(flat).index_select(0, rows).view(shape).to(q.dtype)
        qg = q.view(d, kv, h // kv, hd).transpose(0, 1).reshape(kv * d, h // kv, hd)
        if self.softcap:  # the cap goes between the product and the mask
            scores = torch.bmm(qg, keys.transpose(1, 2)) * self.scale
            scores = torch.tanh(scores / self.softcap) * self.softcap + bias
        else:
            scores = torch.baddbmm(bias, qg, keys.transpose(1, 2), alpha=self.scale)
        probs = scores.softmax(-1, dtype=torch.float32).to(vals.dtype)  # fp32 as HF does
        out = torch.bmm(probs, vals)
        return out.view(kv, d, h // kv, hd).transpose(0, 1).reshape(d, h, hd)

    def copy_rows(self, src: int, dst: int, n: int) -> None:
        """Copy the first ``n`` rows of one block's KV into another, in every layer
        (copy-on-write: ``StepInput.copies``, the runner's before a step)."""
        s, d = src * self.block_size, dst * self.block_size
        self.k[:, :, d : d + n] = self.k[:, :, s : s + n]
        self.v[:, :, d : d + n] = self.v[:, :, s : s + n]

    def write_block(self, block: int, k: Tensor, v: Tensor) -> None:
        """Write one whole block's K and V rows (``[n_layers, n_kv, block_size,
        head_dim]`` each, the stored element: a block read back from disk)."""
        s = block * self.block_size
        self.k[:, :, s : s + self.block_size] = k
        self.v[:, :, s : s + self.block_size] = v
