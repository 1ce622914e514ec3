"""Each family's tool-call format (``lifecycle.chat.tool_formats``) read by the parser core:
the whole text, and streamed split at every possible boundary (one split, and one
character at a time), which must give the same content and calls; a call cut by the
length limit leaves no markup; the template detection; the grammar of a forcing
``tool_choice`` in each family's format compiles and admits the format's own text."""

from __future__ import annotations

import json
from typing import Any

import pytest

from lifecycle.chat.tool_formats import TOOL_FORMATS, detect_tool_format, tool_format
from lifecycle.chat.tool_params import ToolSpec, tool_grammar
from lifecycle.chat.tool_prompt import render_chat
from lifecycle.chat.tools import ToolCallParser, parse_tool_calls
from modelfile.chat import ChatTemplate

from .llamacpp_vocab import templates_dir
from .test_tools import HISTORY, _accepts
from .tiny_gguf import CHATML
from .tool_cases import NAMES, TOOLS

TEMPLATES, NO_TEMPLATES = templates_dir()

PARIS = {"city": "Paris", "unit": "celsius"}
SUM = {"a": 1, "b": 2}
DS_B, DS_E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CB, DS_CE, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def _ds(name: str, args: dict[str, Any]) -> str:
    return f"{DS_CB}function{DS_SEP}{name}\n```json\n{json.dumps(args)}\n```{DS_CE}"


# (format, the model's text, the content, the calls as (name, arguments object))
CASES: list[tuple[str, str, str | None, list[tuple[str, dict[str, Any]]]]] = [
    ("qwen25", "Sure.\n<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": PARIS})
     + "\n</tool_call>\n<tool_call>\n" + json.dumps({"name": "add", "arguments": SUM})
     + "\n</tool_call>", "Sure.", [("get_weather", PARIS), ("add", SUM)]),
    ("llama3", json.dumps({"name": "get_weather", "parameters": PARIS}), None,
     [("get_weather", PARIS)]),
    ("llama3", "<|python_tag|>" + json.dumps({"name": "add", "parameters": SUM}) + "; "
     + json.dumps({"name": "get_weather", "parameters": PARIS}), None,
     [("add", SUM), ("get_weather", PARIS)]),
    ("llama3", '  {"name": "add", "arguments": {"a": 1, "b": 2}}', None, [("add", SUM)]),
    ("llama3", 'The sum is {"a": 1}.', 'The sum is {"a": 1}.', []),
    ("llama3", '{"answer": 3}', '{"answer": 3}', []),
    ("mistral", "[TOOL_CALLS] [" + json.dumps({"name": "get_weather", "arguments": PARIS})
     + ", " + json.dumps({"name": "add", "arguments": SUM}) + "]", None,
     [("get_weather", PARIS), ("add", SUM)]),
    ("mistral", "Checking.[TOOL_CALLS]get_weather[ARGS]" + json.dumps(PARIS)
     + "[TOOL_CALLS]add[ARGS]" + json.dumps(SUM), "Checking.",
     [("get_weather", PARIS), ("add", SUM)]),
    ("mistral", "[TOOL_CALLS]add[CALL_ID]abc123XYZ[ARGS]" + json.dumps(SUM), None,
     [("add", SUM)]),
    ("mistral", "Use [brackets] freely.", "Use [brackets] freely.", []),
    ("deepseekv3", "Let me look." + DS_B + _ds("get_weather", PARIS) + "\n" + _ds("add", SUM)
     + DS_E, "Let me look.", [("get_weather", PARIS), ("add", SUM)]),
    ("deepseekv3", DS_B + DS_CB + "add" + DS_SEP + json.dumps(SUM) + DS_CE + DS_E, None,
     [("add", SUM)]),
    ("qwen25", "<tool_call>\n{not json}\n</tool_call> then", "<tool_call>\n{not json}\n"
     "</tool_call> then", []),
    ("mistral", "[TOOL_CALLS]nope[ARGS]{}", "[TOOL_CALLS]nope[ARGS]{}", []),
]  # fmt: skip


def _calls(calls: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def _stream(fmt: str, pieces: list[str], truncated: bool = False) -> tuple[str | None, list]:
    parser = ToolCallParser(NAMES, tool_format(fmt))
    deltas = [d for p in pieces for d in parser.feed(p)] + parser.finish(truncated)
    content = "".join(d.get("content", "") for d in deltas) or None
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        for tc in d.get("tool_calls", ()):
            if "id" in tc:  # the head: id and name first, then the arguments
                assert tc["function"]["arguments"] == "" and tc["index"] not in calls
                calls[tc["index"]] = {"function": dict(tc["function"])}
            else:
                calls[tc["index"]]["function"]["arguments"] += tc["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_whole_text(fmt: str, text: str, content: str | None, calls: list[Any]) -> None:
    got_content, got_calls = parse_tool_calls(text, NAMES, tool_format(fmt))
    assert (got_content, _calls(got_calls)) == (content, calls)


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_streamed_at_every_split(fmt: str, text: str, content: str | None, calls: list) -> None:
    for cut in range(len(text) + 1):
        got_content, got_calls = _stream(fmt, [text[:cut], text[cut:]])
        assert (got_content, _calls(got_calls)) == (content, calls), cut
    got_content, got_calls = _stream(fmt, list(text))
    assert (got_content, _calls(got_calls)) == (content, calls)


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), [c for c in CASES if c[3]])
def test_a_call_cut_by_the_length_limit_leaves_no_markup(
    fmt: str, text: str, content: str | None, calls: list
) -> None:
    """Every prefix of a text with calls, read as cut by ``max_tokens``: the content is
    a prefix of the whole text's content (no markup of the cut call), the calls those of
    the whole text, the last one's arguments as far as they were written (as OpenAI's)."""
    for cut in range(len(text)):
        got_content, got_calls = _stream(fmt, [text[:cut]], truncated=True)
        assert (content or "").startswith((got_content or "").rstrip()), (cut, got_content)
        whole = parse_tool_calls(text, NAMES, tool_format(fmt))[1]
        for got, want in zip(got_calls, whole, strict=False):
            assert got["function"]["name"] == want["function"]["name"], cut
            assert want["function"]["arguments"].startswith(got["function"]["arguments"]), cut


def test_hermes_block_missing_only_its_closer_is_a_call_when_the_model_stopped() -> None:
    text = "<tool_call>\n" + json.dumps({"name": "add", "arguments": SUM}) + "\n"
    assert _calls(parse_tool_calls(text, NAMES)[1]) == [("add", SUM)]
    content, calls = parse_tool_calls(text[:-5], NAMES, truncated=True)
    # a call begun when the limit cut it is kept, its arguments as far as written
    assert (content, calls[0]["function"]) == (None, {"name": "add", "arguments": '{"a": 1, "b": '})


@pytest.mark.parametrize(
    ("source", "name"),
    [
        ("{{ '<tool_call>' }}{{ tools }}", "qwen25"),
        ("{{ '<|python_tag|>' }}{% if tools %}ipython{% endif %}", "llama3"),
        ("[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS][TOOL_CALLS]", "mistral"),
        ("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'}}{{ tools }}", "deepseekv31"),
        ("{{ messages }}", "qwen25"),
        (None, "qwen25"),
    ],
)
def test_the_format_is_detected_from_the_template(source: str | None, name: str) -> None:
    assert detect_tool_format(source).name == name


def test_sglang_names_and_unknown_names() -> None:
    assert tool_format("hermes").name == tool_format("qwen").name == "qwen25"
    assert tool_format("deepseek").name == "deepseekv3"
    assert tool_format("llama4").name == "pythonic"
    assert tool_format("glm").name == "glm45"
    with pytest.raises(ValueError, match="unknown tool-call parser 'x'.*mistral"):
        tool_format("x")


@pytest.mark.parametrize("fmt", sorted(TOOL_FORMATS))
@pytest.mark.parametrize("choice", ["required", "function"])
def test_forcing_grammar_follows_the_family(fmt: str, choice: str) -> None:
    """The grammar compiles, and the text it describes (the format's own writing of two
    calls, or one) parses back to those calls."""
    spec = ToolSpec(tuple(TOOLS), choice, "add" if choice == "function" else None)
    fam = tool_format(fmt)
    grammar = tool_grammar(spec, fam)
    calls = [("add", SUM)] if choice == "function" else [("get_weather", PARIS), ("add", SUM)]
    body = fam.separator.join(fam.write(n, a) for n, a in calls)
    text = fam.prefix + body + fam.suffix
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert _calls(parse_tool_calls(text, NAMES, fam, schemas=schemas)[1]) == calls
    assert _accepts(grammar, text)
    assert not _accepts(grammar, body if fam.prefix else "Sure. " + text)


@pytest.mark.parametrize(
    ("template", "name"),
    [
        ("Qwen-Qwen2.5-7B-Instruct", "qwen25"),
        ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use", "qwen25"),
        ("meta-llama-Llama-3.1-8B-Instruct", "llama3"),
        ("mistralai-Mistral-Nemo-Instruct-2407", "mistral"),
        ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "deepseekv3"),
        ("deepseek-ai-DeepSeek-V3.1", "deepseekv31"),
        ("Qwen3-Coder", "qwen3_coder"),
        ("GLM-4.6", "glm45"),
        ("moonshotai-Kimi-K2", "kimi_k2"),
        ("fireworks-ai-llama-3-firefunction-v2", "phi4_mini_json"),  # the same functools[...]
    ],
)
def test_real_templates_choose_their_family(template: str, name: str) -> None:
    if TEMPLATES is None:
        pytest.skip(NO_TEMPLATES)
    source = (TEMPLATES / f"{template}.jinja").read_text(encoding="utf-8")
    assert detect_tool_format(source).name == name


@pytest.mark.parametrize("fmt", sorted(TOOL_FORMATS))
def test_a_plain_template_shows_and_asks_for_the_servers_format(fmt: str) -> None:
    """A template that does not render tools: the prompt's example and the history's calls
    are in the server's format, and the history's calls read back as they were sent."""
    spec = ToolSpec(tuple(TOOLS), "auto")
    text = render_chat(ChatTemplate(CHATML), HISTORY, tools=spec, fmt=tool_format(fmt))
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    content, calls = parse_tool_calls(turn, NAMES, tool_format(fmt), schemas=spec.schemas)
    sent = [c["function"] for c in HISTORY[2]["tool_calls"]]
    assert content is None
    assert _calls(calls) == [(c["name"], json.loads(c["arguments"])) for c in sent]
    example = tool_format(fmt).write("function_name", {"argument": "value"})
    assert (example in text) is (fmt != "qwen25")
