"""Where option values come from besides flags and keywords: a config file (TOML, or YAML
when PyYAML is installed) and the environment (``LIFECYCLE_MAX_RUNNING=16``).

The keys are the options of ``lifecycle/options.py`` (``max_running``; ``max-running``
also reads), nothing else: an unknown key in a file is an error that names it. The order,
last wins: the options' defaults, the file, the environment, then flags (the CLI) or
keywords (the Engine). Environment variables that are not option names are left alone
(other parts read ``LIFECYCLE_*`` too).
"""

from __future__ import annotations

import difflib
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lifecycle.option_fields import Option
from lifecycle.options import OPTIONS

__all__ = ["ConfigError", "ENV_PREFIX", "env_values", "file_values", "layered"]

ENV_PREFIX = "LIFECYCLE_"
_BY_NAME = {o.name: o for o in OPTIONS}
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}


class ConfigError(ValueError):
    """A config file or environment value that cannot be an option's value."""


def file_values(path: str | os.PathLike[str], *, server: bool = True) -> dict[str, Any]:
    """The options a config file sets, checked and typed."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"config file {p}: {exc.strerror or exc}") from None
    raw = _parse(p, text)
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {p}: expected a table of options, got {type(raw).__name__}")
    out = {}
    for key, value in raw.items():
        o = _option(str(key).replace("-", "_"), f"config file {p}", server)
        out[o.name] = _typed(o, value, f"config file {p}: {key}")
    return out


def env_values(environ: Mapping[str, str], *, server: bool = True) -> dict[str, Any]:
    """The options ``LIFECYCLE_<NAME>`` variables set (strings converted as flags are;
    a switch reads 1/true/yes/on or 0/false/no/off; a repeatable option, a comma list)."""
    out = {}
    for o in OPTIONS:
        var = ENV_PREFIX + o.name.upper()
        if var not in environ or (o.server and not server):
            continue
        out[o.name] = _from_string(o, environ[var], var)
    return out


def layered(
    config: str | os.PathLike[str] | None, environ: Mapping[str, str], *, server: bool = True
) -> dict[str, Any]:
    """The file's values under the environment's: what the flags or keywords start from."""
    values = file_values(config, server=server) if config else {}
    values.update(env_values(environ, server=server))
    return values


def _parse(p: Path, text: str) -> Any:
    if p.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ConfigError(f"config file {p}: YAML needs PyYAML (pip install pyyaml)") from None
        try:
            return yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {p}: {exc}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {p}: {exc}") from None


def _option(name: str, where: str, server: bool) -> Option:
    o = _BY_NAME.get(name)
    if o is None:
        near = difflib.get_close_matches(name, list(_BY_NAME), n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise ConfigError(f"{where}: unknown option {name!r}{hint}")
    if o.server and not server:
        raise ConfigError(f"{where}: {name!r} is an option of the HTTP server")
    return o


def _typed(o: Option, value: Any, where: str) -> Any:
    """A file value as the option's type; a string also reads as a flag's would."""
    if isinstance(value, str) and not (o.type is str and not o.repeat):
        return _from_string(o, value, where)
    if o.type is None:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if o.repeat:
        items = value if isinstance(value, list) else [value]
        if not all(isinstance(v, str) for v in items):
            raise ConfigError(f"{where}: expected a string or a list of strings, got {value!r}")
        return list(items)
    if value is None or (o.type is str and isinstance(value, str)):
        return value
    if o.type is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if o.type is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    raise ConfigError(f"{where}: expected {_kind(o)}, got {value!r}")


def _from_string(o: Option, text: str, where: str) -> Any:
    if o.type is None:
        low = text.strip().lower()
        if low in _TRUE or low in _FALSE:
            return low in _TRUE
        raise ConfigError(f"{where}: expected true or false, got {text!r}")
    if o.repeat:
        return [part.strip() for part in text.split(",") if part.strip()]
    try:
        return o.type(text)
    except ValueError:
        raise ConfigError(f"{where}: expected {_kind(o)}, got {text!r}") from None


def _kind(o: Option) -> str:
    return "an integer" if o.type is int else "a number" if o.type is float else "a string"
