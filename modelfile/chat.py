"""The GGUF's chat template, rendered with jinja2 in a sandbox.

Settings follow transformers' ``apply_chat_template`` (trim_blocks, lstrip_blocks,
loopcontrols, ``raise_exception``, ``tojson``) since templates are written against it.
"""

from __future__ import annotations

import datetime
import json
import re
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplate", "ChatTemplateError"]


class ChatTemplateError(ValueError):
    """The template failed to compile, or refused the messages (``raise_exception``)."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    # transformers' tojson keeps non-ASCII as is (jinja's own filter escapes it).
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template plus the special-token texts it may reference."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc}") from None
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        # transformers' convention: a template that reads ``tools`` renders them itself
        self.mentions_tools = re.search(r"\btools\b", source) is not None

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text for ``messages``; the template adds its own default system turn.
        ``tools`` (OpenAI function tools) reach templates that read them."""
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                tools=tools,
            )
        except ChatTemplateError:
            raise
        except Exception as exc:  # template code runs on caller data: any failure is theirs
            raise ChatTemplateError(f"chat template failed: {exc}") from None
