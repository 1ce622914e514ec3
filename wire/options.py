"""What a SUBMIT entry asks the worker to return besides tokens (``specs/wire.cddl``
``options``), with its bounds: one definition. The frontend builds a ``RequestOptions``
and checks it against the prompt it tokenized (a 400 before anything is submitted); the
worker and the scripted worker read the map with ``from_wire``, which applies the same
``check``, so both sides accept exactly the same values (``tests/test_wire.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from wire.embed import EmbedOptions
from wire.frames import pack_ids
from wire.reasoning_budget import ReasoningBudget
from wire.sampling import get_bool, get_int, token_ids

__all__ = ["MAX_TOP_LOGPROBS", "PROMPT_LOGPROB_BYTES", "RequestOptions"]

MAX_TOP_LOGPROBS = 1024  # top_logprobs_num at most (and at most the vocabulary)
# Prompt logprobs travel in one STEP entry; frames are capped at 64 MiB (wire.cddl).
PROMPT_LOGPROB_BYTES = 16 * 2**20


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """One definition of each option: the frontend's requests carry this value as it is,
    and a ``/generate`` body sets each field by its name (``lifecycle.core.params``): a
    flag defaults to False, a count is at least its default, which means off."""

    return_logprob: bool = False
    logprob_start_len: int = -1  # the first prompt position with logprobs; -1: none
    top_logprobs_num: int = 0
    token_ids_logprob: tuple[int, ...] = ()
    return_hidden_states: bool = False
    embed: EmbedOptions | None = None  # prefill only: the pooled final hidden state
    reasoning_budget: ReasoningBudget | None = None  # the reasoning closed after N tokens

    def check(self, vocab_size: int, prompt_len: int) -> None:
        """``ValueError`` with a user-facing message for values outside the bounds."""
        as_map = {
            "logprob_start_len": self.logprob_start_len,
            "top_logprobs_num": self.top_logprobs_num,
        }
        get_int(as_map, "logprob_start_len", -1, -1, max(prompt_len - 1, 0))
        get_int(as_map, "top_logprobs_num", 0, 0, min(vocab_size, MAX_TOP_LOGPROBS))
        token_ids(list(self.token_ids_logprob), "token_ids_logprob", vocab_size)
        if self.reasoning_budget is not None:
            self.reasoning_budget.check(vocab_size)
        if self.embed is not None and self.return_logprob:
            raise ValueError("an embed request samples nothing: n must be 1, without logprobs")
        if self.return_logprob and self.logprob_start_len >= 0:
            positions = prompt_len - self.logprob_start_len
            per_pos = 1 + 2 * self.top_logprobs_num + len(self.token_ids_logprob)
            if positions * per_pos * 4 > PROMPT_LOGPROB_BYTES:
                raise ValueError(
                    f"prompt logprobs for {positions} positions with top_logprobs_num "
                    f"{self.top_logprobs_num} and {len(self.token_ids_logprob)} "
                    "token_ids_logprob exceed the worker's frame budget: raise "
                    "logprob_start_len or ask for fewer"
                )

    def to_wire(self) -> dict[str, Any]:
        """The ``options`` map: only what differs from the defaults."""
        o: dict[str, Any] = {}
        if self.return_logprob:
            o["return_logprob"] = True
            o["logprob_start_len"] = self.logprob_start_len
            if self.top_logprobs_num:
                o["top_logprobs_num"] = self.top_logprobs_num
            if self.token_ids_logprob:
                o["token_ids_logprob"] = pack_ids(self.token_ids_logprob)
        if self.return_hidden_states:
            o["return_hidden_states"] = True
        if self.embed is not None:
            o["embed"] = self.embed.to_wire()
        if self.reasoning_budget is not None:
            o["reasoning_budget"] = self.reasoning_budget.to_wire()
        return o

    @classmethod
    def from_wire(cls, options: dict[str, Any], vocab_size: int, prompt_len: int) -> RequestOptions:
        """Read and check one entry's ``options`` map; ``ValueError`` for REQ-ERROR."""
        tids = options.get("token_ids_logprob")
        opts = cls(
            return_logprob=get_bool(options, "return_logprob"),
            logprob_start_len=get_int(options, "logprob_start_len", -1, -1, 1 << 31),
            top_logprobs_num=get_int(options, "top_logprobs_num", 0, 0, 1 << 31),
            token_ids_logprob=()
            if tids is None
            else token_ids(tids, "token_ids_logprob", vocab_size),
            return_hidden_states=get_bool(options, "return_hidden_states"),
            embed=None
            if options.get("embed") is None
            else EmbedOptions.from_wire(options["embed"]),
            reasoning_budget=None
            if options.get("reasoning_budget") is None
            else ReasoningBudget.from_wire(options["reasoning_budget"], vocab_size),
        )
        opts.check(vocab_size, prompt_len)
        return opts
