"""SGLang-native ``/generate`` bodies: normalised and validated once, at the edge.

Follows ``GenerateReqInput.normalize_batch_and_arguments`` and the tokenizer manager's
checks (sglang.md §2): ``text`` or ``input_ids``, single or batch; ``n`` from
``sampling_params`` (equal across a list) fans out by list repetition, and a single
prompt with ``n > 1`` becomes a batch of one; a ``rid`` string on a batch becomes
``f"{rid}_{i}"``; scalar logprob options broadcast, lists are per prompt. Messages are
SGLang's where SGLang has one; where SGLang would crash with a 500 (wrong JSON types,
unknown keys) the client gets a 400 that says what to fix. Anything else raised from here
is a bug.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields, replace
from typing import Any

from lifecycle.core.errors import RequestError
from lifecycle.core.fields import accept_unknown
from lifecycle.core.sampling import SamplingRequest, parse_sampling_params
from lifecycle.core.states import Cause
from wire import ReasoningBudget, RequestOptions

__all__ = [
    "BODY_OPTIONS",
    "GenerateItem",
    "GenerateRequest",
    "RequestError",
    "SamplingRequest",
    "check_lengths",
    "expand_samples",
    "parse_generate",
    "parse_sampling_params",
]

MAX_SEQUENCES = 1024  # prompts x n per request: bounds what one body can make us hold

# ``RequestOptions`` fields a body does not set by name: ``/encode`` makes ``embed``, and
# ``reasoning_budget`` is ``max_thinking_tokens`` in ids, made once the prompt is tokenized.
_MADE_ELSEWHERE = frozenset({"embed", "reasoning_budget"})
# The flags and counts of ``RequestOptions`` a body sets per prompt, by their name, with
# their defaults (SGLang's normalize_param: a scalar broadcasts, a list is per prompt). A
# flag defaults to False; a count is at least its default, which means off (-1, 0).
BODY_OPTIONS: dict[str, bool | int] = {
    f.name: f.default
    for f in fields(RequestOptions)
    if f.name not in _MADE_ELSEWHERE and isinstance(f.default, bool | int)
}
# Every other option a body sets has a rule of its own here (``_token_ids_logprob``).
assert {f.name for f in fields(RequestOptions)} - _MADE_ELSEWHERE - BODY_OPTIONS.keys() == {
    "token_ids_logprob"
}, "a RequestOptions field that is neither a flag nor a count needs a parsing rule"
_FIELDS = frozenset(
    {
        "text",
        "input_ids",
        "sampling_params",
        "stream",
        "rid",
        "return_text_in_logprobs",
        "max_thinking_tokens",
        "model",  # which model serves it (lifecycle.api.model_routes), read before here
        *(f.name for f in fields(RequestOptions) if f.name not in _MADE_ELSEWHERE),
    }
)
# Accepted and ignored: bookkeeping that changes nothing about the output.
_IGNORED = frozenset(
    {
        "log_metrics",
        "priority",
        "no_logs",
        "custom_labels",
        "routing_key",
        "conversation_id",
        "external_trace_header",
        "received_time",
        "session_id",
        "background",
    }
)
# SGLang features we do not implement: 400 when set to anything but null/false.
_UNSUPPORTED = frozenset(
    {
        "input_embeds",
        "image_data",
        "video_data",
        "audio_data",
        "mm_hashes",
        "mm_content_hashes",
        "use_audio_in_video",
        "video_config",
        "modalities",
        "lora_path",
        "lora_id",
        "custom_logit_processor",
        "session_params",
        "positional_embed_overrides",
        "bootstrap_host",
        "bootstrap_port",
        "bootstrap_room",
        "bootstrap_pair_key",
        "decode_tp_size",
        "routed_dp_rank",
        "data_parallel_rank",
        "disagg_prefill_dp_rank",
        "return_routed_experts",
        "routed_experts_start_len",
        "return_indexer_topk",
        "return_sampling_mask",
        "return_flat_raw_top_logprobs",
        "return_flat_raw_top_logprobs_b64",
        "require_reasoning",
        "return_bytes",
        "return_entropy",
        "return_prompt_token_ids",
        "extra_key",
        "cache_salt",
        "images_config",
        "max_dynamic_patch",
        "min_dynamic_patch",
        "multi_item_delimiter_indices",
    }
)


@dataclass(frozen=True, slots=True)
class GenerateItem:
    """One prompt of a request, before the ``n`` fan-out (``sampling.n`` samples)."""

    index: int
    text: str | None
    input_ids: list[int] | None
    sampling: SamplingRequest
    client_rid: str | None = None
    # What the worker returns besides tokens, as the client asked (an embed request,
    # ``lifecycle.core.embed``: prefill only, the pooled final hidden state instead of
    # tokens, n is 1, no logprobs). Checked against the prompt once it is tokenized, when
    # its reasoning budget in ids is set (``request_options``).
    options: RequestOptions = field(default_factory=RequestOptions)
    return_text_in_logprobs: bool = False  # each logprob entry carries its token's text
    # A thinking budget: the reasoning closed after this many tokens (``/generate``'s
    # ``max_thinking_tokens``, chat's ``thinking_token_budget``, Anthropic's
    # ``budget_tokens``; ``core/reasoning.py``).
    reasoning_budget: int | None = None

    def request_options(
        self, vocab_size: int, prompt_len: int, budget: ReasoningBudget | None = None
    ) -> RequestOptions:
        """What the worker must return besides tokens (a SUBMIT entry's options), checked
        against the tokenized prompt with the worker's own bounds: ``RequestError`` (400)
        for what the worker would refuse. ``budget``: the thinking budget in ids."""
        opts = replace(self.options, reasoning_budget=budget)
        try:
            opts.check(vocab_size, prompt_len)
        except ValueError as exc:
            raise _bad(str(exc)) from None
        return opts


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """``is_batch``: the reply is a JSON list (a list prompt, or any ``n > 1``)."""

    items: list[GenerateItem]
    is_batch: bool
    stream: bool


def _bad(message: str, cause: Cause = Cause.INVALID) -> RequestError:
    return RequestError(message, 400, cause)


def _flag(name: str, v: Any, default: bool) -> bool:
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(f"{name} must be a boolean, got {v!r}.")
    return v


def _int_at_least(name: str, v: Any, lo: int, default: int) -> int:
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise _bad(f"{name} must be an integer >= {lo}, got {v!r}.")
    return v


def _option(name: str, v: Any, default: bool | int) -> bool | int:
    """One of ``BODY_OPTIONS``: a flag, or a count at least its default."""
    if isinstance(default, bool):
        return _flag(name, v, default)
    return _int_at_least(name, v, default, default)


def _request_options(
    per: dict[str, list[Any]], i: int, token_ids_logprob: tuple[int, ...]
) -> RequestOptions:
    """Prompt ``i``'s options, each of ``BODY_OPTIONS`` read from its per-prompt values."""
    values: dict[str, Any] = {
        name: _option(name, per[name][i], d) for name, d in BODY_OPTIONS.items()
    }
    return RequestOptions(**values, token_ids_logprob=token_ids_logprob)


def _budget(v: Any) -> int | None:
    """``max_thinking_tokens``: SGLang's thinking budget on ``/generate``."""
    return None if v is None else _int_at_least("max_thinking_tokens", v, 0, 0)


def _check_keys(body: dict[str, Any]) -> None:
    for key, value in body.items():
        if key in _FIELDS or key in _IGNORED:
            continue
        if key in _UNSUPPORTED:
            if value is not None and value is not False:
                raise _bad(f"{key} is not supported by this server")
            continue
        if not accept_unknown("/generate", key):
            raise _bad(f"Unknown field in the request body: {key!r}.")


def _token_list(ids: Any, vocab_size: int) -> list[int]:
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in ids
    ):
        raise _bad("input_ids must be a list of integers or a list of lists of integers.")
    if not ids:
        raise _bad("input_ids cannot be empty.")
    if any(t >= vocab_size for t in ids):
        raise _bad(
            f"The input_ids {ids} contains values greater than the vocab size ({vocab_size})."
        )
    if any(t < 0 for t in ids):
        raise _bad(f"The input_ids {ids} contains negative values.")
    return ids


def _prompts(body: dict[str, Any], vocab_size: int) -> tuple[list[Any], bool, bool]:
    """-> (prompts, is_batch, are_texts)."""
    text, ids = body.get("text"), body.get("input_ids")
    if text is None and ids is None:
        raise _bad("Either text, input_ids or input_embeds should be provided.")
    if text is not None and ids is not None:
        raise _bad("Provide either text or input_ids, not both.")
    if text is not None:
        if isinstance(text, str):
            return [text], False, True
        if not isinstance(text, list) or not all(isinstance(t, str) for t in text):
            raise _bad("text must be a string or a list of strings.")
        if not text:
            raise _bad("text cannot be an empty list.")
        return list(text), True, True
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return [_token_list(seq, vocab_size) for seq in ids], True, False
    return [_token_list(ids, vocab_size)], False, False


def _sampling(raw: Any, batch: int, is_batch: bool, vocab_size: int) -> list[SamplingRequest]:
    if raw is None or isinstance(raw, dict):
        return [parse_sampling_params(raw, vocab_size=vocab_size)] * batch
    if not isinstance(raw, list) or not all(isinstance(p, dict) for p in raw):
        raise _bad("sampling_params must be an object or a list of objects.")
    if not is_batch:
        raise _bad("sampling_params must be an object for a single prompt.")
    if len(raw) != batch:
        raise _bad(
            f"The length of sampling_params ({len(raw)}) should be equal to the batch size ({batch})."
        )
    # Compared as sent, before any is validated (SGLang's order); values may be unhashable.
    ns = [1 if p.get("n") is None else p.get("n") for p in raw]
    if any(n != ns[0] for n in ns):
        raise _bad("The parallel_sample_num should be the same for all samples in sample params.")
    return [parse_sampling_params(p, vocab_size=vocab_size) for p in raw]


def _rids(rid: Any, batch: int, is_batch: bool) -> list[str | None]:
    if rid is None:
        return [None] * batch
    if isinstance(rid, str):
        return [f"{rid}_{i}" for i in range(batch)] if is_batch else [rid]
    if not isinstance(rid, list) or not all(isinstance(r, str) for r in rid):
        raise _bad("The rid should be a string or a list of strings.")
    if not is_batch:
        raise _bad("The rid should be a string for a single request.")
    if len(rid) != batch:
        raise _bad("The specified rids length mismatch with the batch_size for batch processing.")
    duplicates = [r for r, count in Counter(rid).items() if count > 1]
    if duplicates:
        raise _bad(f"Duplicate request IDs detected within the request: {duplicates}")
    return list(rid)


def _per_prompt(name: str, raw: Any, batch: int, is_batch: bool, n: int) -> list[Any]:
    """SGLang normalize_param: a scalar broadcasts, a list is one value per prompt."""
    if not isinstance(raw, list):
        return [raw] * batch
    if not is_batch:
        raise _bad(f"{name} must be a single value for a single prompt.")
    if n > 1:
        raise _bad(f"Cannot use list {name} with parallel_sample_num > 1")
    if len(raw) != batch:
        raise _bad(
            f"The length of {name} ({len(raw)}) should be equal to the batch size ({batch})."
        )
    return raw


def _token_ids_logprob(
    raw: Any, batch: int, is_batch: bool, n: int, vocab: int
) -> list[tuple[int, ...]]:
    if not raw:  # None and [] alike
        return [()] * batch
    if not isinstance(raw, list):
        per: list[Any] = [[raw] for _ in range(batch)]
    elif not isinstance(raw[0], list):
        per = [list(raw) for _ in range(batch)]
    elif not is_batch:
        raise _bad("token_ids_logprob must be a flat list of integers.")
    elif n > 1:
        raise _bad("Cannot use list token_ids_logprob with parallel_sample_num > 1")
    elif len(raw) != batch:
        raise _bad(
            f"The length of token_ids_logprob ({len(raw)}) should be equal to the batch size ({batch})."
        )
    else:
        per = raw
    out: list[tuple[int, ...]] = []
    for ids in per:
        if not ids:
            out.append(())
            continue
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids
        ):
            raise _bad("token_ids_logprob must be a flat list of integers.")
        for t in ids:
            if not 0 <= t < vocab:
                raise _bad(
                    f"token_ids_logprob contains out-of-vocabulary token id {t}; valid range is [0, {vocab})."
                )
        out.append(tuple(ids))
    return out


def parse_generate(
    body: Any, *, vocab_size: int, max_sequences: int = MAX_SEQUENCES
) -> GenerateRequest:
    """Normalise and validate a ``/generate`` body; raises RequestError (400)."""
    if not isinstance(body, dict):
        raise _bad("The request body must be a JSON object.")
    _check_keys(body)
    if not isinstance(body.get("model", ""), str):
        raise _bad("model must be a string.")
    prompts, is_batch, are_texts = _prompts(body, vocab_size)
    batch = len(prompts)
    sampling = _sampling(body.get("sampling_params"), batch, is_batch, vocab_size)
    n = sampling[0].n
    if batch * n > max_sequences:
        raise _bad(
            f"The request asks for {batch * n} sequences; at most {max_sequences} are allowed."
        )
    is_batch = is_batch or n > 1  # SGLang: a single prompt with n > 1 becomes a batch of one
    rids = _rids(body.get("rid"), batch, is_batch)
    per = {
        name: _per_prompt(name, body.get(name), batch, is_batch, n)
        for name in (*BODY_OPTIONS, "max_thinking_tokens")
    }
    tid = _token_ids_logprob(body.get("token_ids_logprob"), batch, is_batch, n, vocab_size)
    stream = _flag("stream", body.get("stream"), False)
    text_in_logprobs = _flag("return_text_in_logprobs", body.get("return_text_in_logprobs"), False)
    items = [
        GenerateItem(
            index=i,
            text=prompts[i] if are_texts else None,
            input_ids=None if are_texts else prompts[i],
            sampling=sampling[i],
            client_rid=rids[i],
            options=_request_options(per, i, tid[i]),
            return_text_in_logprobs=text_in_logprobs,
            reasoning_budget=_budget(per["max_thinking_tokens"][i]),
        )
        for i in range(batch)
    ]
    return GenerateRequest(items=items, is_batch=is_batch, stream=stream)


def expand_samples(req: GenerateRequest) -> list[tuple[GenerateItem, int]]:
    """Every (prompt, sample) in SGLang's reply order: list repetition, so with prompts
    p0, p1 and n=2 the order is p0/0, p1/0, p0/1, p1/1 (``text * n``)."""
    n = req.items[0].sampling.n if req.items else 1
    return [(item, k) for k in range(n) for item in req.items]


def check_lengths(n_prompt: int, max_new_tokens: int | None, *, context_length: int) -> int:
    """The effective max_new_tokens (None: up to the context end), or RequestError with
    SGLang's context-length messages (same ``>=`` bounds as its tokenizer manager)."""
    if n_prompt >= context_length:
        raise _bad(
            f"The input ({n_prompt} tokens) is longer than the model's context length "
            f"({context_length} tokens).",
            Cause.TOO_LONG,
        )
    if max_new_tokens is None:
        return context_length - n_prompt
    total = n_prompt + max_new_tokens
    if total >= context_length:
        raise _bad(
            "Requested token count exceeds the model's maximum context length "
            f"of {context_length} tokens. You requested a total of {total} "
            f"tokens: {n_prompt} tokens from the input messages and "
            f"{max_new_tokens} tokens for the completion. Please reduce the number "
            "of tokens in the input messages or the completion to fit within the limit.",
            Cause.TOO_LONG,
        )
    return max_new_tokens
