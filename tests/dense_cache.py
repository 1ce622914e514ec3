"""A contiguous per-sequence KV cache: the simple ``AttentionBackend``, kept as an oracle.

Nothing that serves or generates uses it: the worker and ``python -m gpu.worker.generate`` both
run the engine on the paged cache (``gpu/cache/kv_cache.py``). It stays as the independent
"run alone" implementation the paged path is checked against (``tests/test_worker_engine.py``:
logits of both backends, and engine tokens against greedy runs on this one;
``tests/test_model.py`` and ``tests/test_model_reference.py`` check the model itself
through it). It shares no code with the paged cache: one contiguous slot per sequence,
its own masks, no block tables, gathers or C kernel, so a bug in any of those cannot
hide in both. See docs/worker.md.

Each sequence slot owns ``max_len`` rows per layer, stored ``[layer, slot, kv_head, pos,
head_dim]`` so a slot's keys are already in the ``[B, H, L, D]`` layout SDPA wants (a
view, not a copy, for one sequence or a run of adjacent slots).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from modelfile.config import ModelConfig

__all__ = ["DenseKVCache"]


@dataclass(frozen=True, slots=True)
class _StepLayout:
    """Everything ``__call__`` needs, computed once per step in ``prepare``."""

    slot_t: Tensor  # [T] slot of each token
    pos_t: Tensor  # [T] position of each token in its sequence
    slots: Tensor | slice  # the B slots to read (a slice when adjacent: no gather)
    kv_len: int  # keys to read per slot (longest sequence after this step)
    mask: Tensor | None  # bool [B, 1, Q, kv_len]; None when plain attention is exact
    is_causal: bool  # single fresh sequence: SDPA's own causal mask
    q_index: Tensor | None  # [T] row of each token in the padded [B*Q] query block
    q_len: int  # Q: padded queries per sequence
    decode_bias: Tensor | None  # fp additive mask [B*kv_heads, 1, kv_len] when Q == 1
    # The same for the sliding-window layers (None when the model has none): keys more
    # than the window behind their query are masked too.
    window_mask: Tensor | None = None
    window_bias: Tensor | None = None


class DenseKVCache:
    """``max_seqs`` slots of ``max_len`` positions; slot id == sequence id."""

    def __init__(
        self,
        config: ModelConfig,
        max_seqs: int,
        max_len: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        """``kv_dtype``: K and V rounded through it as they are stored (fp16: what the
        paged cache keeps on the CPU with the native kernels, ``kv_storage_dtype``), to
        compare with that cache; None keeps them in ``dtype``."""
        if max_len > config.context_length:
            # The model's RoPE table has context_length rows: refuse here, not mid-forward.
            raise ValueError(f"max_len {max_len} exceeds the model context {config.context_length}")
        shape = (config.n_layers, max_seqs, config.n_kv_heads, max_len, config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.kv_dtype = kv_dtype
        # Per-layer views made once: indexing self.k[layer] every call is two extra ops.
        self._k_layers = self.k.unbind(0)
        self._v_layers = self.v.unbind(0)
        self.n_kv_heads = config.n_kv_heads
        self.scale = config.query_scale
        self.sdpa_scale = config.attn_scale  # None: SDPA's own 1/sqrt(head_dim), the same
        self.softcap = config.attn_softcap
        self.window = config.sliding_window
        self.windowed = [config.window(i) > 0 for i in range(config.n_layers)]
        self.max_seqs = max_seqs
        self.max_len = max_len
        self.device = self.k.device
        self._lens = [0] * max_seqs
        self._step: _StepLayout | None = None

    def reset(self, seq_id: int) -> None:
        self._lens[seq_id] = 0

    def set_length(self, seq_id: int, length: int) -> None:
        """Declare positions ``[0, length)`` filled without computing them (benchmarks:
        attention cost does not depend on what the rows hold)."""
        if not 0 <= length <= self.max_len:
            raise ValueError(f"length {length} outside [0, {self.max_len}]")
        self._lens[seq_id] = length

    def length(self, seq_id: int) -> int:
        """Tokens held, including those of a prepared step."""
        return self._lens[seq_id]

    def positions(self, seq_ids: list[int], new_lens: list[int]) -> Tensor:
        """Positions of a step's tokens, to call *before* ``prepare`` (which advances)."""
        pos = [
            p
            for s, n in zip(seq_ids, new_lens, strict=True)
            for p in range(self._lens[s], self._lens[s] + n)
        ]
        return torch.tensor(pos, dtype=torch.int64, device=self.device)

    def prepare(self, seq_ids: list[int], new_lens: list[int]) -> None:
        """Declare the next forward's layout and reserve its positions.

        Tokens in input order are ``new_lens[0]`` tokens of ``seq_ids[0]``, then
        ``new_lens[1]`` of ``seq_ids[1]``, ... each appended after what that sequence holds.
        """
        if len(seq_ids) != len(new_lens) or not seq_ids or len(set(seq_ids)) != len(seq_ids):
            raise ValueError("prepare needs distinct seq_ids, one new length each")
        starts = [self._lens[s] for s in seq_ids]
        totals = [s + n for s, n in zip(starts, new_lens, strict=True)]
        if max(totals) > self.max_len or min(new_lens) < 1:
            raise ValueError(f"step does not fit: totals {totals}, max_len {self.max_len}")
        self._step = self._layout(seq_ids, new_lens, starts, totals)
        for s, total in zip(seq_ids, totals, strict=True):
            self._lens[s] = total

    def _layout(
        self, seq_ids: list[int], new_lens: list[int], starts: list[int], totals: list[int]
    ) -> _StepLayout:
        dev = self.device
        slot_t = torch.tensor(
            [s for s, n in zip(seq_ids, new_lens, strict=True) for _ in range(n)],
            dtype=torch.int64,
            device=dev,
        )
        pos_t = torch.tensor(
            [p for st, n in zip(starts, new_lens, strict=True) for p in range(st, st + n)],
            dtype=torch.int64,
            device=dev,
        )
        b, kv_len, q_len = len(seq_ids), max(totals), max(new_lens)
        adjacent = seq_ids == list(range(seq_ids[0], seq_ids[0] + b))
        slots: Tensor | slice = (
            slice(seq_ids[0], seq_ids[0] + b)
            if adjacent
            else torch.tensor(seq_ids, dtype=torch.int64, device=dev)
        )
        is_causal = b == 1 and starts[0] == 0 and q_len > 1
        q_index = None
        if q_len > 1 and b > 1:
            q_index = torch.tensor(
                [i * q_len + j for i, n in enumerate(new_lens) for j in range(n)],
                dtype=torch.int64,
                device=dev,
            )
        needs_mask = (q_len > 1 and not is_causal) or len(set(totals)) > 1
        mask = self._mask(starts, new_lens, kv_len, q_len, 0) if needs_mask else None
        bias = self._bias(mask, b, kv_len) if q_len == 1 else None
        window_mask = window_bias = None
        if self.window:
            window_mask = self._mask(starts, new_lens, kv_len, q_len, self.window)
            window_bias = self._bias(window_mask, b, kv_len) if q_len == 1 else None
        return _StepLayout(slot_t, pos_t, slots, kv_len, mask, is_causal, q_index, q_len, bias,
                           window_mask, window_bias)  # fmt: skip

    def _mask(self, starts: list[int], new_lens: list[int], kv_len: int, q_len: int,
              window: int) -> Tensor:  # fmt: skip
        """bool ``[B, 1, Q, kv_len]``: causal within each sequence and, with a ``window``,
        only the ``window`` latest keys up to each query."""
        dev = self.device
        key = torch.arange(kv_len, device=dev)
        qpos = torch.tensor(starts, device=dev)[:, None] + torch.arange(q_len, device=dev)
        mask = key[None, None, :] <= qpos[:, :, None]  # [B, Q, L] causal within the sequence
        if window:
            mask &= key[None, None, :] > qpos[:, :, None] - window
        # Padded query rows (j >= new_len) attend to key 0 only, so no row is all -inf.
        pad = (
            torch.arange(q_len, device=dev)[None, :] >= torch.tensor(new_lens, device=dev)[:, None]
        )
        mask[pad] = key == 0
        return mask.unsqueeze(1)

    def _bias(self, mask: Tensor | None, b: int, kv_len: int) -> Tensor:
        """The additive ``[B * kv_heads, 1, kv_len]`` form of a one-query step's mask."""
        bias = torch.zeros(b, 1, kv_len, device=self.device, dtype=self.k.dtype)
        if mask is not None:
            bias.masked_fill_(~mask[:, 0], float("-inf"))
        return bias.repeat_interleave(self.n_kv_heads, dim=0)

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        step = self._step
        if step is None:
            raise RuntimeError("DenseKVCache.prepare() must be called before forward()")
        kc, vc = self._k_layers[layer], self._v_layers[layer]
        if self.kv_dtype is not None:
            k, v = k.to(self.kv_dtype).to(kc.dtype), v.to(self.kv_dtype).to(vc.dtype)
        kc[step.slot_t, :, step.pos_t] = k
        vc[step.slot_t, :, step.pos_t] = v
        keys = kc[step.slots, :, : step.kv_len]
        values = vc[step.slots, :, : step.kv_len]
        b = keys.shape[0]
        mask, is_causal, bias = step.mask, step.is_causal, step.decode_bias
        if self.windowed[layer]:
            mask, is_causal, bias = step.window_mask, False, step.window_bias
        if bias is not None:
            return self._decode_attention(q, keys, values, bias)
        if step.q_index is None:
            # One query per sequence, or a single sequence: [T, H, D] reshapes directly.
            qh = q.view(b, -1, q.shape[1], q.shape[2]).transpose(1, 2)
        else:
            padded = q.new_zeros(b * step.q_len, q.shape[1], q.shape[2])
            padded[step.q_index] = q
            qh = padded.view(b, step.q_len, q.shape[1], q.shape[2]).transpose(1, 2)
        if self.softcap:
            out = self._capped_attention(qh, keys, values, mask)
        else:
            out = F.scaled_dot_product_attention(
                qh, keys, values, attn_mask=mask, is_causal=is_causal, scale=self.sdpa_scale,
                enable_gqa=True,
            )  # fmt: skip
        out = out.transpose(1, 2).reshape(-1, q.shape[1], q.shape[2])
        return out if step.q_index is None else out[step.q_index]

    def _capped_attention(self, qh: Tensor, keys: Tensor, values: Tensor,
                          mask: Tensor | None) -> Tensor:  # fmt: skip
        """Soft-capped scores (Gemma 2), which SDPA cannot compute: ``qh [B, H, Q, D]``,
        keys/values ``[B, KV, L, D]``; ``mask`` None is plain causal (one fresh sequence)."""
        if mask is None:
            q_len, kv_len = qh.shape[2], keys.shape[2]
            pos = torch.arange(kv_len, device=qh.device)
            mask = pos[None, :] <= pos[kv_len - q_len :, None]
        rep = qh.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1)
        scores = torch.matmul(qh, keys.transpose(-1, -2)) * self.scale
        scores = torch.tanh(scores / self.softcap) * self.softcap
        scores = scores.masked_fill(~mask, float("-inf"))
        return torch.matmul(scores.softmax(-1, dtype=torch.float32).to(values.dtype), values)

    def _decode_attention(self, q: Tensor, keys: Tensor, values: Tensor, bias: Tensor) -> Tensor:
        """One query per sequence: GQA folded into batched matmuls.

        The G query heads sharing a kv head become G rows against that head's keys, so
        no kv expansion is needed. Measured on the 2-core CPU at batch 64 x 129 keys: 1.4 ms
        against 12 ms for SDPA's flash kernel, whose per-call threading also stalls under
        CPU contention; the 1-query case gains nothing from flash tiling anyway.
        """
        b, kvh, length, d = keys.shape
        qg = q.reshape(b * kvh, -1, d)
        k_t = keys.reshape(b * kvh, length, d).transpose(1, 2)
        if self.softcap:  # the cap goes between the product and the mask
            scores = torch.bmm(qg, k_t) * self.scale
            scores = torch.tanh(scores / self.softcap) * self.softcap + bias
        else:
            scores = torch.baddbmm(bias, qg, k_t, alpha=self.scale)
        probs = scores.softmax(-1, dtype=torch.float32).to(values.dtype)  # fp32 as HF does
        out = torch.bmm(probs, values.reshape(b * kvh, length, d))
        return out.view(b, -1, d)
