"""The sampling contract of a SUBMIT entry (``specs/wire.cddl`` ``sampling``): one definition.

The frontend validates a client's ``sampling_params`` once, with SGLang's messages
(``lifecycle/core/sampling.py``), builds a ``SamplingParams`` and sends ``to_wire()``; the
worker reads the map back with ``from_wire`` and samples with it (``gpu/runtime/sampling.py``).
``from_wire`` checks again, because a worker trusts no peer: a bad field is a REQ-ERROR
``invalid`` for that rid, never a failed step. The bounded numbers have one table,
``RANGES``, with their messages, which both sides apply (``tests/test_options_contract.py``
holds them to it); whatever the frontend accepts, the worker reads back unchanged. Only what the worker reads travels: the detokenizer's options
(``skip_special_tokens``, ``no_stop_trim``, ...) stay in the frontend. Stop strings do
travel, because the worker ends a sequence on them; trimming them off the text is the
frontend's. So do stop regexes (``stop_regex``), checked here once for both sides
(``check_stop_regex``), and the grammar the output must match (``wire/grammar.py``).
"""

from __future__ import annotations

import math
import re
import re._parser as _sre  # the parse tree of a pattern (nested-repeat check)
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from wire.grammar import grammar_from_wire

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "GREEDY_EPS",
    "LOGIT_BIAS_LIMIT",
    "MAX_N",
    "RANGES",
    "STOP_REGEX_MAX_CHARS",
    "STOP_REGEX_MAX_COUNT",
    "STOP_REGEX_WINDOW",
    "Range",
    "SamplingParams",
    "check_stop_regex",
    "get_bool",
    "get_int",
    "is_greedy",
    "token_ids",
]

GREEDY_EPS = 1e-6  # SGLang _SAMPLING_EPS
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
MAX_N = 64  # samples of one request: the worker holds rids rid .. rid+n-1
# A bias this large already forces or bans a token; far larger ones overflow fp32 logits.
LOGIT_BIAS_LIMIT = 1e9
_INT64 = 1 << 63
_MAX_TOKENS = 1 << 30
# Stop regexes are searched in the worker's step loop, so their work is bounded: a
# pattern of at most 256 characters, at most 16 of them, searched in the text of the
# last 32 output tokens only (a longer match is never found; ``^`` is that window's
# start), and no varying repeat inside a repeat (``(a+)+``), whose backtracking is
# exponential in the window's length (Python's ``re`` has no timeout).
STOP_REGEX_MAX_CHARS = 256
STOP_REGEX_MAX_COUNT = 16
STOP_REGEX_WINDOW = 32


@dataclass(frozen=True, slots=True)
class Range:
    """A number field's default, its valid values, and the message for the others (the
    frontend's, SGLang's words; the worker's are the same)."""

    default: float
    lo: float
    hi: float
    lo_open: bool = False
    note: str = ""  # said after the interval

    def __contains__(self, v: float) -> bool:
        return self.lo <= v <= self.hi and not (self.lo_open and v == self.lo)

    def message(self, key: str, shown: Any) -> str:
        opening = "(" if self.lo_open else "["
        return f"{key} must be in {opening}{self.lo:g}, {self.hi:g}]{self.note}, got {shown}."


# The bounded number fields of ``sampling``, in the order SGLang's verify() checks them
# (top_k, checked between min_p and the penalties, is -1 or at least 1; temperature is
# any finite number from 0).
RANGES: dict[str, Range] = {
    "top_p": Range(1.0, 0.0, 1.0, lo_open=True),
    "min_p": Range(0.0, 0.0, 1.0),
    "frequency_penalty": Range(0.0, -2.0, 2.0),
    "presence_penalty": Range(0.0, -2.0, 2.0),
    "repetition_penalty": Range(1.0, 0.0, 2.0, lo_open=True, note=" (1.0 = no penalty)"),
}

_TEMPERATURE = Range(1.0, 0.0, math.inf)
_LOGIT_BIAS = Range(0.0, -LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT)


def is_greedy(temperature: float, top_k: int) -> bool:
    """The one greedy rule. SGLang's edge rewrites temperature < 1e-6 as top_k 1 (with
    temperature 1.0); a peer that sends temperature 0 as it is means the same."""
    return top_k == 1 or temperature < GREEDY_EPS


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How the worker samples one request: every field of the wire's ``sampling`` map."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS  # the effective count (prompt length known)
    min_new_tokens: int = 0  # EOG and stop ids are masked until this many
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: the whole vocabulary
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()  # the worker ends the sequence on these strings
    stop_regex: tuple[str, ...] = ()  # ... and on a match of these (``check_stop_regex``)
    stop_token_ids: tuple[int, ...] = ()  # ascending, distinct
    ignore_eos: bool = False
    seed: int | None = None  # None: the worker draws one
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ascending ids
    n: int = 1
    grammar: tuple[str, str] | None = None  # (kind, source) the output matches (wire.grammar)

    @property
    def greedy(self) -> bool:
        return is_greedy(self.temperature, self.top_k)

    @property
    def adjusts_logits(self) -> bool:
        """Whether the row's logits change before temperature (bias, penalties, the EOG
        mask of ``min_new_tokens``)."""
        return bool(
            self.logit_bias
            or self.min_new_tokens
            or self.frequency_penalty
            or self.presence_penalty
            or self.repetition_penalty != 1.0
        )

    def to_wire(self) -> dict[str, Any]:
        """The ``sampling`` map: ``max_new_tokens`` always, then every field that differs
        from its default (the map is small on the common path)."""
        out: dict[str, Any] = {"max_new_tokens": self.max_new_tokens}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "max_new_tokens" or value == f.default:
                continue
            if f.name == "logit_bias":
                value = dict(value)
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    @classmethod
    def from_wire(cls, s: dict[str, Any], vocab_size: int) -> SamplingParams:
        """Read a ``sampling`` map; ``ValueError`` carries a message for REQ-ERROR.

        Absent and null fields take their defaults; keys outside the schema are ignored
        (an older frontend may still send them)."""
        max_new = get_int(s, "max_new_tokens", DEFAULT_MAX_NEW_TOKENS, 0, _MAX_TOKENS)
        top_k = get_int(s, "top_k", -1, -1, _INT64 - 1)
        if top_k == 0:
            raise ValueError("top_k must be -1 (disable), or at least 1, got 0.")
        temperature = _number(s, "temperature", _TEMPERATURE)
        return cls(
            max_new_tokens=max_new,
            min_new_tokens=get_int(s, "min_new_tokens", 0, 0, max_new),
            temperature=temperature,
            top_k=top_k,
            **{key: _number(s, key, r) for key, r in RANGES.items()},
            stop=_stop(s.get("stop")),
            stop_regex=_stop_regex(s.get("stop_regex")),
            stop_token_ids=tuple(
                sorted(set(token_ids(s.get("stop_token_ids") or [], "stop_token_ids", vocab_size)))
            ),
            ignore_eos=get_bool(s, "ignore_eos"),
            seed=_seed(s.get("seed")),
            logit_bias=_logit_bias(s.get("logit_bias"), vocab_size),
            n=get_int(s, "n", 1, 1, MAX_N),
            grammar=grammar_from_wire(s.get("grammar")),
        )


# -- readers for the maps of a SUBMIT entry (the worker's options use them too) ------------


def get_int(d: dict[str, Any], key: str, default: int, lo: int, hi: int) -> int:
    v = d.get(key, default)
    if v is None:
        return default
    if type(v) is not int or not lo <= v <= hi:
        raise ValueError(f"{key} must be an integer in [{lo}, {hi}], got {v!r}.")
    return v


def get_bool(d: dict[str, Any], key: str) -> bool:
    v = d.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise ValueError(f"{key} must be a boolean, got {v!r}.")
    return v


def token_ids(v: Any, key: str, vocab_size: int) -> tuple[int, ...]:
    """Token ids as raw int32 bytes (``ids``) or a list, each in ``[0, vocab_size)``."""
    if isinstance(v, bytes):
        if len(v) % 4:
            raise ValueError(f"{key} must hold whole int32 ids.")
        ids = np.frombuffer(v, dtype="<i4").tolist()
    elif isinstance(v, list) and all(type(i) is int for i in v):
        ids = v
    else:
        raise ValueError(f"{key} must be a list of token ids.")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"{key} has ids outside [0, {vocab_size - 1}]: {bad[:5]}.")
    return tuple(ids)


def _number(d: dict[str, Any], key: str, r: Range) -> float:
    v = d.get(key, r.default)
    if v is None:
        return r.default
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise ValueError(f"{key} must be a finite number, got {v!r}.")
    if v not in r:
        if r.hi == math.inf:
            raise ValueError(f"{key} must be at least {r.lo:g}, got {v!r}.")
        raise ValueError(r.message(key, repr(v)))
    return float(v)


def _stop(v: Any) -> tuple[str, ...]:
    stop = [v] if isinstance(v, str) else v or []
    if not isinstance(stop, list) or not all(isinstance(x, str) and x for x in stop):
        raise ValueError("stop must be a list of non-empty strings.")
    return tuple(stop)


def _stop_regex(v: Any) -> tuple[str, ...]:
    items = [v] if isinstance(v, str) else v or []
    if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
        raise ValueError("stop_regex must be a list of strings.")
    if len(items) > STOP_REGEX_MAX_COUNT:
        raise ValueError(f"stop_regex holds at most {STOP_REGEX_MAX_COUNT} patterns.")
    for p in items:
        check_stop_regex(p)
    return tuple(items)


def check_stop_regex(pattern: str) -> re.Pattern[str]:
    """Compile one stop regex within the bounds above; ``ValueError`` says what is wrong."""
    if not pattern:
        raise ValueError("stop_regex patterns must not be empty.")
    if len(pattern) > STOP_REGEX_MAX_CHARS:
        raise ValueError(
            f"stop_regex patterns must be at most {STOP_REGEX_MAX_CHARS} characters, "
            f"got {len(pattern)}."
        )
    try:
        compiled = re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as exc:
        raise ValueError(
            f"stop_regex {pattern!r} is not a valid regular expression: {exc}."
        ) from None
    if compiled.fullmatch(""):
        raise ValueError(f"stop_regex {pattern!r} matches the empty string.")
    if _nested_repeat(_sre.parse(pattern), False):
        raise ValueError(
            f"stop_regex {pattern!r} repeats a repeated part (like (a+)+), whose matching "
            "can take exponential time; write it without the nesting."
        )
    return compiled


_REPEATS = (_sre.MAX_REPEAT, _sre.MIN_REPEAT)


def _nested_repeat(tree: Any, inside: bool) -> bool:
    """Whether a repeat of a varying count (``+``, ``*``, ``{1,3}``) sits inside a repeat
    of more than one occurrence: the ambiguity backtracking explores exponentially."""
    for op, av in tree:
        if op in _REPEATS:
            lo, hi, sub = av
            if (inside and hi != lo) or _nested_repeat(sub, inside or hi > 1):
                return True
        elif op is _sre.POSSESSIVE_REPEAT:  # never backtracks itself; its body may
            if _nested_repeat(av[2], inside):
                return True
        elif op is _sre.BRANCH:
            if any(_nested_repeat(b, inside) for b in av[1]):
                return True
        elif op is _sre.SUBPATTERN:
            if _nested_repeat(av[3], inside):
                return True
        elif op in (_sre.ASSERT, _sre.ASSERT_NOT):
            if _nested_repeat(av[1], inside):
                return True
        elif op is _sre.ATOMIC_GROUP:
            if _nested_repeat(av, inside):
                return True
        elif op is _sre.GROUPREF_EXISTS:
            if any(b is not None and _nested_repeat(b, inside) for b in av[1:]):
                return True
    return False


def _seed(v: Any) -> int | None:
    if v is not None and (type(v) is not int or not -_INT64 <= v < _INT64):
        raise ValueError(f"seed must be a 64-bit integer, got {v!r}.")
    return v


def _logit_bias(v: Any, vocab_size: int) -> tuple[tuple[int, float], ...]:
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise ValueError("logit_bias must be a map of token id to number.")
    out = []
    for k, bias in v.items():
        if type(k) is not int or not 0 <= k < vocab_size:
            raise ValueError(f"logit_bias must has keys in [0, {vocab_size - 1}], got {k!r}.")
        name = f"logit_bias[{k}]"
        out.append((k, _number({name: bias}, name, _LOGIT_BIAS)))
    return tuple(sorted(out))
