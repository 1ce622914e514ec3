"""What the request parsers do with a body field they do not know.

Clients send fields a server has never heard of: the official OpenAI SDK's newer
parameters (``prompt_cache_key``, ``safety_identifier``, ``verbosity``), other servers'
(``cache_prompt``), typos. By default such a field is accepted and ignored: it is logged
once per field name (where it was seen, and that ``--strict-fields`` refuses it) and
counted (``lifecycle_unknown_fields_total``). With ``--strict-fields`` every unknown
field is a 400 naming it, as before. A field we know and do not implement, whose effect
on the output would be lost, is always a 400 (each parser's own unsupported list): this
policy is only for names nobody here knows.

One policy per process (``install``), set by the ``Runtime`` from its options, read by
every parser: the native body and its ``sampling_params``, the OpenAI bodies,
``/encode``, ``/v1/embeddings``, ``/v1/responses`` and ``/v1/score``.
"""

from __future__ import annotations

import logging
import threading

__all__ = ["UnknownFields", "accept_unknown", "install", "policy"]

log = logging.getLogger("lifecycle.fields")


class UnknownFields:
    """``strict``: refuse unknown fields (400); else accept, log once per name, count."""

    __slots__ = ("strict", "counts", "_lock")

    def __init__(self, strict: bool = False) -> None:
        self.strict = strict
        self.counts: dict[str, int] = {}  # "where.name" -> requests that sent it
        self._lock = threading.Lock()  # the Engine's callers may parse from threads

    def accept(self, where: str, name: str) -> bool:
        """Whether a request may go on with unknown field ``name`` of ``where`` (a
        route's body, or ``sampling_params``); True means it is ignored."""
        if self.strict:
            return False
        key = f"{where}.{name}"
        with self._lock:
            seen = self.counts.get(key, 0)
            self.counts[key] = seen + 1
        if not seen:
            log.warning(
                "ignoring unknown field %r in %s (said once per field; --strict-fields "
                "refuses such requests)",
                name,
                where,
            )
        return True


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
