"""``lifecycle serve --extend MODULE:FUNCTION``: an app's own routes beside the built-in
ones.

``FUNCTION(app)`` is called once, after the built-in routes are installed and before the
server answers anything but ``/health``, with an ``Extension``: its ``router`` is the
one the built-in routes are on, so a route added there gets what theirs get (API keys
and the public/admin rules, a request id echoed as ``X-Request-Id``, the request
metrics labelled by its route template, the access log line), and its ``frontend``
runs generation calls whose requests are traced as every other. docs/operating.md,
"Adding routes".

The names are checked when ``serve`` starts, before it listens: a module that does not
import or a name that is not a callable is one line and exit 2.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lifecycle.api.native import NativeAPI
    from lifecycle.api.routes import AppRouter
    from lifecycle.core.frontend import Frontend
    from lifecycle.runtime import AppConfig

__all__ = ["Extension", "ExtensionError", "resolve_extension"]


class ExtensionError(ValueError):
    """``--extend`` names nothing that can be called."""


@dataclass(frozen=True, slots=True)
class Extension:
    """What an ``--extend`` function is given."""

    router: AppRouter  # add(methods, path, handler): keys, ids, metrics, access log
    native: NativeAPI  # the SGLang-native API (its routes' handlers, server_args)
    frontend: Frontend  # the live calls and the worker link
    config: AppConfig


def resolve_extension(spec: str) -> Callable[[Extension], Any]:
    """``MODULE:FUNCTION`` as the callable it names; ``ExtensionError`` otherwise."""
    module_name, sep, name = spec.partition(":")
    if not sep or not module_name or not name:
        raise ExtensionError(f"--extend {spec}: expected MODULE:FUNCTION")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or the module's own error at import
        raise ExtensionError(f"--extend {spec}: cannot import {module_name}: {exc}") from exc
    target: Any = module
    for part in name.split("."):
        target = getattr(target, part, None)
    if not callable(target):
        raise ExtensionError(f"--extend {spec}: {module_name} has no callable {name}")
    return target  # type: ignore[no-any-return]
