"""``tools``, ``tool_choice``, ``parallel_tool_calls`` and the tool fields of chat messages,
validated once at the edge; the grammar that enforces a forcing ``tool_choice``.

Errors are ``ToolParamError`` (a message and the OpenAI field it names); ``parse_chat``
turns them into OpenAI's 400. ``tool_choice`` ``"none"`` (the default without tools)
means the request runs as if it had no tools: they are not rendered and the output is not
parsed. ``"required"`` and a named function set a Lark grammar (``wire.grammar``) that
admits only calls in the format of ``tools.py``, each call's arguments matching its
function's ``parameters`` schema (embedded with ``%json``, or each value's where a format tags them), in the family's
format (``tool_formats``: Qwen2.5's by default); ``"auto"`` constrains nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from lifecycle.chat.formats.base import lark_string
from lifecycle.chat.tool_formats import TOOL_FORMATS, ToolFormat
from wire.grammar import check_grammar

__all__ = [
    "ToolParamError",
    "ToolSpec",
    "check_tool_answers",
    "message_tool_calls",
    "parse_tools",
    "tool_grammar",
]

_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names
_NO_PARAMETERS = {"type": "object", "properties": {}}
_CHOICE_SHAPE = (
    "tool_choice must be 'none', 'auto', 'required' or "
    '{"type": "function", "function": {"name": "..."}}.'
)


class ToolParamError(ValueError):
    """A bad tool field: ``param`` is the OpenAI field it names."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message, self.param = message, param


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """The tools a request renders and whose calls its output is read for."""

    tools: tuple[dict[str, Any], ...]  # {"type": "function", "function": {name, ...}}
    choice: str  # "auto" | "required" | "function" (a named function)
    name: str | None = None  # the named function
    parallel: bool = True

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t["function"]["name"] for t in self.tools)

    @property
    def schemas(self) -> dict[str, dict[str, Any]]:
        """Each tool's parameters schema by its name (how tagged formats type values)."""
        return {t["function"]["name"]: t["function"]["parameters"] for t in self.tools}

    @property
    def forced(self) -> bool:
        return self.choice != "auto"


def _bad(message: str, param: str = "tools") -> ToolParamError:
    return ToolParamError(message, param)


def _function(tool: Any, i: int) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise _bad(f"tools[{i}] must be an object with type 'function'.")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise _bad(f"tools[{i}].function must be an object with a name.")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise _bad(f"tools[{i}].function.name must be 1 to 64 letters, digits, underscores "
                   f"or dashes, got {name!r}.")  # fmt: skip
    out: dict[str, Any] = {"name": name}
    description = fn.get("description")
    if description is not None:
        if not isinstance(description, str):
            raise _bad(f"tools[{i}].function.description must be a string.")
        out["description"] = description
    parameters = fn.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise _bad(f"tools[{i}].function.parameters must be a JSON Schema object.")
    out["parameters"] = parameters if parameters is not None else dict(_NO_PARAMETERS)
    if fn.get("strict") is not None and not isinstance(fn.get("strict"), bool):
        raise _bad(f"tools[{i}].function.strict must be a boolean.")
    return {"type": "function", "function": out}


def _tools(raw: Any) -> tuple[dict[str, Any], ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise _bad("tools must be a list of function tools.")
    tools = tuple(_function(t, i) for i, t in enumerate(raw))
    seen: set[str] = set()
    for i, t in enumerate(tools):
        name = t["function"]["name"]
        if name in seen:
            raise _bad(f"tools[{i}].function.name {name!r} is defined twice.")
        seen.add(name)
    return tools


def _choice(raw: Any, tools: tuple[dict[str, Any], ...]) -> tuple[str, str | None]:
    if raw is None:
        return ("auto" if tools else "none"), None
    if isinstance(raw, str):
        if raw not in ("none", "auto", "required"):
            raise _bad(_CHOICE_SHAPE, "tool_choice")
        if raw == "required" and not tools:
            raise _bad("tool_choice 'required' needs tools.", "tool_choice")
        return raw, None
    fn = raw.get("function") if isinstance(raw, dict) and raw.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise _bad(_CHOICE_SHAPE, "tool_choice")
    names = [t["function"]["name"] for t in tools]
    if not names:
        raise _bad(f"tool_choice names the function {name!r} but no tools were given.",
                   "tool_choice")  # fmt: skip
    if name not in names:
        raise _bad(f"tool_choice names the function {name!r}, which is not in tools "
                   f"({', '.join(names)}).", "tool_choice")  # fmt: skip
    return "function", name


def parse_tools(body: dict[str, Any]) -> ToolSpec | None:
    """The request's tools; None when it has none or ``tool_choice`` is ``"none"``."""
    tools = _tools(body.get("tools"))
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad(f"parallel_tool_calls must be a boolean, got {parallel!r}.",
                   "parallel_tool_calls")  # fmt: skip
    choice, name = _choice(body.get("tool_choice"), tools)
    if choice == "none" or not tools:
        return None
    return ToolSpec(tools, choice, name, parallel is not False)


def _call_rule(tool: dict[str, Any], fmt: ToolFormat) -> str:
    """One call of ``tool`` in ``fmt``'s format."""
    return fmt.call_rule(tool["function"]["name"], tool["function"]["parameters"])


def tool_grammar(spec: ToolSpec, fmt: ToolFormat | None = None) -> str:
    """The Lark grammar of a forcing ``tool_choice`` in ``fmt``'s format (``"required"``:
    one call or more of any tool, one when ``parallel_tool_calls`` is false; a named
    function: exactly one call of it), checked by llguidance; ``ToolParamError`` says what
    it found wrong (a parameters schema it cannot compile)."""
    fmt = fmt or TOOL_FORMATS["qwen25"]
    if spec.choice == "function":
        tools = tuple(t for t in spec.tools if t["function"]["name"] == spec.name)
        calls = "call"
    else:
        tools = spec.tools
        calls = "call" if not spec.parallel else f"call ({lark_string(fmt.separator)} call)*"
    ends = [lark_string(x) for x in (fmt.prefix, fmt.suffix)]
    start = "start: " + " ".join([ends[0], calls, ends[1]] if fmt.prefix else [calls])
    rules = [f"call_{i}: {_call_rule(t, fmt)}" for i, t in enumerate(tools)]
    alternatives = " | ".join(f"call_{i}" for i in range(len(tools)))
    text = "\n".join(["%llguidance {}", start, f"call: {alternatives}", *rules]) + "\n"
    try:
        check_grammar("lark", text)
    except ValueError as exc:
        raise _bad(f"tools: a parameters schema cannot be enforced: {exc}") from None
    return text


def _arguments(raw: Any, where: str) -> str | dict[str, Any]:
    # OpenAI sends JSON text; transformers' and vLLM's clients may send the object
    if not isinstance(raw, str | dict):
        raise _bad(f"{where}.function.arguments must be a string (JSON) or an object.",
                   "messages")  # fmt: skip
    return raw


def message_tool_calls(raw: Any, i: int) -> list[dict[str, Any]]:
    """``messages[i].tool_calls`` of an assistant message, in OpenAI's shape."""
    if not isinstance(raw, list):
        raise _bad(f"messages[{i}].tool_calls must be a list of tool calls.", "messages")
    out = []
    for j, call in enumerate(raw):
        where = f"messages[{i}].tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(fn, dict)
            or call.get("type", "function") != "function"
            or not isinstance(call.get("id"), str)
            or not isinstance(fn.get("name"), str)
        ):
            raise _bad(f"{where} must be an object with an id, type 'function' and a "
                       "function with a name and arguments.", "messages")  # fmt: skip
        args = _arguments(fn.get("arguments"), where)
        out.append({"id": call["id"], "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})  # fmt: skip
    return out


def check_tool_answers(messages: list[dict[str, Any]]) -> None:
    """Every ``tool`` message answers a call of an earlier assistant message (as OpenAI
    requires), by its ``tool_call_id``."""
    ids: set[str] = set()
    for i, m in enumerate(messages):
        ids.update(c["id"] for c in m.get("tool_calls", ()))
        if m["role"] != "tool":
            continue
        answered = m.get("tool_call_id")
        if not isinstance(answered, str):
            raise _bad(f"messages[{i}] (role 'tool') needs a tool_call_id.", "messages")
        if answered not in ids:
            raise _bad(f"messages[{i}].tool_call_id {answered!r} answers no tool call of an "
                       "earlier assistant message.", "messages")  # fmt: skip
