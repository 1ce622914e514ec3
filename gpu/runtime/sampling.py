"""The batched sampler, and the worker's reading of a SUBMIT entry's two maps.

What a request's sampling means (its fields, defaults, the greedy rule, the wire map)
is defined once, in ``wire/sampling.py``; this module only applies it. Penalties follow
vLLM/SGLang (frequency/presence over output tokens, repetition over prompt + output).
Seeded requests draw from their own ``torch.Generator``, one fixed-size draw per step,
so a seed gives the same tokens whatever shares the batch. Logprobs are of the
distribution sampled from (after penalties, bias and temperature, before
top-k/top-p/min-p), as SGLang reports them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from gpu.kernels.host import floats, ints
from gpu.kernels.native import load_kernels
from gpu.runtime.grammar import allowed_tokens
from wire.options import RequestOptions
from wire.sampling import SamplingParams

__all__ = [
    "NON_FINITE",
    "Row",
    "SampleResult",
    "parse_request",
    "sample",
    "sample_greedy",
    "sample_plain",
]

# The token read back for a row whose logits hold a NaN or +inf (a numeric fault of the
# model, such as an fp16 overflow): no token can be drawn from them, and the engine
# fails that request alone instead of emitting whatever an argmax over NaN gives.
NON_FINITE = -1


def parse_request(
    sampling: dict[str, Any], options: dict[str, Any], vocab: int, prompt_len: int
) -> tuple[SamplingParams, RequestOptions]:
    """Validate one SUBMIT entry's maps; ``ValueError`` carries a user-facing message."""
    params = SamplingParams.from_wire(sampling, vocab)
    opts = RequestOptions.from_wire(options, vocab, prompt_len)
    if opts.embed is not None and params.n != 1:
        raise ValueError("an embed request samples nothing: n must be 1, without logprobs")
    return params, opts


class Row(Protocol):
    """What the sampler needs to know about one row of logits (the engine passes its
    sequences, whose ``prompt`` and ``output`` are sliced only when a penalty reads them)."""

    @property
    def params(self) -> SamplingParams: ...
    @property
    def prompt(self) -> Sequence[int]: ...
    @property
    def output(self) -> Sequence[int]: ...
    @property
    def generator(self) -> torch.Generator | None: ...
    @property
    def eog_ids(self) -> Sequence[int]: ...
    @property
    def greedy(self) -> bool: ...  # params.greedy, read once
    @property
    def plain(self) -> bool: ...  # not params.adjusts_logits, read once


@dataclass(slots=True)
class SampleResult:
    tokens: list[int]
    logprobs: Tensor | None = None  # [K, V] log-probabilities sampled from, when asked
    extra: dict[str, Any] = field(default_factory=dict)


def _process(logits: Tensor, rows: Sequence[Row]) -> Tensor:
    logits = logits.clone()
    dev = logits.device
    for i, r in enumerate(rows):
        p = r.params
        if not p.adjusts_logits:
            continue
        if p.logit_bias:
            ids = torch.tensor([k for k, _ in p.logit_bias], device=dev)
            logits[i, ids] += torch.tensor(
                [v for _, v in p.logit_bias], device=dev, dtype=logits.dtype
            )
        if p.repetition_penalty != 1.0:
            ids = torch.tensor(list({*r.prompt, *r.output}), dtype=torch.int64, device=dev)
            sel = logits[i, ids]
            logits[i, ids] = torch.where(
                sel > 0, sel / p.repetition_penalty, sel * p.repetition_penalty
            )
        if (p.frequency_penalty or p.presence_penalty) and r.output:
            ids, counts = torch.tensor(r.output, device=dev).unique(return_counts=True)
            logits[i, ids] -= p.frequency_penalty * counts.to(logits.dtype) + p.presence_penalty
        if len(r.output) < p.min_new_tokens:
            banned = [*r.eog_ids, *p.stop_token_ids]
            if banned:
                logits[i, torch.tensor(banned, device=dev)] = -math.inf
    return logits


def _filters(p: SamplingParams) -> bool:
    return p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0


def _restrict(probs: Tensor, rows: Sequence[Row]) -> Tensor:
    """Top-k / top-p / min-p: ``probs`` [K, V] with the dropped tokens set to 0, each row
    in its vocabulary order. One stable sort, so tied probabilities keep the lower id first
    whatever else shares the call."""
    sorted_p, idx = probs.sort(dim=-1, descending=True, stable=True)
    v, dev = probs.shape[1], probs.device
    # top_k may exceed the vocabulary (the wire allows any int64): that is all of it.
    top_k = ints([min(r.params.top_k, v) if r.params.top_k > 0 else v for r in rows], device=dev)
    top_p = floats([r.params.top_p for r in rows], probs.dtype, dev)
    min_p = floats([r.params.min_p for r in rows], probs.dtype, dev)
    drop = (sorted_p.cumsum(dim=-1) - sorted_p) > top_p[:, None]
    drop |= torch.arange(v, device=dev)[None, :] >= top_k[:, None]
    drop |= sorted_p < (sorted_p[:, :1] * min_p[:, None])
    return probs.masked_fill(torch.empty_like(drop).scatter_(1, idx, drop), 0.0)


def _noise(like: Tensor, rows: Sequence[Row]) -> Tensor:
    """Exponential noise, one row per row. A row with a generator (every seeded request)
    takes one draw of V values from it, so what it consumes per step is fixed; the rows
    without one (unseeded) share one draw from torch's generator."""
    noise = torch.empty_like(like)
    shared = [i for i, r in enumerate(rows) if r.generator is None]
    if len(shared) == len(rows):
        return noise.exponential_()
    for i, r in enumerate(rows):
        if r.generator is not None:
            noise[i].exponential_(generator=r.generator)
    if shared:
        sel = ints(shared, device=like.device)
        noise.index_copy_(0, sel, torch.empty_like(noise[: len(shared)]).exponential_())
    return noise


def _filter_and_draw(probs: Tensor, rows: Sequence[Row]) -> Tensor:
    """Top-k / top-p / min-p on the rows that ask, then an exponential race (argmax of
    p / E, E ~ Exp(1): a draw from p). The noise meets each token at its vocabulary id on
    every row, so a row's token depends on its probabilities and its own generator only,
    never on which other rows share the batch or what they filter (before, one row's
    filter sorted every row and the noise met the tokens in probability order)."""
    filtered = [i for i, r in enumerate(rows) if _filters(r.params)]
    if len(filtered) == len(rows):
        probs = _restrict(probs, rows)
    elif filtered:
        sel = ints(filtered, device=probs.device)
        kept = _restrict(probs.index_select(0, sel), [rows[i] for i in filtered])
        probs = probs.index_copy(0, sel, kept)
    return (probs / _noise(probs, rows)).argmax(dim=-1)


def _constrain(logits: Tensor, raw: Tensor, rows: list[int], bitmask: Tensor) -> None:
    """Only the tokens a grammar allows, in each of ``rows``, in place (``gpu/runtime/grammar.py``:
    ``bitmask`` is llguidance's packed mask). A row left with none (``min_new_tokens``
    banned the end the grammar requires) takes the mask over its logits before
    processing: the grammar wins."""
    kernels = load_kernels() if logits.device.type == "cpu" else None
    sel = torch.tensor(rows, dtype=torch.int64)
    if kernels is not None and logits.dtype == torch.float32 and logits.stride(1) == 1:
        alive = kernels.apply_token_bitmask(logits, sel, bitmask).bool()
    else:
        allowed = allowed_tokens(bitmask, logits.shape[1]).to(logits.device)
        for k, i in enumerate(rows):
            logits[i].masked_fill_(~allowed[k], -math.inf)
        alive = ~torch.isneginf(logits.index_select(0, sel.to(logits.device)).amax(-1)).cpu()
    if bool(alive.all()):
        return
    for k in (~alive).nonzero().flatten().tolist():
        allowed_row = allowed_tokens(bitmask[k : k + 1], logits.shape[1])[0].to(logits.device)
        base = raw[rows[k]] if raw is not logits else torch.zeros_like(logits[rows[k]])
        logits[rows[k]] = base.masked_fill(~allowed_row, -math.inf)


def sample(
    logits: Tensor,
    rows: Sequence[Row],
    want_logprobs: bool = False,
    allowed: tuple[list[int], Tensor] | None = None,
) -> SampleResult:
    """One token per row of ``logits`` [K, V] (fp32). ``allowed``: the constrained rows and
    their packed grammar masks (``gpu/runtime/grammar.py``), applied after penalties and bias, in
    place: the rows of ``logits`` are the caller's scratch."""
    raw = logits
    if not all(r.plain for r in rows):
        logits = _process(logits, rows)
    if allowed is not None:
        _constrain(logits, raw, *allowed)
    logits = _tempered(logits, rows)
    tokens, sound = _draw(logits, rows)
    lp = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    return SampleResult(tokens.masked_fill(~sound, NON_FINITE).tolist(), lp)


def sample_greedy(logits: Tensor) -> list[int]:
    """``sample``'s tokens when every row is greedy and plain, with no grammar and no
    logprobs: each row's first maximal logit, ``NON_FINITE`` where it is not finite.
    fp32 on the CPU in three numpy calls and no torch op (in a batch-256 step each call
    costs ~10-20 us, its code and the logits cold): the batch's maximum below +inf says
    every row is finite (NaN and +inf are not), else ``_first_max`` row by row."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        a = logits.numpy()
        if a.max(initial=-np.inf) < np.inf:
            return a.argmax(axis=1).tolist()  # type: ignore[no-any-return]
    tokens, sound = _first_max(logits)
    return tokens.masked_fill(~sound, NON_FINITE).tolist()  # type: ignore[no-any-return]


def sample_plain(logits: Tensor, rows: Sequence[Row]) -> tuple[Tensor, Tensor]:
    """``sample``'s tokens as tensors on the logits' device, read by no one yet (an
    overlapped step's: the host reads them a step later), for rows that are all ``plain``
    and constrained by no grammar, without logprobs: the same draws ``sample`` makes.
    Two tensors: the tokens, valid ids the next step may read on the device, and the
    same with ``NON_FINITE`` on rows whose logits were not finite, for the host."""
    tokens, sound = _draw(_tempered(logits, rows), rows)
    return tokens, tokens.masked_fill(~sound, NON_FINITE)


def _tempered(logits: Tensor, rows: Sequence[Row]) -> Tensor:
    """Each sampled row divided by its temperature (greedy rows as they are)."""
    if all(r.greedy for r in rows):
        return logits
    t = [1.0 if r.greedy else r.params.temperature for r in rows]
    return logits / floats(t, logits.dtype, logits.device)[:, None]


def _draw(logits: Tensor, rows: Sequence[Row]) -> tuple[Tensor, Tensor]:
    """One token per row: greedy rows the first maximal logit (``_first_max``), the rest
    a draw from their softmax (``_filter_and_draw``); and whether each row's logits were
    finite (a NaN is its row's maximum, so the maximum says it for the whole row, at no
    extra pass; -inf is a masked token, not a fault)."""
    tokens, sound = _first_max(logits)
    sampled = [i for i, r in enumerate(rows) if not r.greedy]
    if sampled:
        sel = ints(sampled, device=logits.device)
        probs = torch.softmax(logits.index_select(0, sel), dim=-1)
        drawn = _filter_and_draw(probs, [rows[i] for i in sampled])
        tokens = tokens.index_copy(0, sel, drawn)
    return tokens, sound


def _first_max(logits: Tensor) -> tuple[Tensor, Tensor]:
    """Each row's first maximal index, and whether the value there is below +inf (NaN and
    +inf are not). fp32 on the CPU through numpy's argmax: the same index as ``max``'s
    (the first maximal one, or the first NaN) in a tenth of its time, which was the
    largest host cost of a batch-256 step (120 us at V=269; 12 ms at V=32000)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        a = logits.numpy()
        idx = a.argmax(axis=1)
        return torch.from_numpy(idx), torch.from_numpy(a[np.arange(len(idx)), idx] < np.inf)
    best = logits.max(dim=-1)
    return best.indices, best.values < math.inf
