"""SGLang ``sampling_params``: parsed once at the edge, with SGLang's rules and messages.

The rules and their order follow SGLang's ``SamplingParams.__post_init__`` and
``verify()`` (``python/sglang/srt/sampling/sampling_params.py``; sglang.md §3): an explicit
``null`` means the default, ``0 <= temperature < 1e-6`` becomes greedy (temperature 1.0,
top_k 1), ``top_k == -1`` means the whole vocabulary, and every range error reads
``"<name> must be in [..], got <v>."`` with the value as the client sent it. Where SGLang
would fail with a TypeError (a 500), we answer 400 with a clear message instead: unknown
keys, wrong JSON types, and fields this server does not implement. An unknown key is a
400 whatever ``--strict-fields`` says (issue 56, point 5): SGLang's ``SamplingParams``
takes no unknown keyword, and every key here changes the output, so a typo
(``max_new_token``) must not generate with the default instead. The bodies around
``sampling_params`` stay lenient (``lifecycle.core.fields``). So do the few limits
the worker has and SGLang lacks (``n``, stop ids and logit bias inside the vocabulary and
range), so that nothing accepted here is refused by the worker.

What the worker samples with is the wire contract, ``wire.SamplingParams``, built here;
``SamplingRequest`` adds what only the frontend reads (the length as asked, the
detokenizer's options).
"""

from __future__ import annotations

import difflib
import json
import math
from dataclasses import dataclass, field, replace
from typing import Any

from lifecycle.core.errors import RequestError
from wire.grammar import check_grammar
from wire.sampling import (
    DEFAULT_MAX_NEW_TOKENS,
    GREEDY_EPS,
    LOGIT_BIAS_LIMIT,
    MAX_N,
    RANGES,
    STOP_REGEX_MAX_COUNT,
    SamplingParams,
    check_stop_regex,
)

__all__ = [
    "FIELDS",
    "GRAMMAR_FIELDS",
    "SamplingRequest",
    "parse_sampling_params",
    "unknown_key_message",
]

_INT64 = 1 << 63


@dataclass(frozen=True, slots=True)
class SamplingRequest:
    """One validated ``sampling_params``.

    ``params`` is what the worker samples with; its ``max_new_tokens`` is the count the
    client asked for, unless ``to_context_end`` (the client sent ``null``): the count is
    then what the context leaves, known once the prompt is tokenized (``check_lengths``),
    and ``for_prompt`` puts it in.
    """

    params: SamplingParams = field(default_factory=SamplingParams)
    to_context_end: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False

    @property
    def max_new_tokens(self) -> int | None:
        return None if self.to_context_end else self.params.max_new_tokens

    @property
    def n(self) -> int:
        return self.params.n

    @property
    def stop(self) -> tuple[str, ...]:
        return self.params.stop

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    def for_prompt(self, max_new_tokens: int) -> SamplingParams:
        """The worker's parameters once the effective ``max_new_tokens`` is known. A
        ``min_new_tokens`` above it is capped: generation ends there either way."""
        return replace(
            self.params,
            max_new_tokens=max_new_tokens,
            min_new_tokens=min(self.params.min_new_tokens, max_new_tokens),
        )

    def to_wire(self, max_new_tokens: int) -> dict[str, Any]:
        """The SUBMIT entry's ``sampling`` map (``specs/wire.cddl``)."""
        return self.for_prompt(max_new_tokens).to_wire()


# SGLang fields we do not implement: a non-null value is a 400, never silently ignored.
UNSUPPORTED = ("structural_tag", "custom_params")
# Accepted and ignored: it only changes how often SGLang flushes a stream, and our
# streams already send whatever is ready on each client write.
IGNORED = ("stream_interval",)


def _bad(message: str) -> RequestError:
    return RequestError(message, 400)


def _number(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise _bad(f"{name} must be a number, got {v!r}.")
    try:
        return float(v)
    except OverflowError:  # an integer beyond any float (Python's json accepts them)
        raise _bad(f"{name} is out of range, got {v}.") from None


def _integer(name: str, v: Any) -> int:
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(f"{name} must be an integer, got {v!r}.")
    return v


def _boolean(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise _bad(f"{name} must be a boolean, got {v!r}.")
    return v


def _stop(v: Any) -> tuple[str, ...]:
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise _bad(f"stop must be a string or a list of strings, got {v!r}.")
    if any(s == "" for s in items):
        raise _bad("stop strings must not be empty.")
    return tuple(items)


def _stop_regex(v: Any) -> tuple[str, ...]:
    """Compiled here once so a bad pattern is a 400; the worker searches with them
    (bounds: ``wire.sampling.check_stop_regex``)."""
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise _bad(f"stop_regex must be a string or a list of strings, got {v!r}.")
    if len(items) > STOP_REGEX_MAX_COUNT:
        raise _bad(f"stop_regex holds at most {STOP_REGEX_MAX_COUNT} patterns, got {len(items)}.")
    for pattern in items:
        try:
            check_stop_regex(pattern)
        except ValueError as exc:
            raise _bad(str(exc)) from None
    return tuple(items)


def _grammar(key: str, v: Any) -> tuple[str, str]:
    """One of ``json_schema`` / ``regex`` / ``ebnf``, checked by the grammar library now so
    that a bad one is a 400 before anything is queued (``wire.grammar``). SGLang takes the
    schema as JSON text; an object is accepted too and sent as its JSON."""
    if key == "json_schema" and isinstance(v, dict):
        v = json.dumps(v)
    if not isinstance(v, str):
        raise _bad(f"{key} must be a string, got {type(v).__name__}.")
    try:
        check_grammar(key, v)
    except ValueError as exc:
        raise _bad(str(exc)) from None
    return key, v


def _stop_token_ids(v: Any, vocab_size: int) -> tuple[int, ...]:
    if not isinstance(v, list):
        raise _bad(f"stop_token_ids must be a list of integers, got {v!r}.")
    # SGLang drops null entries and keeps a set.
    ids = [_integer("stop_token_ids", t) for t in v if t is not None]
    if any(t < 0 for t in ids):
        raise _bad("stop_token_ids must be non-negative integers.")
    for t in ids:
        if t >= vocab_size:
            raise _bad(f"stop_token_ids must be in [0, {vocab_size - 1}], got {t}.")
    return tuple(sorted(set(ids)))


def _logit_bias(v: Any, vocab_size: int) -> tuple[tuple[int, float], ...]:
    if not isinstance(v, dict):
        raise _bad(f"logit_bias must be an object mapping token ids to numbers, got {v!r}.")
    out: dict[int, float] = {}
    for key, bias in v.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            token = -1
        if not 0 <= token < vocab_size:
            raise _bad(f"logit_bias must has keys in [0, {vocab_size - 1}], got {key}.")
        value = _number(f"logit_bias[{key}]", bias)
        if not math.isfinite(value):
            raise _bad(f"logit_bias[{key}] must be a finite number, got {value}.")
        if abs(value) > LOGIT_BIAS_LIMIT:
            raise _bad(f"logit_bias[{key}] must be in [-1e9, 1e9], got {value}.")
        out[token] = value
    return tuple(sorted(out.items()))


def _seed(name: str, v: Any) -> int:
    seed = _integer(name, v)
    if not -_INT64 <= seed < _INT64:
        raise _bad(f"{name} must fit in a signed 64-bit integer, got {seed}.")
    return seed


_NUMBERS = (
    "temperature",
    "top_p",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
)
_INTEGERS = ("max_new_tokens", "min_new_tokens", "top_k", "n")
# At most one: the output constraint (``wire.grammar``), named as SGLang names them.
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf")
# The detokenizer's options: the frontend's alone, never sent to the worker.
_TEXT_OPTIONS = ("skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")
_BOOLEANS = ("ignore_eos", *_TEXT_OPTIONS)
# Every sampling_params key this server implements.
FIELDS = (
    *_NUMBERS,
    *_INTEGERS,
    *_BOOLEANS,
    "stop",
    "stop_regex",
    "stop_token_ids",
    "logit_bias",
    "seed",
    *GRAMMAR_FIELDS,
)
KNOWN = frozenset(FIELDS + ("sampling_seed", *UNSUPPORTED, *IGNORED))


def unknown_key_message(key: str) -> str:
    """The 400's message for a key ``sampling_params`` does not have: it names the key,
    and the known one it is closest to when there is one (a typo)."""
    close = difflib.get_close_matches(key, FIELDS, n=1, cutoff=0.75)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return f"Unknown sampling parameter: {key!r}.{hint}"


def _check_fields(obj: dict[str, Any]) -> None:
    for key in obj:
        if key not in KNOWN:
            raise _bad(unknown_key_message(key))
    grammars = [obj.get(k) for k in GRAMMAR_FIELDS]
    if sum(g is not None for g in grammars) > 1:
        raise _bad("Only one of regex, json_schema, or ebnf can be set.")
    for key in UNSUPPORTED:
        if obj.get(key) is not None:
            raise _bad(f"{key} is not supported by this server")
    if obj.get("seed") is not None and obj.get("sampling_seed") is not None:
        raise _bad("Set only one of sampling_seed and seed.")


def _convert(obj: dict[str, Any], vocab_size: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """-> (typed values, raw values as sent) for every non-null field."""
    raw = {k: v for k, v in obj.items() if v is not None and k not in UNSUPPORTED + IGNORED}
    kw: dict[str, Any] = {}
    for key, value in raw.items():
        if key in _NUMBERS:
            kw[key] = _number(key, value)
        elif key in _INTEGERS:
            kw[key] = _integer(key, value)
        elif key in _BOOLEANS:
            kw[key] = _boolean(key, value)
        elif key == "stop":
            kw[key] = _stop(value)
        elif key == "stop_regex":
            kw[key] = _stop_regex(value)
        elif key == "stop_token_ids":
            kw[key] = _stop_token_ids(value, vocab_size)
        elif key in GRAMMAR_FIELDS:
            kw["grammar"] = _grammar(key, value)
        elif key == "logit_bias":
            continue  # checked after the ranges, in SGLang's order
        else:  # seed / sampling_seed
            kw["seed"] = _seed(key, value)
    return kw, raw


def _shown(raw: dict[str, Any], key: str, value: Any) -> Any:
    # SGLang prints the value it holds, i.e. the one the client sent (int stays int).
    return raw.get(key, value)


def _verify(kw: dict[str, Any], raw: dict[str, Any]) -> None:
    """SGLang verify(), same order, same messages."""
    t = kw.get("temperature", 1.0)
    if not math.isfinite(t) or t < 0.0:
        raise _bad(
            f"temperature must be a non-negative finite number, got {_shown(raw, 'temperature', t)}."
        )
    for key in ("top_p", "min_p", "top_k", *list(RANGES)[2:]):  # SGLang's order
        if key == "top_k":
            top_k = kw.get("top_k", -1)
            if not (top_k == -1 or top_k >= 1):
                shown = _shown(raw, "top_k", top_k)
                raise _bad(f"top_k must be -1 (disable) or at least 1, got {shown}.")
            continue
        r = RANGES[key]
        value = kw.get(key, r.default)
        if value not in r:
            raise _bad(r.message(key, _shown(raw, key, value)))
    lo, hi = kw.get("min_new_tokens", 0), kw.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if lo < 0:
        raise _bad(f"min_new_tokens must be in [0, max_new_tokens], got {lo}.")
    if hi is not None and hi < 0:
        raise _bad(f"max_new_tokens must be at least 0, got {hi}.")
    if hi is not None and lo > hi:
        raise _bad(f"min_new_tokens must be in [0, max_new_tokens({hi})], got {lo}.")
    n = kw.get("n", 1)
    if n < 1:
        raise _bad(f"n must be at least 1, got {n}.")
    if n > MAX_N:  # the worker's limit (wire.MAX_N); SGLang has none
        raise _bad(f"n must be at most {MAX_N}, got {n}.")


def parse_sampling_params(obj: Any, *, vocab_size: int) -> SamplingRequest:
    """Validate one ``sampling_params`` object; raises RequestError with SGLang's message."""
    if obj is None:
        obj = {}
    if not isinstance(obj, dict):
        raise _bad(f"sampling_params must be an object, got {type(obj).__name__}.")
    _check_fields(obj)
    kw, raw = _convert(obj, vocab_size)
    to_context_end = "max_new_tokens" in obj and obj["max_new_tokens"] is None
    if to_context_end:
        kw["max_new_tokens"] = None  # explicit null: generate until the context ends
    t = kw.get("temperature", 1.0)
    if 0.0 <= t < GREEDY_EPS:
        kw["temperature"], kw["top_k"] = 1.0, 1  # greedy, exactly as SGLang encodes it
    _verify(kw, raw)
    if "logit_bias" in raw:
        kw["logit_bias"] = _logit_bias(raw["logit_bias"], vocab_size)
    if kw.get("top_k", -1) >= vocab_size:
        kw["top_k"] = -1  # the whole vocabulary either way, and the wire's int64 holds it
    if to_context_end:
        del kw["max_new_tokens"]
    text = {k: kw.pop(k) for k in _TEXT_OPTIONS if k in kw}
    return SamplingRequest(SamplingParams(**kw), to_context_end, **text)
