"""Tool-call arguments streamed as they are written (``ToolCallParser.read``/``close``),
for every format: a text fed whole and fed split anywhere (every boundary, random
boundaries) gives the same content and the same calls, the streamed fragments of each
call add up to its whole arguments, and no markup reaches the content. The texts: one
call, several, content before and after, cut by the length limit, malformed."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lifecycle.chat.tool_formats import TOOL_FORMATS, tool_format
from lifecycle.chat.tools import (
    ArgumentsText,
    CallEnd,
    CallStart,
    ContentText,
    ToolCallParser,
    stream_deltas,
)

from .tool_cases import NAMES, TOOLS

SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PARIS = {"city": "Paris", "unit": "celsius"}
SUM = {"a": 1, "b": 2}
MARKUP = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<｜tool", "<|tool", "functools[",
          "<function=", "<arg_key>", "<|python")  # fmt: skip


def _text(fmt: str, calls: list[tuple[str, dict[str, Any]]], before: str, after: str) -> str:
    f = tool_format(fmt)
    body = f.prefix + f.separator.join(f.write(n, a) for n, a in calls) + f.suffix
    return before + body + after


def _texts(fmt: str) -> list[str]:
    """The outputs of the property: whole ones, and each cut by malformation."""
    lead = fmt in ("llama3",)  # a call only at the start
    base = [
        _text(fmt, [("get_weather", PARIS)], "", ""),
        _text(fmt, [("get_weather", PARIS), ("add", SUM)], "", ""),
        _text(fmt, [("add", {"a": 1, "b": 2})], "" if lead else "Let me see. ", ""),
        _text(fmt, [("add", SUM)], "" if lead else "Sure:\n", "\nDone."),
        _text(fmt, [("nope", SUM)], "Hm ", ""),
        _text(
            fmt, [("get_weather", {"city": 'a "quoted" \\ city ünï', "unit": "celsius"})], "", ""
        ),
        "No calls [here] {at all}.",
    ]
    malformed = [t[: len(t) * 2 // 3] + "}} oops" + t[len(t) * 2 // 3 :] for t in base[:2]]
    return base + malformed


def _feed(fmt: str, pieces: list[str], truncated: bool, whole: str = "") -> list[Any]:
    parser = ToolCallParser(NAMES, tool_format(fmt), SCHEMAS)
    events = [e for p in pieces for e in parser.read(p)] + parser.close(truncated)
    out = _summary(events, parser)
    # a region that is no call (an unknown name, broken markup) is content as written
    if not any(bad in (whole or "".join(pieces)) for bad in ("nope", "oops")):
        assert not any(m in out[0] for m in MARKUP), out[0]
    return out


def _summary(events: list[Any], parser: ToolCallParser) -> list[Any]:
    """The content, and each call (name, arguments) as the events stream it; checks that
    the fragments add up to the call's arguments and the events come in order."""
    content = "".join(e.text for e in events if isinstance(e, ContentText))
    streamed: dict[int, list[str]] = {}
    ended: dict[int, dict[str, Any]] = {}
    for e in events:
        if isinstance(e, CallStart):
            assert e.index not in streamed and e.index == len(streamed)
            streamed[e.index] = [e.name, ""]
        elif isinstance(e, ArgumentsText):
            assert e.index in streamed and e.index not in ended
            streamed[e.index][1] += e.text
        elif isinstance(e, CallEnd):
            ended[e.index] = e.call
    assert sorted(ended) == sorted(streamed) == list(range(len(parser.calls)))
    for i, call in enumerate(parser.calls):
        assert ended[i] is call
        assert [call["function"]["name"], call["function"]["arguments"]] == streamed[i]
    assert content == parser.content
    return [content, [v for _, v in sorted(streamed.items())]]


CASES = [(fmt, text) for fmt in sorted(TOOL_FORMATS) for text in _texts(fmt)]


@pytest.mark.parametrize(("fmt", "text"), CASES)
def test_every_split_reads_as_the_whole(fmt: str, text: str) -> None:
    whole = _feed(fmt, [text], False)
    for cut in range(len(text) + 1):
        assert _feed(fmt, [text[:cut], text[cut:]], False) == whole, cut
    assert _feed(fmt, list(text), False) == whole


@pytest.mark.parametrize(("fmt", "text"), CASES)
def test_a_cut_by_the_length_limit_reads_as_the_whole_cut(fmt: str, text: str) -> None:
    """Every prefix, read as cut by ``max_tokens``: one character at a time as whole."""
    for cut in range(0, len(text), 3):
        split = _feed(fmt, list(text[:cut]), True, text)
        assert split == _feed(fmt, [text[:cut]], True, text), cut


@pytest.mark.parametrize("fmt", sorted(TOOL_FORMATS))
def test_the_calls_read_back_typed(fmt: str) -> None:
    text = _text(fmt, [("get_weather", PARIS), ("add", SUM)], "", "")
    content, calls = _feed(fmt, [text], False)
    assert content == ""
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", PARIS), ("add", SUM)]


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_random_boundaries_read_as_the_whole(data: st.DataObject) -> None:
    fmt, text = data.draw(st.sampled_from(CASES))
    whole = text
    truncated = data.draw(st.booleans())
    if truncated:
        text = text[: data.draw(st.integers(0, len(text)))]
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=12)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert _feed(fmt, pieces, truncated, whole) == _feed(fmt, [text], truncated, whole)


def test_openai_stream_deltas_name_first_then_fragments() -> None:
    parser = ToolCallParser(NAMES, tool_format("qwen25"))
    text = _text("qwen25", [("add", SUM)], "", "")
    deltas = [d for ch in text for d in stream_deltas(parser.read(ch))]
    deltas += stream_deltas(parser.close())
    head = deltas[0]["tool_calls"][0]
    assert head["function"] == {"name": "add", "arguments": ""} and head["id"].startswith("call_")
    rest = [d["tool_calls"][0] for d in deltas[1:]]
    assert len(rest) > 3 and all(set(r) == {"index", "function"} for r in rest)
    assert "".join(r["function"]["arguments"] for r in rest) == json.dumps(SUM)


@pytest.mark.parametrize("fmt", sorted(TOOL_FORMATS))
def test_a_long_argument_streams_while_it_is_written(fmt: str) -> None:
    """A file edit's content: in many fragments as the text arrives (a string value of
    the tagged formats too; pythonic's values go whole), read back exactly."""
    big = 'line "one"\n\tline\\two\n' * 300
    edit = {"properties": {"path": {"type": "string"}, "content": {"type": "string"}}}
    f = tool_format(fmt)
    text = f.prefix + f.write("edit", {"path": "a.py", "content": big}) + f.suffix
    parser = ToolCallParser(frozenset({"edit"}), f, {"edit": edit})
    events = [e for i in range(0, len(text), 4) for e in parser.read(text[i : i + 4])]
    events += parser.close()
    fragments = [e for e in events if isinstance(e, ArgumentsText)]
    assert len(fragments) > (1 if fmt == "pythonic" else 50)
    (call,) = parser.calls
    assert json.loads(call["function"]["arguments"]) == {"path": "a.py", "content": big}
    assert "".join(e.text for e in fragments) == call["function"]["arguments"]
