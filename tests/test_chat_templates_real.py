"""The real chat templates (llama.cpp's ``models/templates``: Qwen, Llama 3.x, Mistral,
Gemma, Phi, DeepSeek, Hermes, Granite, gpt-oss...) render byte for byte as transformers
renders them, on the conversations clients send; where transformers' renderer raises (the
template refuses the conversation, as gemma-2 refuses a system turn), ours refuses too
with a ``ChatTemplateError``.

transformers is the reference, called as ``apply_chat_template`` calls it (messages
normalised, then ``render_jinja_template`` with the same special tokens), without a
tokenizer. The templates come from llama.cpp's tree in the peer cache, else from the
pinned llama-cpp-python sdist (``tests/llamacpp_vocab.py``, seconds); only when neither
can be had do these tests skip, with the reason.
"""

from __future__ import annotations

import copy
import json
import pathlib
from typing import Any

import pytest

from lifecycle.chat.tool_prompt import render_chat
from lifecycle.faces.openai_params import parse_chat
from modelfile.chat import ChatTemplate, ChatTemplateError
from tests.llamacpp_vocab import templates_dir

hf_chat = pytest.importorskip("transformers.utils.chat_template_utils")

TEMPLATES, NO_TEMPLATES = templates_dir()  # fetched from the pinned sdist when absent
PATHS = sorted(TEMPLATES.glob("*.jinja")) if TEMPLATES is not None else []
BOS, EOS = "<s>", "</s>"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city (°C).",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
ASK = {"role": "user", "content": "What is the weather in Zürich?"}
RESULT = {"role": "tool", "name": "get_weather", "tool_call_id": "call_1", "content": '{"t": 21}'}


def _call(arguments: Any, content: str | None = None) -> dict[str, Any]:
    fn = {"name": "get_weather", "arguments": arguments}
    call = {"id": "call_1", "type": "function", "function": fn}
    return {"role": "assistant", "content": content, "tool_calls": [call]}


# name: (messages as a client sends them, tools)
CONVERSATIONS: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = {
    "plain": ([{"role": "user", "content": "Hello"}], None),
    "system": ([{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}], None),
    "multi_turn": (
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "How are you?"},
        ],
        None,
    ),
    "tool_call_object": ([ASK, _call({"city": "Zürich"}), RESULT], TOOLS),
    "tool_call_string": ([ASK, _call('{"city": "Zürich"}'), RESULT], TOOLS),
    "tool_call_empty_content": ([ASK, _call({"city": "Zürich"}, ""), RESULT], TOOLS),
    "reasoning": (
        [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
            {"role": "user", "content": "3+3?"},
        ],
        None,
    ),
    "content_parts": (
        [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": " you"}]}],
        None,
    ),
}  # fmt: skip


def transformers_render(
    source: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, **kw: Any
) -> str:
    """``tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **kw)``
    with ``bos_token``/``eos_token`` as its special tokens."""
    chat = hf_chat._normalize_chat_messages(copy.deepcopy(messages))
    kw.setdefault("add_generation_prompt", True)
    rendered, _ = hf_chat.render_jinja_template(
        conversations=[chat], tools=tools, chat_template=source, bos_token=BOS, eos_token=EOS, **kw
    )
    return str(rendered[0])


def outcome(fn: Any, *args: Any, **kw: Any) -> tuple[str, str]:
    """("ok", fn(*args, **kw)) or ("refused", the error)."""
    try:
        return "ok", fn(*args, **kw)
    except Exception as exc:
        return "refused", f"{type(exc).__name__}: {exc}"


def _ids(path: pathlib.Path) -> str:
    return path.stem


@pytest.mark.skipif(not PATHS, reason=NO_TEMPLATES)
@pytest.mark.parametrize("path", PATHS, ids=_ids)
def test_renders_as_transformers(path: pathlib.Path) -> None:
    source = path.read_text(encoding="utf-8")
    ours = ChatTemplate(source, bos_token=BOS, eos_token=EOS)
    for name, (messages, tools) in CONVERSATIONS.items():
        want = outcome(transformers_render, source, messages, tools)
        got = outcome(ours.render, copy.deepcopy(messages), True, tools=tools)
        if want[0] == "ok":
            assert got == want, f"{path.stem} / {name}"
        else:  # the template refuses it: so must we, as a ChatTemplateError
            assert got[0] == "refused", f"{path.stem} / {name}: transformers {want[1]}"
            assert got[1].startswith("ChatTemplateError: "), f"{path.stem} / {name}: {got[1]}"


def _served(conversation: str) -> tuple[list[dict[str, Any]], Any, Any]:
    messages, tools = CONVERSATIONS[conversation]
    body: dict[str, Any] = {"messages": copy.deepcopy(messages)}
    if tools is not None:
        body["tools"] = tools
    opts = {"vocab_size": 100, "model_names": frozenset({"m"}), "default_model": "m"}
    req, parsed = parse_chat(body, **opts)
    return parsed, req.tools, tools


def _as_served(messages: list[dict[str, Any]], parts: bool) -> list[dict[str, Any]]:
    """The conversation as the server hands it to the template (docs/api.md): null
    content beside tool calls as "", arguments as objects (as JSON text where the template
    refuses objects), text parts joined unless the template loops over them."""
    out = []
    for m in copy.deepcopy(messages):
        if m.get("content") is None:
            m["content"] = ""
        if isinstance(m["content"], list) and not parts:
            m["content"] = "".join(p["text"] for p in m["content"])
        for call in m.get("tool_calls", ()):
            if isinstance(call["function"]["arguments"], str):
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        out.append(m)
    return out


def _as_text(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = copy.deepcopy(messages)
    for m in out:
        for call in m.get("tool_calls", ()):
            call["function"]["arguments"] = json.dumps(
                call["function"]["arguments"], ensure_ascii=False
            )
    return out


@pytest.mark.skipif(not PATHS, reason=NO_TEMPLATES)
@pytest.mark.parametrize("path", PATHS, ids=_ids)
def test_served_prompt_is_transformers_on_the_served_shapes(path: pathlib.Path) -> None:
    """Through the API's parsing and ``render_chat``: the prompt is transformers' on the
    served shapes, and nothing transformers renders from the client's shapes is refused."""
    source = path.read_text(encoding="utf-8")
    ours = ChatTemplate(source, bos_token=BOS, eos_token=EOS)
    for name, (messages, tools) in CONVERSATIONS.items():
        if tools is not None and not ours.mentions_tools:
            continue  # our own tool prompt (tool_prompt.py), not the template's
        parsed, spec, _ = _served(name)
        got = outcome(render_chat, ours, parsed, tools=spec)
        served = _as_served(messages, ours.reads_content_parts)
        want = outcome(transformers_render, source, served, tools)
        if want[0] == "refused" and got[0] == "ok":  # arguments given as JSON text instead
            want = outcome(transformers_render, source, _as_text(served), tools)
        assert got == want or (got[0] == want[0] == "refused"), f"{path.stem} / {name}"
        if got[0] == "refused":
            raw = outcome(transformers_render, source, messages, tools)
            assert raw[0] == "refused", f"{path.stem} / {name}: {got[1]}"


@pytest.mark.skipif(not PATHS, reason=NO_TEMPLATES)
@pytest.mark.parametrize("path", PATHS, ids=_ids)
def test_continue_final_message_as_transformers(path: pathlib.Path) -> None:
    source = path.read_text(encoding="utf-8")
    ours = ChatTemplate(source, bos_token=BOS, eos_token=EOS)
    messages = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "The colour is"},
    ]
    want = outcome(
        lambda: transformers_render(
            source, messages, None, add_generation_prompt=False, continue_final_message=True
        )
    )
    got = outcome(
        lambda: ours.render(
            copy.deepcopy(messages), add_generation_prompt=False, continue_final_message=True
        )
    )
    assert got == want or (got[0] == want[0] == "refused"), path.stem


@pytest.mark.skipif(not PATHS, reason=NO_TEMPLATES)
def test_template_variables_reach_the_template() -> None:
    """``chat_template_kwargs``: Qwen3's ``enable_thinking: false`` opens an empty think
    block after the generation prompt, as in transformers."""
    source = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text(encoding="utf-8")
    messages = [{"role": "user", "content": "Hi"}]
    got = ChatTemplate(source).render(messages, variables={"enable_thinking": False})
    assert got.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert got == transformers_render(source, messages, None, enable_thinking=False)


def test_reserved_variables_are_refused() -> None:
    with pytest.raises(ChatTemplateError, match="messages"):
        ChatTemplate("{{ messages }}").render([], variables={"messages": []})


def test_generation_tag_namespace_and_tojson_arguments() -> None:
    source = (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{% generation %}{{ m | tojson(indent=2, sort_keys=True) }}{% endgeneration %}"
        "{% endfor %}{{ ns.n }}{{ dict(a=1) | tojson(separators=(',', ':')) }}"
        "{{ 'é' | tojson(ensure_ascii=True) }}"
    )
    messages = [{"role": "user", "content": "é"}]
    assert ChatTemplate(source).render(messages) == transformers_render(source, messages, None)
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{% set ns = namespace(_x=1) %}").render(messages)


@pytest.mark.skipif(not PATHS, reason=NO_TEMPLATES)
@pytest.mark.parametrize(
    "name", ["mistralai-Mistral-Nemo-Instruct-2407", "Mistral-Small-3.2-24B-Instruct-2506"]
)
def test_mistral_templates_take_our_mistral_call_ids(name: str) -> None:
    """A reply's tool calls sent back as history: Mistral's templates refuse any id but 9
    letters and digits, which is what the mistral tool format gives its calls."""
    from lifecycle.chat.tool_formats import TOOL_FORMATS
    from lifecycle.chat.tools import call_id

    assert TEMPLATES is not None
    source = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
    chars = TOOL_FORMATS["mistral"].id_chars
    for cid, ok in ((call_id(chars), True), (call_id(), False)):
        call = {
            "id": cid,
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
        }
        messages = [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": cid, "content": "sunny"},
        ]
        got = outcome(
            ChatTemplate(source, bos_token=BOS, eos_token=EOS).render, messages, True, tools=TOOLS
        )
        want = outcome(transformers_render, source, messages, TOOLS)
        assert (got[0] == "ok") == ok == (want[0] == "ok"), (cid, got, want)
