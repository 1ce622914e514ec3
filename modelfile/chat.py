"""The model's chat template, rendered as transformers' ``apply_chat_template`` renders it.

Templates are written against transformers (``transformers/utils/chat_template_utils.py``),
so the environment is its environment: jinja2's immutable sandbox with trim_blocks,
lstrip_blocks and loopcontrols; ``raise_exception``, ``strftime_now``, ``dict`` and a
``namespace`` that refuses underscore names; ``tojson`` with json.dumps' keyword arguments
(non-ASCII kept); the ``{% generation %}`` tag (it only marks assistant text for training
masks, so it renders its body). The inputs are prepared as transformers prepares them:
keys whose value is null dropped (``content: null`` beside ``tool_calls`` included),
reasoning under ``reasoning_content``, ``thinking`` and ``reasoning`` alike, the special
tokens and any extra variables (``chat_template_kwargs``) beside ``messages`` and ``tools``,
and ``continue_final_message`` cut after the final message's text by the same tag.
``tests/test_chat_templates_real.py`` checks all of this against transformers on
llama.cpp's collection of real templates.
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

__all__ = ["RESERVED_VARIABLES", "ChatTemplate", "ChatTemplateError"]

# The variables render() sets itself; extra variables may not replace them.
RESERVED_VARIABLES = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token"}
)
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' order
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker, trailing space included


class ChatTemplateError(ValueError):
    """The template failed to compile, or refused the messages (``raise_exception``)."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' filter: json.dumps as is (jinja's own escapes HTML and non-ASCII)
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class _TemplateDict:
    """``dict(...)`` and ``dict.fromkeys(...)`` without the type itself (no type-hackery)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args)


class _TemplateNamespace(Namespace):
    """jinja's ``namespace`` refusing underscore names, as transformers' does."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (jinja's self-less trick)
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace: "
                f"{name!r}"
            )


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}``: transformers tracks where assistant text
    lies for training masks; rendering a prompt only needs the body."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def _plain(value: Any) -> Any:
    """A fresh copy of JSON data: the template (and the continue tag) never touch the
    caller's objects."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _message(message: Any) -> dict[str, Any]:
    """transformers' normalisation: null keys dropped, reasoning under every name."""
    if not isinstance(message, Mapping):
        raise ChatTemplateError(f"a chat message must be an object, not {message!r}")
    out = {k: _plain(v) for k, v in message.items() if v is not None}
    reasoning = next((out[k] for k in _REASONING_FIELDS if k in out), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def _is_content(node: jinja2.nodes.Node) -> bool:
    """``x.content`` or ``x['content']``, under any filters and tests."""
    while isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test) and node.node is not None:
        node = node.node
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content"
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
    return False


def _loops_over_content(source: str) -> bool:
    """Whether the template iterates over a message's content (or a variable set from
    it): then it takes OpenAI's list of parts, else it wants the text (vLLM's test)."""
    ast = _environment().parse(source)
    names = {
        a.target.name
        for a in ast.find_all(jinja2.nodes.Assign)
        if isinstance(a.target, jinja2.nodes.Name) and _is_content(a.node)
    }
    for loop in ast.find_all(jinja2.nodes.For):
        it = loop.iter
        while isinstance(it, jinja2.nodes.Filter | jinja2.nodes.Test) and it.node is not None:
            it = it.node
        if _is_content(it) or (isinstance(it, jinja2.nodes.Name) and it.name in names):
            return True
    return False


class ChatTemplate:
    """A compiled chat template plus the special-token texts it may reference."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc}") from None
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        # transformers' convention: a template that reads ``tools`` renders them itself
        self.mentions_tools = re.search(r"\btools\b", source) is not None
        self.reads_content_parts = _loops_over_content(source)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        *,
        continue_final_message: bool = False,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text for ``messages``; the template adds its own default system turn.
        ``tools`` (OpenAI function tools) reach templates that read them;
        ``continue_final_message``: the text ends inside the last message, after its
        content; ``variables``: extra template variables (not ``RESERVED_VARIABLES``)."""
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError(
                "continue_final_message and add_generation_prompt cannot both be set."
            )
        extra = dict(variables or {})
        if clash := sorted(RESERVED_VARIABLES & extra.keys()):
            raise ChatTemplateError(f"template variables {clash} are set by the server.")
        chat = [_message(m) for m in messages]
        final = self._tag_final(chat) if continue_final_message else None
        try:
            text = self._template.render(
                messages=chat,
                tools=_plain(tools),
                documents=None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **_plain(extra),
            )
        except ChatTemplateError:
            raise
        except Exception as exc:  # template code runs on caller data: any failure is theirs
            raise ChatTemplateError(f"chat template failed: {exc}") from None
        return text if final is None else _cut_after(text, final)

    def _tag_final(self, chat: list[dict[str, Any]]) -> str:
        """Mark the final message's text with transformers' tag; the text marked."""
        if not chat or not isinstance(chat[-1].get("content"), str | list):
            raise ChatTemplateError("continue_final_message needs a final message with content.")
        if "content" not in self.source:
            raise ChatTemplateError("continue_final_message: this template reads no content.")
        content = chat[-1]["content"]
        if isinstance(content, str):
            chat[-1]["content"] = content + _CONTINUE_TAG
            return content
        for part in reversed(content):  # the last text part is continued
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                text: str = part["text"]
                part["text"] = text + _CONTINUE_TAG
                return text
        raise ChatTemplateError("continue_final_message: the final message has no text.")


def _cut_after(text: str, final: str) -> str:
    """The rendered chat up to the tag, as transformers cuts it (a template that strips
    the message loses the tag's space, so the text before it is stripped too)."""
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ChatTemplateError(
            "continue_final_message: the template does not write the final message as "
            "given, so it cannot be continued."
        )
    at = text.rindex(tag)
    if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()
