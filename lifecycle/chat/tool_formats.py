"""Each model family's tool-call format (docs/tools.md, "Formats"), under the names SGLang
gives its parsers: how a call is found in the text, read back, streamed, and written by
the grammar of a forcing ``tool_choice``.

A format names the texts that open a call region (``openers``, anywhere in the content;
``lead_openers``, only at the start of the output or right after a call), decides a region
with ``take`` and reads the calls begun in it with ``partial`` (``formats.base``).
``tools.ToolCallParser`` drives it as the text streams. Nothing here does I/O.

===============  ===========================================================================
qwen25           ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`` (Qwen2.5,
(qwen, hermes)   Qwen3, Hermes)
llama3           ``{"name": "f", "parameters": {...}}`` at the start, or after
                 ``<|python_tag|>``; several separated by ``;`` (Llama 3.1-3.3 JSON calls)
pythonic         ``[f(a=1, b="x"), g()]``, optionally in ``<|python_start|>``...
(llama4)         ``<|python_end|>`` (Llama 3.2/3.3 pythonic, Llama 4)
mistral          ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`` (v3 tokenizers) and
                 ``[TOOL_CALLS]f[ARGS]{...}`` (v11+; ``[CALL_ID]id`` after the name skipped)
deepseekv3       ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\\n```json
(deepseek)       \\n{...}\\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>`` (V3, R1)
deepseekv31      ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}<｜tool▁call▁end｜>
                 <｜tool▁calls▁end｜>`` (V3.1; both DeepSeek formats read both)
qwen3_coder      ``<tool_call>\\n<function=f>\\n<parameter=a>\\n1\\n</parameter>\\n</function>
                 \\n</tool_call>`` (Qwen3-Coder; values typed by the schema)
glm45 (glm)      ``<tool_call>f\\n<arg_key>a</arg_key>\\n<arg_value>1</arg_value>\\n</tool_call>``
                 (GLM-4.5, 4.6; values typed by the schema)
kimi_k2          ``<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0
                 <|tool_call_argument_begin|>{...}<|tool_call_end|><|tool_calls_section_end|>``
phi4_mini_json   ``functools[{"name": "f", "arguments": {...}}, ...]`` (Phi-4-mini; vLLM's name)
===============  ===========================================================================
"""

from __future__ import annotations

from lifecycle.chat.formats.base import (
    WHITESPACE,
    Partial,
    Schemas,
    Take,
    ToolFormat,
    json_end,
    json_text,
)
from lifecycle.chat.formats.json_calls import (
    MISTRAL_CALLS,
    PYTHON_TAG,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    Llama3,
    Mistral,
    Phi4MiniJson,
    Qwen25,
)
from lifecycle.chat.formats.pythonic import PY_START, Pythonic
from lifecycle.chat.formats.sections import DeepSeekV3, DeepSeekV31, KimiK2
from lifecycle.chat.formats.xml_calls import Glm45, Qwen3Coder

__all__ = [
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "TOOL_FORMATS",
    "TOOL_FORMAT_ALIASES",
    "WHITESPACE",
    "Partial",
    "Schemas",
    "Take",
    "ToolFormat",
    "detect_tool_format",
    "json_end",
    "json_text",
    "tool_format",
]

TOOL_FORMATS: dict[str, ToolFormat] = {
    f.name: f
    for f in (Qwen25(), Llama3(), Pythonic(), Mistral(), DeepSeekV3(), DeepSeekV31(),
              Qwen3Coder(), Glm45(), KimiK2(), Phi4MiniJson())
}  # fmt: skip
# the other names SGLang (and this server before) gave the same formats
TOOL_FORMAT_ALIASES = {"qwen": "qwen25", "hermes": "qwen25", "llama4": "pythonic",
                       "deepseek": "deepseekv3", "deepseek-r1": "deepseekv3", "glm": "glm45",
                       "glm4": "glm45", "kimi": "kimi_k2", "phi4_mini": "phi4_mini_json"}  # fmt: skip


def tool_format(name: str) -> ToolFormat:
    """The format of a ``--tool-call-parser`` name; ``ValueError`` names the known ones."""
    fmt = TOOL_FORMATS.get(TOOL_FORMAT_ALIASES.get(name, name))
    if fmt is None:
        known = ", ".join([*TOOL_FORMATS, *TOOL_FORMAT_ALIASES])
        raise ValueError(f"unknown tool-call parser {name!r} (known: {known})")
    return fmt


# What a template writes when it renders a family's calls, first match wins.
_MARKERS = (
    ("kimi_k2", ("tool_calls_section_begin",)),
    (
        "deepseekv3",
        (
            "tool▁call▁begin｜>' + tool['type']",
            "tool▁call▁begin｜>' + tc['type']",
            "tool▁call▁begin｜>function<",
        ),
    ),
    ("deepseekv31", ("tool▁calls▁begin", "tool▁call▁begin")),
    ("qwen3_coder", ("<parameter=",)),
    ("glm45", ("<arg_key>",)),
    ("mistral", (MISTRAL_CALLS,)),
    ("phi4_mini_json", ("functools[",)),
    ("qwen25", (TOOL_CALL_OPEN,)),
    ("pythonic", (PY_START, "[func_name1(")),
    ("llama3", (PYTHON_TAG, "ipython")),
)


def detect_tool_format(template_source: str | None) -> ToolFormat:
    """The format a chat template's text shows; Qwen2.5's when it shows none (the format
    ``tool_prompt`` asks for when the template does not render tools itself)."""
    for name, markers in _MARKERS:
        if template_source and any(m in template_source for m in markers):
            return TOOL_FORMATS[name]
    return TOOL_FORMATS["qwen25"]
