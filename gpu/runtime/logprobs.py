"""Logprob bookkeeping for the STEP ``extra`` map (``specs/wire.cddl``).

The forward computes the LM head only on the rows that need logits: each sampling
sequence's last row, plus the prompt positions a request asked prompt logprobs for
(``logprob_start_len``). ``LogprobRows`` keeps the prompt rows first and the sampling
rows after them, so the sampler sees one contiguous slice.
"""

from __future__ import annotations

import math
from typing import Any, TypeVar, cast

import torch
from torch import Tensor

from gpu.runtime.scheduler import Sequence
from wire import pack_f32s, pack_ids

__all__ = ["LogprobRows", "prompt_extra", "prompt_logprob_rows", "token_extra"]

_T = TypeVar("_T", bound=Tensor | None)


class LogprobRows:
    __slots__ = ("_prompt", "sample_rows", "_spans")

    def __init__(self) -> None:
        self._prompt: list[int] = []
        self.sample_rows: list[int] = []  # appended to directly on the decode path
        self._spans: list[tuple[Sequence, int, list[int]]] = []  # seq, first prompt row, targets

    def add_sample(self, row: int) -> None:
        self.sample_rows.append(row)

    def add_prompt(self, seq: Sequence, rows: range, targets: list[int]) -> None:
        self._spans.append((seq, len(self._prompt), targets))
        self._prompt.extend(rows)

    @property
    def indices(self) -> list[int]:
        return self._prompt + self.sample_rows

    def samples(self, t: _T) -> _T:
        """The sampling rows of ``t`` (logits or hidden states of ``indices``): ``t`` itself
        when no prompt row comes first (no torch op: ~10 us in a batch-256 step)."""
        return cast(_T, t[len(self._prompt) :]) if self._prompt and t is not None else t

    def collect_prompt(self, logits: Tensor) -> None:
        if not self._spans:
            return
        lp = torch.log_softmax(logits[: len(self._prompt)], dim=-1)
        for seq, first, targets in self._spans:
            part = lp[first : first + len(targets)]
            seq.prompt_logprobs.append(_token_logprobs(seq, part, targets))


def prompt_logprob_rows(seq: Sequence, start: int, n: int, row: int, rows: LogprobRows) -> None:
    """Register this chunk's rows whose logits score a later prompt token."""
    o = seq.options
    if not o.return_logprob or o.logprob_start_len < 0:
        return
    lo = max(start, max(o.logprob_start_len, 1) - 1)
    hi = min(start + n, seq.prompt_len - 1)
    if lo < hi:
        rows.add_prompt(seq, range(row + lo - start, row + hi - start), seq.tokens[lo + 1 : hi + 1])


def _token_logprobs(seq: Sequence, lp: Tensor, targets: list[int]) -> dict[str, list[Any]]:
    o = seq.options
    t = torch.tensor(targets, device=lp.device)
    out: dict[str, list[Any]] = {"chosen": lp.gather(1, t[:, None])[:, 0].tolist()}
    if o.top_logprobs_num:
        vals, idx = lp.topk(o.top_logprobs_num, dim=-1)
        out["top_ids"] = [pack_ids(r) for r in idx.tolist()]
        out["top_logprobs"] = [pack_f32s(r) for r in vals.tolist()]
    if o.token_ids_logprob:
        ids = torch.tensor(o.token_ids_logprob, device=lp.device)
        out["ids"] = [pack_f32s(r) for r in lp.index_select(1, ids).tolist()]
    return out


def prompt_extra(seq: Sequence) -> dict[str, Any]:
    """The prompt-logprob keys of a request's first STEP entry."""
    o = seq.options
    if not o.return_logprob or o.logprob_start_len < 0:
        return {}
    chosen: list[float] = [math.nan] if o.logprob_start_len == 0 else []
    top_ids: list[bytes] = [pack_ids([])] if o.logprob_start_len == 0 else []
    top_lp: list[bytes] = [pack_f32s([])] if o.logprob_start_len == 0 else []
    ids_lp: list[bytes] = [pack_f32s([])] if o.logprob_start_len == 0 else []
    for part in seq.prompt_logprobs:
        chosen += part["chosen"]
        top_ids += part.get("top_ids", [])
        top_lp += part.get("top_logprobs", [])
        ids_lp += part.get("ids", [])
    out: dict[str, Any] = {"prompt_logprobs": pack_f32s(chosen)}
    if o.top_logprobs_num:
        out["prompt_top_ids"], out["prompt_top_logprobs"] = top_ids, top_lp
    if o.token_ids_logprob:
        out["prompt_ids_logprobs"] = ids_lp
    return out


def token_extra(
    seq: Sequence, i: int, tok: int, lp: Tensor | None, hidden: Tensor | None
) -> dict[str, Any]:
    """Per-new-token keys for row ``i`` of this step's sampling rows."""
    extra: dict[str, Any] = {}
    if seq.options.return_logprob and lp is not None:
        part = _token_logprobs(seq, lp[i : i + 1], [tok])
        extra["logprobs"] = pack_f32s(part["chosen"])
        if "top_ids" in part:
            extra["top_ids"], extra["top_logprobs"] = part["top_ids"], part["top_logprobs"]
        if "ids" in part:
            extra["ids_logprobs"] = part["ids"]
    if seq.options.return_hidden_states and hidden is not None:
        extra["hidden_states"] = [pack_f32s(hidden[i].float().tolist())]
    return extra
