"""What ``--model`` says of the models a server serves (issue 55, point 2): given once,
repeated, or ``NAME=SPEC`` to name one in the APIs; each model after the first is a
``ModelSpec``, resolved (a Hub repo id fetched) once, in ``runtime.app_config``.

Each model is a slot: its own ``AppConfig`` (``lifecycle.app.slot_configs``), hence its
own ``Runtime`` (worker or ``--dp`` workers, tokenizer, chat template, frontend) and its
own routes; ``lifecycle.api.model_routes`` picks one per request. One model is the
one-slot case. Small on purpose: ``runtime`` imports it, and it imports nothing of
``lifecycle``, so no import goes in a circle.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ModelSpec", "model_arguments", "split_name"]


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model served beside the first: its local path (a Hub repo id already
    fetched; None: the bundled default), the repo it came from, and its name in the
    APIs (``--model NAME=SPEC``; None: the one ``runtime.model_id`` gives)."""

    path: str | None
    repo: str | None = None
    name: str | None = None


def model_arguments(value: str | Sequence[str] | None) -> list[str]:
    """``--model`` given once, repeated (a list), or not at all (the Engine passes a
    string)."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def split_name(arg: str) -> tuple[str | None, str]:
    """``NAME=SPEC`` as its name and spec; a spec alone has no name. A name holds no
    ``/`` (a path or repo id with ``=`` in a later part stays whole)."""
    name, sep, spec = arg.partition("=")
    if sep and name and "/" not in name and spec:
        return name, spec
    return None, arg
