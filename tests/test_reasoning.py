"""The reasoning splitter (``lifecycle.chat.reasoning``) on each family's documented
output: the whole text, and streamed split at every possible boundary (one split, and a
character at a time), which must agree; a tag split across pieces; the forced formats
(DeepSeek-R1: the prompt opened ``<think>``); the reasoning token count; the
detection from the template."""

from __future__ import annotations

import pytest

from lifecycle.chat.reasoning import (
    REASONING_PARSERS,
    ReasoningSplitter,
    detect_reasoning,
    reasoning_format,
    reasoning_tokens,
    split_reasoning,
)

# (parser, whether the prompt opened the reasoning, the output, reasoning, content)
CASES = [
    ("qwen3", False, "<think>\nThe user greets me.\n</think>\n\nHello!", "The user greets me.",
     "Hello!"),
    ("qwen3", False, "Hello, no thinking.", "", "Hello, no thinking."),
    ("qwen3", False, "  <thinking> is a word </think>", "", "  <thinking> is a word </think>"),
    ("qwen3", False, "Say <think> later.", "", "Say <think> later."),
    ("qwen3", False, "<think>\n\n</think>\n\nQuick.", "", "Quick."),
    ("qwen3", False, "<think>cut off mid thought", "cut off mid thought", ""),
    ("qwen3", True, "Hmm, 2+2.\n</think>\n\n4", "Hmm, 2+2.", "4"),
    ("deepseek-r1", False, "Okay, so 2+2 is 4.\n</think>\n\nThe answer is **4**.",
     "Okay, so 2+2 is 4.", "The answer is **4**."),
    ("deepseek-r1", False, "<think>\nOkay.\n</think>\nFour.", "Okay.", "Four."),
    ("qwen3-thinking", False, "a < b </ c\n</think>\n\nyes", "a < b </ c", "yes"),
    ("kimi", False, "◁think▷plan◁/think▷done", "plan", "done"),
]  # fmt: skip


def _pieces(name: str, opened: bool, chunks: list[str]) -> tuple[str, str]:
    fmt = reasoning_format(name)
    splitter = ReasoningSplitter(fmt, fmt.opened_by("<think>\n" if opened else "x") or opened)
    parts = [p for c in chunks for p in splitter.feed(c)] + splitter.finish()
    assert all(text for _, text in parts)  # nothing empty is sent
    return (
        "".join(t for k, t in parts if k == "reasoning"),
        "".join(t for k, t in parts if k == "content"),
    )


@pytest.mark.parametrize(("name", "opened", "text", "reasoning", "content"), CASES)
def test_split_whole_and_at_every_boundary(
    name: str, opened: bool, text: str, reasoning: str, content: str
) -> None:
    fmt = reasoning_format(name)
    inside = opened or fmt.forced
    assert split_reasoning(text, fmt, inside) == (reasoning, content)
    for cut in range(len(text) + 1):
        assert _pieces(name, opened, [text[:cut], text[cut:]]) == (reasoning, content), cut
    assert _pieces(name, opened, list(text)) == (reasoning, content)


def test_reasoning_streams_before_the_end_tag_arrives() -> None:
    splitter = ReasoningSplitter(REASONING_PARSERS["qwen3"])
    assert splitter.feed("<think>\nStep one") == [("reasoning", "Step one")]
    assert splitter.feed(". </th") == [("reasoning", ".")]  # the tag's start is held
    assert splitter.feed("ink>\n\nDone") == [("content", "Done")]
    assert splitter.finish() == []


def test_the_prompt_opens_the_reasoning() -> None:
    qwen3, r1 = REASONING_PARSERS["qwen3"], REASONING_PARSERS["deepseek-r1"]
    assert qwen3.opened_by("<|im_start|>assistant\n<think>\n")
    assert not qwen3.opened_by("<|im_start|>assistant\n")
    assert not qwen3.opened_by("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert r1.opened_by("<｜Assistant｜>")  # forced: R1 always starts thinking
    assert not r1.opened_by("<｜Assistant｜></think>")  # unless the prompt closed it


def test_reasoning_tokens_count_through_the_end_tag() -> None:
    qwen3 = REASONING_PARSERS["qwen3"]
    tokens = ["<think>", "\n", "Hmm", "</think>", "\n\n", "Hi"]
    assert reasoning_tokens(tokens, qwen3, False) == 4
    assert reasoning_tokens(["Hi", "<think>"], qwen3, False) == 0
    assert reasoning_tokens(["a", "b"], qwen3, True) == 2  # never closed: all of it
    assert reasoning_tokens(["a", "</th", "ink>", "b"], qwen3, True) == 3


def test_detection_and_names() -> None:
    assert detect_reasoning("{{ '<think>\\n' }}") is REASONING_PARSERS["qwen3"]
    assert detect_reasoning("{{ messages }}") is None
    with pytest.raises(ValueError, match="unknown reasoning parser 'o1'.*deepseek-r1"):
        reasoning_format("o1")
