"""The tools the tool-calling tests ask with (the parser's, the scripted worker's and the
real model's): two functions with bounded parameter schemas, and their call blocks."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["ADD", "NAMES", "PARIS", "SUM", "TOOLS", "USER", "WEATHER", "call_block"]

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 1000},
        "b": {"type": "integer", "minimum": 0, "maximum": 1000},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather",
                                      "description": "The current weather in a city.",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                      "parameters": ADD}},
]  # fmt: skip
NAMES = frozenset({"get_weather", "add"})
USER = [{"role": "user", "content": "Weather in Paris?"}]


def call_block(name: str, args: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


PARIS = call_block("get_weather", {"city": "Paris", "unit": "celsius"})
SUM = call_block("add", {"a": 1, "b": 2})
