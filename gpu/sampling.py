"""Per-request sampling parameters (validated once, at the edge) and the batched sampler.

Rules follow SGLang's ``SamplingParams.verify``: temperature below 1e-6 or top_k 1 is
greedy; penalties follow vLLM/SGLang (frequency/presence over output tokens, repetition
over prompt + output). Seeded requests draw from their own ``torch.Generator``, one
fixed-size draw per step, so a seed gives the same tokens whatever shares the batch.
Logprobs are of the distribution sampled from (after penalties, bias and temperature,
before top-k/top-p/min-p), as SGLang reports them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "RequestOptions",
    "SamplingParams",
    "SampleRow",
    "SampleResult",
    "parse_request",
    "sample",
]

_GREEDY_EPS = 1e-6
# Prompt logprobs travel in one STEP entry; frames are capped at 64 MiB (wire.cddl).
PROMPT_LOGPROB_BYTES = 16 * 2**20


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    n: int = 1

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS or self.top_k == 1

    @property
    def needs_logit_processing(self) -> bool:
        return bool(
            self.logit_bias
            or self.min_new_tokens
            or self.frequency_penalty
            or self.presence_penalty
            or self.repetition_penalty != 1.0
        )


@dataclass(frozen=True, slots=True)
class RequestOptions:
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: tuple[int, ...] = ()
    return_hidden_states: bool = False


_NUM = (int, float)


def _num(
    d: dict[str, Any], key: str, default: float, lo: float, hi: float, lo_open: bool = False
) -> float:
    v = d.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, _NUM) or not math.isfinite(v):
        raise ValueError(f"{key} must be a finite number, got {v!r}.")
    if v < lo or v > hi or (lo_open and v == lo):
        raise ValueError(f"{key} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v!r}.")
    return float(v)


def _int(d: dict[str, Any], key: str, default: int, lo: int, hi: int) -> int:
    v = d.get(key, default)
    if v is None:
        return default
    if type(v) is not int or not lo <= v <= hi:
        raise ValueError(f"{key} must be an integer in [{lo}, {hi}], got {v!r}.")
    return v


def _bool(d: dict[str, Any], key: str) -> bool:
    v = d.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise ValueError(f"{key} must be a boolean, got {v!r}.")
    return v


def _token_ids(v: Any, key: str, vocab: int) -> tuple[int, ...]:
    if isinstance(v, bytes):
        if len(v) % 4:
            raise ValueError(f"{key} must hold whole int32 ids.")
        ids = np.frombuffer(v, dtype="<i4").tolist()
    elif isinstance(v, list) and all(type(i) is int for i in v):
        ids = v
    else:
        raise ValueError(f"{key} must be a list of token ids.")
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise ValueError(f"{key} has ids outside [0, {vocab - 1}]: {bad[:5]}.")
    return tuple(ids)


def _sampling(s: dict[str, Any], vocab: int) -> SamplingParams:
    max_new = _int(s, "max_new_tokens", 128, 0, 1 << 30)
    min_new = _int(s, "min_new_tokens", 0, 0, max_new)
    top_k = _int(s, "top_k", -1, -1, 1 << 30)
    if top_k == 0:
        raise ValueError("top_k must be -1 (disable), or at least 1, got 0.")
    stop = s.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(x, str) and x for x in stop):
        raise ValueError("stop must be a list of non-empty strings.")
    bias_in = s.get("logit_bias") or {}
    if not isinstance(bias_in, dict):
        raise ValueError("logit_bias must be a map of token id to number.")
    bias = []
    for k, v in bias_in.items():
        if type(k) is not int or not 0 <= k < vocab:
            raise ValueError(f"logit_bias must has keys in [0, {vocab - 1}], got {k!r}.")
        bias.append((k, _num({"b": v}, "b", 0.0, -1e9, 1e9)))
    seed = s.get("seed")
    if seed is not None and (type(seed) is not int or abs(seed) >= 1 << 63):
        raise ValueError(f"seed must be a 64-bit integer, got {seed!r}.")
    return SamplingParams(
        max_new_tokens=max_new,
        min_new_tokens=min_new,
        temperature=_num(s, "temperature", 1.0, 0.0, 1e6),
        top_p=_num(s, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=top_k,
        min_p=_num(s, "min_p", 0.0, 0.0, 1.0),
        frequency_penalty=_num(s, "frequency_penalty", 0.0, -2.0, 2.0),
        presence_penalty=_num(s, "presence_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_num(s, "repetition_penalty", 1.0, 0.0, 2.0, lo_open=True),
        stop=tuple(stop),
        stop_token_ids=frozenset(
            _token_ids(s.get("stop_token_ids") or [], "stop_token_ids", vocab)
        ),
        ignore_eos=_bool(s, "ignore_eos"),
        seed=seed,
        logit_bias=tuple(bias),
        n=_int(s, "n", 1, 1, 64),
    )


def parse_request(
    sampling: dict[str, Any], options: dict[str, Any], vocab: int, prompt_len: int
) -> tuple[SamplingParams, RequestOptions]:
    """Validate one SUBMIT entry's maps; ``ValueError`` carries a user-facing message."""
    params = _sampling(sampling, vocab)
    tids = options.get("token_ids_logprob")
    opts = RequestOptions(
        return_logprob=_bool(options, "return_logprob"),
        logprob_start_len=_int(options, "logprob_start_len", -1, -1, max(prompt_len - 1, 0)),
        top_logprobs_num=_int(options, "top_logprobs_num", 0, 0, min(vocab, 1024)),
        token_ids_logprob=() if tids is None else _token_ids(tids, "token_ids_logprob", vocab),
        return_hidden_states=_bool(options, "return_hidden_states"),
    )
    if opts.return_logprob and opts.logprob_start_len >= 0:
        per_pos = 1 + 2 * opts.top_logprobs_num + len(opts.token_ids_logprob)
        if (prompt_len - opts.logprob_start_len) * per_pos * 4 > PROMPT_LOGPROB_BYTES:
            raise ValueError(
                f"prompt logprobs for {prompt_len - opts.logprob_start_len} positions with "
                f"top_logprobs_num {opts.top_logprobs_num} and {len(opts.token_ids_logprob)} "
                "token_ids_logprob exceed the worker's frame budget: raise logprob_start_len "
                "or ask for fewer"
            )
    return params, opts


@dataclass(slots=True)
class SampleRow:
    """What the sampler needs to know about one row of logits."""

    params: SamplingParams
    prompt: Sequence[int]
    output: Sequence[int]
    generator: torch.Generator | None
    eog_ids: Sequence[int] = ()


@dataclass(slots=True)
class SampleResult:
    tokens: list[int]
    logprobs: Tensor | None = None  # [K, V] log-probabilities sampled from, when asked
    extra: dict[str, Any] = field(default_factory=dict)


def _process(logits: Tensor, rows: Sequence[SampleRow]) -> Tensor:
    logits = logits.clone()
    dev = logits.device
    for i, r in enumerate(rows):
        p = r.params
        if not p.needs_logit_processing:
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


def _filter_and_draw(probs: Tensor, rows: Sequence[SampleRow]) -> list[int]:
    """Top-k / top-p / min-p on sorted probabilities, then an exponential-race draw."""
    sort_needed = any(
        r.params.top_k > 0 or r.params.top_p < 1.0 or r.params.min_p > 0 for r in rows
    )
    idx: Tensor | None = None
    if sort_needed:
        probs, idx = probs.sort(dim=-1, descending=True)
        v = probs.shape[1]
        dev = probs.device
        top_k = torch.tensor(
            [r.params.top_k if r.params.top_k > 0 else v for r in rows], device=dev
        )
        top_p = torch.tensor([r.params.top_p for r in rows], device=dev, dtype=probs.dtype)
        min_p = torch.tensor([r.params.min_p for r in rows], device=dev, dtype=probs.dtype)
        cum = probs.cumsum(dim=-1)
        drop = (cum - probs) > top_p[:, None]
        drop |= torch.arange(v, device=dev)[None, :] >= top_k[:, None]
        drop |= probs < (probs[:, :1] * min_p[:, None])
        probs = probs.masked_fill(drop, 0.0)
    noise = torch.empty_like(probs)
    for i, r in enumerate(rows):
        noise[i].exponential_(generator=r.generator)
    pick = (probs / noise).argmax(dim=-1)
    if idx is not None:
        pick = idx.gather(1, pick[:, None])[:, 0]
    return pick.tolist()


def sample(logits: Tensor, rows: Sequence[SampleRow], want_logprobs: bool = False) -> SampleResult:
    """One token per row of ``logits`` [K, V] (fp32)."""
    if any(r.params.needs_logit_processing for r in rows):
        logits = _process(logits, rows)
    greedy = [r.params.greedy for r in rows]
    temps = None
    if not all(greedy):
        t = [1.0 if g else r.params.temperature for g, r in zip(greedy, rows, strict=False)]
        temps = torch.tensor(t, device=logits.device, dtype=logits.dtype)[:, None]
        logits = logits / temps
    tokens = logits.argmax(dim=-1).tolist()
    sampled = [i for i, g in enumerate(greedy) if not g]
    if sampled:
        sel = torch.tensor(sampled, device=logits.device)
        probs = torch.softmax(logits.index_select(0, sel), dim=-1)
        for i, tok in zip(
            sampled, _filter_and_draw(probs, [rows[i] for i in sampled]), strict=False
        ):
            tokens[i] = tok
    lp = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    return SampleResult(tokens, lp)
