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
from pathlib import Path

__all__ = ["ModelSpec", "model_arguments", "models_in", "split_name"]


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


def models_in(folder: str | None) -> list[str]:
    """``--models-dir``: each GGUF file and each model folder (one with a config.json)
    in ``folder``, by name, as ``NAME=PATH`` (the file's name without ``.gguf``, the
    folder's name). A folder that is missing or holds no model: ValueError."""
    if folder is None:
        return []
    where = Path(folder).expanduser()
    if not where.is_dir():
        raise ValueError(f"--models-dir {folder}: no such folder")
    found = [
        f"{p.name.removesuffix('.gguf')}={p}"
        for p in sorted(where.iterdir())
        if (p.is_file() and p.suffix == ".gguf") or (p.is_dir() and (p / "config.json").is_file())
    ]
    if not found:
        raise ValueError(f"--models-dir {folder}: no GGUF file or model folder in it")
    return found
