"""A chat rendered with its tools and its tool turns (docs/tools.md).

A chat template that reads ``tools`` (transformers' convention) gets them as ``tools=``
and the messages as they are, tool calls' arguments as objects (as vLLM passes them).
Any other template (SmolLM2's is plain ChatML) gets plain text messages:

- the tools described by ``tools_system_block`` at the end of the first system message
  (or as a system message of their own, first);
- an assistant message's ``tool_calls`` written after its content as the
  ``<tool_call>`` blocks the model is asked to write (``tools.py``);
- each ``tool`` message as ``<tool_response>\\n{content}\\n</tool_response>`` in a
  ``user`` turn, consecutive ones in the same turn (Qwen2.5's layout).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lifecycle.api.tools import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    TOOL_RESPONSE_CLOSE,
    TOOL_RESPONSE_OPEN,
)

if TYPE_CHECKING:
    from lifecycle.api.tool_params import ToolSpec
    from modelfile.chat import ChatTemplate

__all__ = ["TOOLS_PROMPT", "render_chat", "tool_call_block", "tools_system_block"]

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


def tools_system_block(spec: ToolSpec) -> str:
    """The default description of ``spec``'s tools, one JSON line each."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in spec.tools)
    text = TOOLS_PROMPT.replace("{tools}", lines)
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


def _plain(messages: Sequence[dict[str, Any]], spec: ToolSpec | None) -> list[dict[str, Any]]:
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
            parts = [m.get("content") or "", *(tool_call_block(c) for c in m["tool_calls"])]
            m = {"role": "assistant", "content": "\n".join(p for p in parts if p)}
        out.append(m)
    if spec is not None:
        block = tools_system_block(spec)
        if out and out[0].get("role") == "system":
            first = out[0].get("content") or ""
            out[0] = {**out[0], "content": f"{first}\n\n{block}" if first else block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _native(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        if isinstance(m, dict) and m.get("tool_calls"):
            calls = [
                {**c, "function": {**c["function"],
                                   "arguments": _arguments(c["function"].get("arguments"))}}
                for c in m["tool_calls"]
            ]  # fmt: skip
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def render_chat(
    template: ChatTemplate,
    messages: Sequence[dict[str, Any]],
    *,
    tools: ToolSpec | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """The prompt text of a chat and its tools (``tools`` None: no tools rendered)."""
    if template.mentions_tools:
        listed = list(tools.tools) if tools is not None else None
        return template.render(_native(messages), add_generation_prompt, tools=listed)
    return template.render(_plain(messages, tools), add_generation_prompt)
