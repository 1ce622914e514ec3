"""The options as they are given: ``lifecycle serve``'s flags (``add_flags``, read back by
``option_values``) and ``Engine(...)``'s keywords (``engine_values``), each value checked
by its option (``OPTIONS``, declared in ``lifecycle/options.py``), and the keys of an
``--api-key-file`` (``read_key_file``). The Engine has none of the HTTP listener's options
and refuses them by name.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lifecycle.option_fields import Option
from lifecycle.options import OPTIONS

__all__ = ["add_flags", "engine_values", "option_values", "read_key_file"]

_BY_NAME = {o.name: o for o in OPTIONS}


def add_flags(parser: argparse.ArgumentParser, *, server: bool = True) -> None:
    """Every option as a flag of ``parser``, in its group (``server=False``: the
    Engine's, without the HTTP listener's)."""
    groups: dict[str, Any] = {}
    for o in OPTIONS:
        if o.server and not server:
            continue
        g = groups.get(o.group) or groups.setdefault(o.group, parser.add_argument_group(o.group))
        if o.type is None:
            g.add_argument(o.flag, action="store_true", help=o.help)
        elif o.repeat:
            g.add_argument(o.flag, action="append", default=None, type=o.parse, help=o.help)
        elif o.const is not None:
            g.add_argument(
                o.flag, nargs="?", const=o.const, type=o.parse, default=o.default, help=o.help,
                metavar=o.metavar or _meta(o),
            )  # fmt: skip
        else:
            shown = o.help if o.default in (None, "") else f"{o.help} (default: %(default)s)"
            g.add_argument(
                o.flag, type=o.parse, default=o.default, help=shown, metavar=o.metavar or _meta(o)
            )


def _meta(o: Option) -> str:
    """The flag's placeholder in --help: its choices, else its name."""
    return (
        "{" + ",".join(o.worker.choices) + "}" if o.worker and o.worker.choices else o.name.upper()
    )


def option_values(args: argparse.Namespace, *, server: bool = True) -> dict[str, Any]:
    """The options' values from parsed flags (``server=False``: as ``add_flags``)."""
    return {o.name: getattr(args, o.name) for o in OPTIONS if server or not o.server}


def engine_values(model: str | None, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The Engine's keywords over the defaults; an unknown or server-only one is a
    TypeError that names it (and the nearest option)."""
    for name in kwargs:
        o = _BY_NAME.get(name)
        if o is None:
            near = difflib.get_close_matches(name, list(_BY_NAME), n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise TypeError(f"Engine() got an unknown option {name!r}{hint}")
        if o.server:
            raise TypeError(f"{name!r} is an option of the HTTP server; the Engine has none")
        if (why := o.refused(kwargs[name])) is not None:
            raise ValueError(f"Engine() option {name!r}: {why}")
    values = {o.name: o.default for o in OPTIONS}
    return {**values, **kwargs, "model": model if model is not None else kwargs.get("model")}


def read_key_file(path: str | Path) -> tuple[str, ...]:
    """``--api-key-file``: one key per line; blank lines and ``#`` comments are skipped."""
    keys = []
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keys.append(line)
    return tuple(keys)
