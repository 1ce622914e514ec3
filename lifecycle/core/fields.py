"""What the request parsers do with a body field they do not know.

Clients send fields a server has never heard of: the official OpenAI SDK's newer
parameters (``prompt_cache_key``, ``safety_identifier``, ``verbosity``), other servers'
(``cache_prompt``), typos. By default such a field is accepted and ignored: it is logged
once per field name (where it was seen, and that ``--strict-fields`` refuses it) and
counted (``lifecycle_unknown_fields_total``). With ``--strict-fields`` every unknown
field is a 400 naming it, as before. A field we know and do not implement, whose effect
on the output would be lost, is always a 400 (each parser's own unsupported list): this
policy is only for names nobody here knows. It is not for the keys of native
``sampling_params`` either: every one of those changes the output, so an unknown one is
a 400 naming it, as SGLang refuses it (``lifecycle.core.sampling``; issue 56, point 5).

The names are the client's choice, so nothing they grow is left to it (issue 54, point
11: 200,000 invented names made 200,000 series, 30.8 MB of /metrics and 200,000 log
lines). Only the first ``NAMES_KEPT`` distinct names of at most ``NAME_CHARS``
characters are counted and logged by name; any other is counted under
``<where>.(other)`` (``where`` is ours: a route) and the log says
how many such fields it ignored in one line at most every ``SUMMARY_EVERY_S`` seconds.
So the counter holds at most ``NAMES_KEPT`` + one key per ``where`` and the log at most
``NAMES_KEPT`` lines plus one per interval, whatever the clients send.

One policy per process (``install``), set by the ``Runtime`` from its options, read by
every parser: the native body, the OpenAI bodies,
``/encode``, ``/v1/embeddings``, ``/v1/responses`` and ``/v1/score``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

__all__ = [
    "NAMES_KEPT",
    "NAME_CHARS",
    "OTHER",
    "SUMMARY_EVERY_S",
    "UnknownFields",
    "accept_unknown",
    "install",
    "policy",
]

log = logging.getLogger("lifecycle.fields")

NAMES_KEPT = 64  # distinct "where.name" keys counted and logged by name
NAME_CHARS = 64  # a longer name is never a label nor a log line of its own
SUMMARY_EVERY_S = 60.0  # at most one "ignored N more" line per this many seconds
OTHER = "(other)"  # the name every field beyond the cap is counted under


class UnknownFields:
    """``strict``: refuse unknown fields (400); else accept, count and log, bounded: by
    name for the first ``NAMES_KEPT`` names, under ``<where>.(other)`` beyond them."""

    __slots__ = ("strict", "counts", "_named", "_unnamed", "_summary_at", "_clock", "_lock")

    def __init__(self, strict: bool = False, clock: Callable[[], float] = time.monotonic) -> None:
        self.strict = strict
        # "where.name" (or "where.(other)") -> times a request sent it; bounded, see above
        self.counts: dict[str, int] = {}
        self._named = 0  # keys in counts that are a client's name, at most NAMES_KEPT
        self._unnamed = 0  # fields counted under (other) since the last summary line
        self._summary_at = -math.inf  # when the last summary line was logged
        self._clock = clock
        self._lock = threading.Lock()  # the Engine's callers may parse from threads

    def accept(self, where: str, name: str) -> bool:
        """Whether a request may go on with unknown field ``name`` of ``where`` (a
        route's body); True means it is ignored."""
        if self.strict:
            return False
        key = f"{where}.{name}"
        summary = 0
        with self._lock:
            seen = self.counts.get(key)
            if seen is not None:
                self.counts[key] = seen + 1
                return True
            if self._named < NAMES_KEPT and len(name) <= NAME_CHARS:
                self.counts[key] = 1
                self._named += 1
                first_of_name = True
            else:
                other = f"{where}.{OTHER}"
                self.counts[other] = self.counts.get(other, 0) + 1
                self._unnamed += 1
                first_of_name = False
                summary = self._take_summary()
        if first_of_name:
            log.warning(
                "ignoring unknown field %r in %s (said once per field; --strict-fields "
                "refuses such requests)",
                name,
                where,
            )
        elif summary:
            log.warning(
                "ignored %d more unknown fields (past the first %d names, or names over %d "
                "characters; counted as '<route>.%s', said at most every %gs; "
                "--strict-fields refuses such requests)",
                summary,
                NAMES_KEPT,
                NAME_CHARS,
                OTHER,
                SUMMARY_EVERY_S,
            )
        return True

    def snapshot(self) -> dict[str, int]:
        """A copy of ``counts`` (for a scrape, which must not iterate a dict that a
        parsing thread may be growing)."""
        with self._lock:
            return dict(self.counts)

    def _take_summary(self) -> int:
        """How many fields the summary line due now reports (0: none due). Under the lock."""
        now = self._clock()
        if now - self._summary_at < SUMMARY_EVERY_S:
            return 0
        self._summary_at, taken, self._unnamed = now, self._unnamed, 0
        return taken


_policy = UnknownFields()


def install(new: UnknownFields) -> UnknownFields:
    """Make ``new`` the process's policy; returns the previous one."""
    global _policy
    previous, _policy = _policy, new
    return previous


def policy() -> UnknownFields:
    return _policy


def accept_unknown(where: str, name: str) -> bool:
    """The process's policy on unknown field ``name`` of ``where``."""
    return _policy.accept(where, name)
