"""Tool calling on /v1/chat/completions without the model: the output parser (unary and
streamed at every split), the prompt rendering, the validation messages, the grammar a
forcing tool_choice sets (checked by llguidance, and run against strings with the real
tokenizer). The reply shapes on the scripted worker: ``test_tools_scripted.py``."""

from __future__ import annotations

import json
import random
import re
from functools import cache
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lifecycle.chat.tool_params import ToolSpec, tool_grammar
from lifecycle.chat.tool_prompt import TOOLS_PROMPT, render_chat
from lifecycle.chat.tools import ToolCallParser, call_id, parse_tool_calls
from lifecycle.faces.openai_errors import OpenAIError
from lifecycle.faces.openai_params import parse_chat
from modelfile.chat import ChatTemplate
from wire.grammar import check_grammar

from .tiny_gguf import CHATML
from .tool_cases import NAMES, PARIS, SUM, TOOLS, USER, call_block

OPTS: dict[str, Any] = {
    "vocab_size": 100,
    "model_names": frozenset({"m"}),
    "default_model": "m",
}
# Content, calls, a block that is no call, near-openers and whitespace around them all.
SAMPLE = (
    "Let me check <tool and <b>x</b>.\n" + PARIS + "\n\n" + SUM + "\n"
    "<tool_call>\n{not json}\n</tool_call> then <tool_call>\n"
    + json.dumps({"name": "nope", "arguments": {}}) + "\n</tool_call>\n<tool_ca"
)  # fmt: skip


def _stripped(calls: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def _streamed(pieces: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """The content and calls a client reassembles from the parser's deltas."""
    parser = ToolCallParser(NAMES)
    deltas = [d for p in pieces for d in parser.feed(p)] + parser.finish()
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, list[str]] = {}
    for d in deltas:
        for tc in d.get("tool_calls", ()):
            entry = calls.setdefault(tc["index"], ["", ""])
            entry[0] += tc["function"].get("name", "")
            entry[1] += tc["function"]["arguments"]
    return content or None, [(n, a) for n, a in (calls[i] for i in sorted(calls))]


# -- parsing -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("plain text", "plain text", []),
        ("", None, []),
        (PARIS, None, [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
        ("  \n" + PARIS + "\n" + SUM + "\n", None,
         [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("add", '{"a": 1, "b": 2}')]),
        ("Sure.\n" + SUM, "Sure.", [("add", '{"a": 1, "b": 2}')]),
        (SUM + "\nDone. ", "Done. ", [("add", '{"a": 1, "b": 2}')]),
        # no arguments reads as {}; compact JSON is read too
        ('<tool_call>{"name":"add"}</tool_call>', None, [("add", "{}")]),
        # not calls: bad JSON, unknown name, arguments not an object, no closer
        ("x <tool_call>\n{oops}\n</tool_call>", "x <tool_call>\n{oops}\n</tool_call>", []),
        ('<tool_call>{"name": "rm", "arguments": {}}</tool_call>',
         '<tool_call>{"name": "rm", "arguments": {}}</tool_call>', []),
        ('<tool_call>{"name": "add", "arguments": 3}</tool_call>',
         '<tool_call>{"name": "add", "arguments": 3}</tool_call>', []),
        ("a\n<tool_call>\n" + '{"name": "add"', "a\n<tool_call>\n" + '{"name": "add"', []),
        ("ends with <tool_c", "ends with <tool_c", []),
    ],
)  # fmt: skip
def test_parse_tool_calls(text: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    got_content, got_calls = parse_tool_calls(text, NAMES)
    assert (got_content, _stripped(got_calls)) == (content, calls)
    for call in got_calls:
        assert re.fullmatch(r"call_[A-Za-z0-9]{24}", call["id"]) and call["type"] == "function"


def test_the_sample_parses_as_documented() -> None:
    content, calls = parse_tool_calls(SAMPLE, NAMES)
    assert _stripped(calls) == [
        ("get_weather", '{"city": "Paris", "unit": "celsius"}'),
        ("add", '{"a": 1, "b": 2}'),
    ]
    assert content == (
        "Let me check <tool and <b>x</b>.<tool_call>\n{not json}\n</tool_call> then "
        '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>\n<tool_ca'
    )


def test_streaming_at_every_split_point_agrees_with_unary() -> None:
    content, calls = parse_tool_calls(SAMPLE, NAMES)
    want = (content, _stripped(calls))
    assert _streamed([SAMPLE]) == want
    assert _streamed(list(SAMPLE)) == want  # one character at a time
    for cut in range(len(SAMPLE) + 1):
        assert _streamed([SAMPLE[:cut], SAMPLE[cut:]]) == want, cut
    rng = random.Random(21)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(SAMPLE)), rng.randint(1, 12)))
        pieces = [SAMPLE[a:b] for a, b in zip([0, *cuts], [*cuts, len(SAMPLE)], strict=True)]
        assert _streamed(pieces) == want, cuts


_FRAGMENTS = ["<tool_call>", "</tool_call>", "<tool", "_call>", "\n", " ", "x", "<", "{",
              '{"name": "add", "arguments": {"a": 1}}', '{"name": "zz"}', "}"]  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_FRAGMENTS), max_size=14), st.randoms(use_true_random=False))
def test_any_text_streams_as_it_parses(parts: list[str], rng: random.Random) -> None:
    text = "".join(parts)
    content, calls = parse_tool_calls(text, NAMES)
    cuts = sorted({rng.randint(0, len(text)) for _ in range(rng.randint(0, 6))})
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert _streamed(pieces) == (content, _stripped(calls))
    if not calls:  # nothing is lost: without a call the content is the text as written
        assert content == (text or None)


def test_stream_deltas_have_openais_shape() -> None:
    parser = ToolCallParser(NAMES)
    deltas = parser.feed("Hi <tool") + parser.feed("_call>\n" + PARIS[12:]) + parser.finish()
    assert deltas[0] == {"content": "Hi"}
    head, args = deltas[1]["tool_calls"][0], deltas[2]["tool_calls"][0]
    assert head == {"index": 0, "id": head["id"], "type": "function",
                    "function": {"name": "get_weather", "arguments": ""}}  # fmt: skip
    assert args == {"index": 0, "function": {"arguments": '{"city": "Paris", "unit": "celsius"}'}}
    assert len(deltas) == 3 and parser.calls[0]["id"] == head["id"]


def test_call_ids_are_random() -> None:
    ids = {call_id() for _ in range(100)}
    assert len(ids) == 100


# -- rendering ---------------------------------------------------------------------------

HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city":"Paris","unit":"celsius"}'}},
        {"id": "c2", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city":"Rome","unit":"celsius"}'}},
    ]},
    {"role": "tool", "tool_call_id": "c1", "content": "18"},
    {"role": "tool", "tool_call_id": "c2", "content": "24"},
]  # fmt: skip


def _parsed(body: dict[str, Any]) -> tuple[Any, list[dict[str, Any]]]:
    return parse_chat(body, **OPTS)


def test_plain_chatml_renders_tools_calls_and_responses() -> None:
    req, messages = _parsed({"messages": HISTORY, "tools": TOOLS})
    text = render_chat(ChatTemplate(CHATML), messages, tools=req.tools)
    tools_lines = "\n".join(json.dumps(t) for t in req.tools.tools)
    block = TOOLS_PROMPT.replace("{tools}", tools_lines)
    assert text == (
        f"<|im_start|>system\nBe brief.\n\n{block}<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
        "<|im_start|>assistant\n"
        + call_block("get_weather", {"city": "Paris", "unit": "celsius"}) + "\n"
        + call_block("get_weather", {"city": "Rome", "unit": "celsius"}) + "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n18\n</tool_response>\n"
        "<tool_response>\n24\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )  # fmt: skip
    # no system message: the tools are one of their own, first (the template's default
    # system turn is not written then)
    req, messages = _parsed({"messages": USER, "tools": TOOLS, "tool_choice": "required"})
    text = render_chat(ChatTemplate(CHATML), messages, tools=req.tools)
    assert text.startswith(f"<|im_start|>system\n{TOOLS_PROMPT.split('{tools}')[0]}")
    assert text.count("<|im_start|>system") == 1 and "Answer with function calls only." in text
    # tool_choice none: the tools are not rendered
    req, messages = _parsed({"messages": USER, "tools": TOOLS, "tool_choice": "none"})
    assert req.tools is None
    assert render_chat(ChatTemplate(CHATML), messages) == ChatTemplate(CHATML).render(USER)


def test_a_template_that_reads_tools_gets_them() -> None:
    source = (
        "{% for t in tools or [] %}T:{{ t.function.name }};{% endfor %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}[{{ c.function.name }} {{ c.function.arguments.city }}]"
        "{% endfor %}{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %};{% endfor %}"
    )
    template = ChatTemplate(source)
    assert template.mentions_tools and not ChatTemplate(CHATML).mentions_tools
    req, messages = _parsed({"messages": HISTORY, "tools": TOOLS})
    assert render_chat(template, messages, tools=req.tools, add_generation_prompt=False) == (
        "T:get_weather;T:add;system:Be brief.;user:Weather in Paris and Rome?;"
        "assistant:[get_weather Paris][get_weather Rome];tool:18(c1);tool:24(c2);"
    )


# -- validation --------------------------------------------------------------------------


def _fn(**kw: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", **kw}}


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"tools": {}}, "tools", "tools must be a list"),
        ({"tools": [{}]}, "tools", "tools[0] must be an object with type 'function'"),
        ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools", "type 'function'"),
        ({"tools": [{"type": "function"}]}, "tools", "tools[0].function must be an object"),
        ({"tools": [_fn(name="a b")]}, "tools", "tools[0].function.name must be 1 to 64"),
        ({"tools": [_fn(name="x" * 65)]}, "tools", "1 to 64 letters"),
        ({"tools": [_fn(), _fn()]}, "tools", "tools[1].function.name 'f' is defined twice"),
        ({"tools": [_fn(parameters=[])]}, "tools", "parameters must be a JSON Schema object"),
        ({"tools": [_fn(description=3)]}, "tools", "description must be a string"),
        ({"tools": [_fn(strict="yes")]}, "tools", "strict must be a boolean"),
        ({"tool_choice": "required"}, "tool_choice", "tool_choice 'required' needs tools"),
        ({"tool_choice": "sometimes", "tools": [_fn()]}, "tool_choice", "must be 'none', 'auto'"),
        ({"tool_choice": {"type": "function"}, "tools": [_fn()]}, "tool_choice", "must be"),
        ({"tool_choice": {"type": "function", "function": {"name": "g"}}, "tools": [_fn()]},
         "tool_choice", "tool_choice names the function 'g', which is not in tools (f)"),
        ({"tool_choice": {"type": "function", "function": {"name": "g"}}},
         "tool_choice", "no tools were given"),
        ({"parallel_tool_calls": "no"}, "parallel_tool_calls", "must be a boolean"),
        ({"tools": [_fn()], "tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice", "cannot be combined with response_format"),
        ({"tools": [_fn()], "tool_choice": "required", "regex": "a+"},
         "tool_choice", "cannot be combined"),
        ({"tools": [_fn(parameters={"type": "object", "properties": {"x": {"type": "nope"}}})],
          "tool_choice": "required"}, "tools", "a parameters schema cannot be enforced"),
    ],
)  # fmt: skip
def test_bad_tool_fields_are_400_naming_the_field(
    extra: dict[str, Any], param: str, message: str
) -> None:
    with pytest.raises(OpenAIError) as err:
        _parsed({"messages": USER, **extra})
    assert (err.value.status, err.value.param) == (400, param)
    assert message in err.value.message, err.value.message


def _call(cid: Any = "c1", **fn: Any) -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": "f", "arguments": "{}", **fn}}


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([{"role": "assistant", "tool_calls": {}}], "messages[0].tool_calls must be a list"),
        ([{"role": "assistant", "tool_calls": [_call(cid=None)]}], "must be an object with an id"),
        ([{"role": "assistant", "tool_calls": [_call(name=3)]}], "must be an object with an id"),
        ([{"role": "assistant", "tool_calls": [_call(arguments=3)]}],
         "messages[0].tool_calls[0].function.arguments must be a string (JSON) or an object"),
        ([{"role": "tool", "content": "x"}], "messages[0] (role 'tool') needs a tool_call_id"),
        ([{"role": "assistant", "tool_calls": [_call()]},
          {"role": "tool", "content": "x", "tool_call_id": "c9"}],
         "messages[1].tool_call_id 'c9' answers no tool call of an earlier assistant message"),
    ],
)  # fmt: skip
def test_bad_tool_messages_are_400(messages: list[dict[str, Any]], message: str) -> None:
    with pytest.raises(OpenAIError) as err:
        _parsed({"messages": messages})
    assert (err.value.status, err.value.param) == (400, "messages")
    assert message in err.value.message, err.value.message


def test_tool_choice_defaults_and_the_grammar_it_sets() -> None:
    assert _parsed({"messages": USER})[0].tools is None
    assert _parsed({"messages": USER, "tools": []})[0].tools is None
    assert _parsed({"messages": USER, "tool_choice": "auto"})[0].tools is None
    req = _parsed({"messages": USER, "tools": TOOLS})[0]
    assert (req.tools.choice, req.tools.parallel, req.tools.names) == ("auto", True, NAMES)
    assert req.sampling.params.grammar is None  # auto: the model chooses
    req = _parsed({"messages": USER, "tools": TOOLS, "tool_choice": "required",
                   "parallel_tool_calls": False})[0]  # fmt: skip
    assert req.sampling.params.grammar == ("lark", tool_grammar(req.tools))
    req = _parsed({"messages": USER, "tools": TOOLS, "n": 2,
                   "tool_choice": {"type": "function", "function": {"name": "add"}}})[0]  # fmt: skip
    assert (req.tools.choice, req.tools.name, req.sampling.n) == ("function", "add", 2)
    assert req.sampling.params.grammar is not None
    assert "get_weather" not in req.sampling.params.grammar[1]


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=6),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
    max_leaves=10,
)
_tool_values = st.one_of(
    _json_values,
    st.lists(st.builds(_fn, parameters=_json_values, strict=_json_values), max_size=2),
    st.just(TOOLS),
)
_choices = st.one_of(_json_values, st.sampled_from(["none", "auto", "required"]),
                     st.builds(lambda n: {"type": "function", "function": {"name": n}},
                               st.sampled_from(["f", "add", "g"])))  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(_tool_values, _choices, _json_values, st.lists(_json_values, max_size=2))
def test_any_tool_fields_are_a_request_or_a_400(
    tools: Any, choice: Any, parallel: Any, history: list[Any]
) -> None:
    body = {"messages": [*history, *USER], "tools": tools, "tool_choice": choice,
            "parallel_tool_calls": parallel}  # fmt: skip
    try:
        req, _ = _parsed(body)
    except OpenAIError as exc:
        assert exc.status == 400 and exc.message and exc.param
        return
    if req.tools is not None and req.tools.forced:
        assert req.sampling.params.grammar is not None


# -- the grammar -------------------------------------------------------------------------


@cache
def _ll_tokenizer() -> Any:
    import llguidance

    from modelfile.vocab import load_tokenizer

    tok, _, config = load_tokenizer()
    return llguidance.LLTokenizer(
        tok.backend.to_str(), n_vocab=config.vocab_size, eos_token=list(config.eog_ids)
    )


def _accepts(grammar: str, text: str) -> bool:
    import llguidance

    ll = _ll_tokenizer()
    matcher = llguidance.LLMatcher(ll, check_grammar("lark", grammar))
    assert not matcher.is_error(), matcher.get_error()
    ids = ll.tokenize_str(text)
    return matcher.validate_tokens(ids) == len(ids) and (
        matcher.consume_tokens(ids) and matcher.is_accepting()
    )


@pytest.mark.parametrize(
    ("choice", "parallel", "text", "ok"),
    [
        ("required", True, PARIS, True),
        ("required", True, SUM, True),
        ("required", True, PARIS + "\n" + SUM, True),
        ("required", False, PARIS + "\n" + SUM, False),
        ("required", False, SUM, True),
        ("required", True, "", False),
        ("required", True, "Sure. " + SUM, False),
        ("required", True, call_block("get_weather", {"city": "Paris"}), False),  # unit required
        ("required", True, call_block("get_weather", {"city": "Paris", "unit": "K"}), False),
        ("required", True, call_block("get_weather", {"city": "P" * 25, "unit": "celsius"}), False),
        ("required", True, call_block("nope", {}), False),
        ("required", True, SUM.replace(", ", ","), False),  # json.dumps' separators only
        ("add", True, SUM, True),
        ("add", True, PARIS, False),
        ("add", True, SUM + "\n" + SUM, False),
    ],
)
def test_the_grammar_admits_exactly_the_calls(
    choice: str, parallel: bool, text: str, ok: bool
) -> None:
    kind = "function" if choice == "add" else choice
    spec = ToolSpec(_parsed({"messages": USER, "tools": TOOLS})[0].tools.tools, kind,
                    "add" if choice == "add" else None, parallel)  # fmt: skip
    grammar = tool_grammar(spec)
    check_grammar("lark", grammar)
    assert _accepts(grammar, text) is ok


def test_a_schema_with_refs_and_no_parameters_compile() -> None:
    refs = {"type": "object", "$defs": {"c": {"type": "string", "maxLength": 5}},
            "properties": {"city": {"$ref": "#/$defs/c"}}, "required": ["city"]}  # fmt: skip
    tools = [_fn(parameters=refs), {"type": "function", "function": {"name": "g"}}]
    req, _ = _parsed({"messages": USER, "tools": tools, "tool_choice": "required"})
    grammar = req.sampling.params.grammar[1]
    assert _accepts(grammar, call_block("f", {"city": "Rome"}))
    assert not _accepts(grammar, call_block("f", {"city": "Romeoo"}))
    assert _accepts(grammar, call_block("g", {}))
