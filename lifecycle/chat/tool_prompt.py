"""A chat rendered with its tools and its tool turns (docs/tools.md).

A chat template that reads ``tools`` (transformers' convention) gets them as ``tools=``
and the messages as they are, tool calls' arguments as objects (as vLLM passes them; as
JSON text to a template that refuses objects).
Any other template (SmolLM2's is plain ChatML) gets plain text messages:

- the tools described by ``tools_system_block`` at the end of the first system message
  (or as a system message of their own, first), with the server's format shown
  (``<tool_call>`` blocks, Qwen2.5's, unless ``--tool-call-parser`` names another);
- an assistant message's ``tool_calls`` written after its content as the calls the
  model is asked to write (``tools.py``);
- each ``tool`` message as ``<tool_response>\\n{content}\\n</tool_response>`` in a
  ``user`` turn, consecutive ones in the same turn (Qwen2.5's layout).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from lifecycle.chat.tools import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    TOOL_RESPONSE_CLOSE,
    TOOL_RESPONSE_OPEN,
)

if TYPE_CHECKING:
    from lifecycle.chat.tool_formats import ToolFormat
    from lifecycle.chat.tool_params import ToolSpec
    from modelfile.chat import ChatTemplate

__all__ = ["OTHER_FORMAT", "TOOLS_PROMPT", "render_chat", "tool_call_block", "tools_system_block"]

TOOLS_PROMPT = """# Tools

You can call functions to help with the user's request. Each function is described by a \
JSON object inside <tools></tools>:
<tools>
{tools}
</tools>

To call a function, write one JSON object with its name and its arguments inside \
<tool_call></tool_call>, one block per call:
<tool_call>
{"name": <function name>, "arguments": <arguments object>}
</tool_call>"""


# how the prompt shows a call in a format other than Qwen2.5's
OTHER_FORMAT = """To call a function, write the call in this format (one or more calls, nothing \
else around them):
{example}"""


def _calls_text(fmt: ToolFormat, calls: list[tuple[str, Any]]) -> str:
    """Calls as ``fmt`` writes them, with its list's markers around them."""
    body = fmt.separator.join(fmt.write(name, args) for name, args in calls)
    return fmt.prefix + body + fmt.suffix


def tools_system_block(spec: ToolSpec, fmt: ToolFormat | None = None) -> str:
    """The default description of ``spec``'s tools, one JSON line each, and how to call
    them (in ``fmt``'s format; Qwen2.5's by default)."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in spec.tools)
    text = TOOLS_PROMPT.replace("{tools}", lines)
    if fmt is not None and fmt.name != "qwen25":
        example = _calls_text(fmt, [("function_name", {"argument": "value"})])
        text = text[: text.index("To call a function")] + OTHER_FORMAT.format(example=example)
    if spec.choice == "function":
        text += f"\n\nCall the function {spec.name} now."
    elif spec.choice == "required":
        text += "\n\nAnswer with function calls only."
    return text


def _arguments(raw: Any) -> Any:
    """A call's arguments as an object when they are JSON text, else as written."""
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def tool_call_block(call: dict[str, Any]) -> str:
    """One call of the history as the model writes it."""
    fn = call.get("function") or {}
    args = _arguments(fn.get("arguments", "{}"))
    name = json.dumps(fn.get("name"), ensure_ascii=False)
    body = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return f'{TOOL_CALL_OPEN}\n{{"name": {name}, "arguments": {body}}}\n{TOOL_CALL_CLOSE}'


def _history_calls(calls: list[dict[str, Any]], fmt: ToolFormat | None) -> list[str]:
    """An assistant message's calls as the model writes them."""
    if fmt is None or fmt.name == "qwen25":
        return [tool_call_block(c) for c in calls]
    named = []
    for c in calls:
        fn = c.get("function") or {}
        args = _arguments(fn.get("arguments", "{}"))
        named.append((str(fn.get("name")), args if isinstance(args, dict) else {}))
    return [_calls_text(fmt, named)]


def _plain(
    messages: Sequence[dict[str, Any]], spec: ToolSpec | None, fmt: ToolFormat | None = None
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    answers = -1  # index in out of the user turn holding the last tool responses
    for m in messages:
        if not isinstance(m, dict):  # the template says what is wrong with it
            out.append(m)
            continue
        if m.get("role") == "tool":
            text = f"{TOOL_RESPONSE_OPEN}\n{m.get('content') or ''}\n{TOOL_RESPONSE_CLOSE}"
            if out and answers == len(out) - 1:
                out[answers] = {**out[answers], "content": out[answers]["content"] + "\n" + text}
            else:
                out.append({"role": "user", "content": text})
                answers = len(out) - 1
            continue
        if m.get("role") == "assistant" and m.get("tool_calls"):
            parts = [m.get("content") or "", *_history_calls(m["tool_calls"], fmt)]
            m = {"role": "assistant", "content": "\n".join(p for p in parts if p)}
        out.append(m)
    if spec is not None:
        block = tools_system_block(spec, fmt)
        if out and out[0].get("role") == "system":
            first = out[0].get("content") or ""
            out[0] = {**out[0], "content": f"{first}\n\n{block}" if first else block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _as_text(raw: Any) -> Any:
    return raw if isinstance(raw, str) else json.dumps(raw, ensure_ascii=False)


def _native(messages: Sequence[dict[str, Any]], as_text: bool = False) -> list[dict[str, Any]]:
    """The messages with each call's arguments as an object (``as_text``: as JSON text)."""
    shape = _as_text if as_text else _arguments
    out = []
    for m in messages:
        if isinstance(m, dict) and m.get("tool_calls"):
            calls = [
                {**c, "function": {**c["function"],
                                   "arguments": shape(c["function"].get("arguments"))}}
                for c in m["tool_calls"]
            ]  # fmt: skip
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def _text(m: Any) -> Any:
    """``m`` with its content parts joined into one text."""
    if isinstance(m, dict) and isinstance(m.get("content"), list):
        return {**m, "content": "".join(p.get("text", "") for p in m["content"])}
    return m


def render_chat(
    template: ChatTemplate,
    messages: Sequence[dict[str, Any]],
    *,
    tools: ToolSpec | None = None,
    add_generation_prompt: bool = True,
    continue_final: bool = False,
    variables: Mapping[str, Any] | None = None,
    fmt: ToolFormat | None = None,
) -> str:
    """The prompt text of a chat and its tools (``tools`` None: no tools rendered; ``fmt``:
    the format a template that does not render tools asks for, Qwen2.5's by default).
    Content parts reach a template that loops over them, else their text joined;
    ``continue_final``: the text stops after the last message's content (transformers'
    ``continue_final_message``); ``variables``: ``chat_template_kwargs``."""
    if not template.reads_content_parts:
        messages = [_text(m) for m in messages]
    kw: dict[str, Any] = {"continue_final_message": continue_final, "variables": variables}
    if template.mentions_tools:
        listed = list(tools.tools) if tools is not None else None
        try:
            return template.render(_native(messages), add_generation_prompt, tools=listed, **kw)
        except ValueError:  # ChatTemplateError (modelfile stays a type-only import)
            if not any(isinstance(m, dict) and m.get("tool_calls") for m in messages):
                raise
        # a template that takes arguments only as JSON text (functionary v3.2's)
        return template.render(_native(messages, True), add_generation_prompt, tools=listed, **kw)
    return template.render(_plain(messages, tools, fmt), add_generation_prompt, **kw)
