"""An option of ``lifecycle serve`` and ``lifecycle.Engine`` (``Option``: its flag, help,
type, default and checks), and the declarators that make a field of ``AppConfig`` one
(``lifecycle/options.py`` declares them all).

``option(...)`` makes a field the option of its name, read as the field's annotation
says; ``forwarded(...)`` one of the worker's options (``wire.worker_options``), which
``lifecycle serve`` passes on; ``fed_by(...)`` a field computed from the options it
lists. They leave their options in the field's metadata, since a field's own is made only
once its name and annotation are known; ``declared`` reads a dataclass's back in the
order of its fields, which is how ``OPTIONS`` is made.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from types import NoneType, UnionType
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints, overload

from wire.worker_options import WORKER_OPTIONS, WorkerOption, refused_value, value_parser

__all__ = ["Option", "declared", "fed_by", "forwarded", "option"]

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class Option:
    name: str  # the Engine keyword; the flag is --name-with-dashes
    help: str
    group: str
    type: Callable[[str], Any] | None = str  # None: a switch (store_true)
    default: Any = None
    repeat: bool = False  # the flag may be given several times (a list)
    server: bool = False  # the HTTP listener's: not an Engine option
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    minimum: float | None = None
    maximum: float | None = None
    form: tuple[str, str] | None = None  # a pattern the value matches, and it in words
    worker: WorkerOption | None = None  # a forwarded option: the worker's, whose checks apply
    const: Any = None  # the flag's value when given without one (``--ray`` alone)
    into: str | None = None  # the AppConfig field it sets (None: the process's, _PROCESS)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def refused(self, value: Any) -> str | None:
        """Why ``value`` is not one this option takes (``refused_value``), or None; a list
        (a repeated flag) item by item."""
        if self.worker is not None:
            return self.worker.refused(value)
        for item in value if isinstance(value, list | tuple) else [value]:
            why = refused_value(item, self.choices, self.minimum, self.maximum, self.form)
            if why is not None:
                return why
        return None

    def parse(self, text: str) -> Any:
        """A flag's text as the option's value (``wire.worker_options.value_parser``)."""
        assert self.type is not None
        return value_parser(self.type, self.refused)(text)


# The keys of a field's metadata: how its option is made once the field's name and
# annotation are known (``option``, ``forwarded``), and the options it is made from.
_OPTION, _INPUTS = "lifecycle.option", "lifecycle.inputs"
_WORKER_OPTIONS = {o.name: o for o in WORKER_OPTIONS}


@overload
def option(help: str, group: str, *, default: _T, **kw: Any) -> _T: ...
@overload
def option(help: str, group: str, **kw: Any) -> Any: ...
def option(help: str, group: str, *, default: Any = None, **kw: Any) -> Any:
    """An ``AppConfig`` field that is an option of the same name, taken as it is. Its type
    is the annotation's (``int | None``: an integer; ``bool``: a switch) unless ``type``
    says how to read the flag's text; a repeatable option's flag starts unset (None)."""

    def make(name: str, annotation: Any, default: Any) -> Option:
        rest = {k: v for k, v in kw.items() if k != "type"}
        read = kw["type"] if "type" in kw else _reader(annotation)
        unset = None if kw.get("repeat") else default
        return Option(name, help, group, type=read, default=unset, into=name, **rest)

    return field(default=default, metadata={_OPTION: make})


def forwarded(group: str) -> Any:
    """A worker option ``lifecycle serve`` offers and passes on (``runtime.worker_args``)
    as the field of its name: its help, type and checks are the worker's
    (``wire.worker_options``); unset (None), the worker's own default applies."""

    def make(name: str, annotation: Any, default: Any) -> Option:
        o = _WORKER_OPTIONS[name]
        assert o.forwarded, name
        choices = f"{' | '.join(o.choices)}: " if o.choices else ""
        help = choices + o.help_with_default
        return Option(name, help, group, type=o.type, worker=o, into=name)

    return field(default=None, metadata={_OPTION: make})


def fed_by(*inputs: Option, default: _T) -> _T:
    """An ``AppConfig`` field computed from these options (``runtime.app_config``)."""
    return field(default=default, metadata={_INPUTS: inputs})


def _reader(annotation: Any) -> Callable[[str], Any] | None:
    """How a flag's text becomes a field's value: its annotation's type, less None (the
    items' type, for a tuple); a ``bool``: None, a switch."""
    union = get_origin(annotation) in (Union, UnionType)
    kind = next(k for k in get_args(annotation) if k is not NoneType) if union else annotation
    if get_origin(kind) is tuple:  # tuple[str, ...]: str
        kind = get_args(kind)[0]
    if kind is bool:
        return None
    assert kind in (str, int, float), f"an option's field of type {annotation}: give type="
    return kind


def declared(config: type) -> tuple[Option, ...]:
    """The options ``config``'s fields declare, in their order: a field's own, then those
    it is fed by."""
    hints = get_type_hints(config)
    found: list[Option] = []
    for f in fields(config):
        if (make := f.metadata.get(_OPTION)) is not None:
            found.append(make(f.name, hints[f.name], f.default))
        found += (replace(o, into=f.name) for o in f.metadata.get(_INPUTS, ()))
    return tuple(found)
