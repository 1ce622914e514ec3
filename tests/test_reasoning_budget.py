"""A thinking budget (issue 56, point 4) without a server: the state machine both workers
apply to each sample (``wire.BudgetState``), the wire map and its bounds (against
``specs/wire.cddl``), and the API fields that set it: chat's ``thinking_token_budget``
(or ``thinking_budget``), ``/generate``'s ``max_thinking_tokens`` and Anthropic's
``thinking``, read as the chat body they mean."""

from __future__ import annotations

import logging
from typing import Any

import pytest

import wire
from lifecycle.api.anthropic_params import messages_chat_body
from lifecycle.chat.reasoning import REASONING_PARSERS
from lifecycle.core import reasoning
from lifecycle.core.errors import RequestError
from lifecycle.core.params import parse_generate
from lifecycle.core.reasoning import budget_option
from lifecycle.faces.openai_errors import OpenAIError
from lifecycle.faces.openai_params import parse_chat
from tests.wire_schema import validate_frame
from wire import BudgetState, ReasoningBudget, RequestOptions

HI = [{"role": "user", "content": "Hi"}]
OPTS: dict[str, Any] = {"vocab_size": 100, "model_names": frozenset({"m"}), "default_model": "m"}


def _run(budget: ReasoningBudget, sampled: list[int]) -> tuple[list[int], list[bool]]:
    """What a worker appends for ``sampled``, and whether each was known to be forced
    before it was sampled (``forcing``: the row must not fly)."""
    state, out, forced = BudgetState(budget), [], []
    for tok in sampled:
        forced.append(state.forcing)
        out.append(state.next(tok))
    return out, forced


def test_open_in_the_prompt_the_end_is_forced_after_the_budget() -> None:
    out, forced = _run(ReasoningBudget(3, (9,), (7, 9)), [1, 2, 3, 4, 5, 6, 9])
    assert out == [1, 2, 3, 7, 9, 6, 9]  # then the samples again, a later end included
    assert forced == [False, False, False, True, True, False, False]


def test_opened_by_the_model_the_count_starts_after_the_start_ids() -> None:
    budget = ReasoningBudget(2, (9,), (7, 9), start=(5, 6))
    assert _run(budget, [1, 5, 2, 5, 6, 3, 4, 8, 8, 8])[0] == [1, 5, 2, 5, 6, 3, 4, 7, 9, 8]
    assert _run(budget, [1, 2, 3, 4, 9, 9, 9])[0] == [1, 2, 3, 4, 9, 9, 9]  # never opened


def test_the_end_written_by_the_model_ends_the_budget() -> None:
    budget = ReasoningBudget(4, (8, 9), (7, 8, 9))
    assert _run(budget, [1, 8, 9, 2, 3, 4, 5, 6])[0] == [1, 8, 9, 2, 3, 4, 5, 6]
    # a partial end does not: the count goes on
    assert _run(budget, [8, 1, 9, 2, 3, 3])[0] == [8, 1, 9, 2, 7, 8]


def test_a_zero_budget_forces_the_end_first() -> None:
    assert _run(ReasoningBudget(0, (9,), (7, 9)), [1, 2, 3])[0] == [7, 9, 3]
    assert _run(ReasoningBudget(0, (9,), (9,), start=(5,)), [5, 1, 2])[0] == [5, 9, 2]


def test_a_copy_goes_on_alone() -> None:
    state = BudgetState(ReasoningBudget(2, (9,), (9,)))
    state.next(1)
    twin = state.copy()
    assert [state.next(t) for t in (2, 3)] == [2, 9]
    assert [twin.next(t) for t in (9, 3)] == [9, 3]  # closed by its model: nothing forced


def test_the_option_travels_on_spec_and_reads_back() -> None:
    budget = ReasoningBudget(5, (9,), (7, 9), start=(4, 5))
    sent = RequestOptions(reasoning_budget=budget).to_wire()
    frame = wire.Submit([wire.SubmitEntry(1, wire.pack_ids([5]), {}, sent)])
    validate_frame(wire.encode_frame(frame))
    got = wire.decode_frame(wire.encode_frame(frame))
    assert isinstance(got, wire.Submit)
    assert RequestOptions.from_wire(got.entries[0].options, 100, 1).reasoning_budget == budget
    inside = ReasoningBudget(0, (9,), (9,)).to_wire()
    assert "start" not in inside
    validate_frame(wire.encode_frame(wire.Submit([wire.SubmitEntry(1, wire.pack_ids([5]), {},
                                                                    {"reasoning_budget": inside})])))  # fmt: skip


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"tokens": -1, "end": [1], "force": [1]}, "tokens"),
        ({"tokens": 1, "end": [], "force": [1]}, "end must hold"),
        ({"tokens": 1, "end": [1], "force": [100]}, "force has ids outside"),
        ({"tokens": 1, "end": [1], "force": [1], "start": [1] * 33}, "more than 32"),
        ({"end": [1], "force": [1]}, "tokens"),
        ([1], "a map"),
    ],
)
def test_a_budget_outside_the_bounds_is_refused(raw: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RequestOptions.from_wire({"reasoning_budget": raw}, 100, 1)


def test_chat_takes_vllms_thinking_token_budget_and_qwens_thinking_budget() -> None:
    req, _ = parse_chat({"messages": HI, "thinking_token_budget": 64}, **OPTS)
    assert req.reasoning_budget == 64
    assert [i.reasoning_budget for i in req.generate_request([[1, 2]]).items] == [64]
    assert parse_chat({"messages": HI}, **OPTS)[0].reasoning_budget is None
    assert parse_chat({"messages": HI, "thinking_budget": 0}, **OPTS)[0].reasoning_budget == 0
    both = {"messages": HI, "thinking_budget": 9, "thinking_token_budget": 9}
    assert parse_chat(both, **OPTS)[0].reasoning_budget == 9
    with pytest.raises(OpenAIError, match="differ"):
        parse_chat({**both, "thinking_budget": 8}, **OPTS)
    for bad in (-1, 1.5, "8", True):
        with pytest.raises(OpenAIError, match="thinking_token_budget") as err:
            parse_chat({"messages": HI, "thinking_token_budget": bad}, **OPTS)
        assert err.value.status == 400 and err.value.param == "thinking_token_budget"


def test_generate_takes_sglangs_max_thinking_tokens() -> None:
    one = parse_generate({"text": "x", "max_thinking_tokens": 16}, vocab_size=100)
    assert [i.reasoning_budget for i in one.items] == [16]
    two = parse_generate({"text": ["x", "y"], "max_thinking_tokens": [3, None]}, vocab_size=100)
    assert [i.reasoning_budget for i in two.items] == [3, None]
    assert parse_generate({"text": "x"}, vocab_size=100).items[0].reasoning_budget is None
    for bad in (-1, "3", 2.5):
        with pytest.raises(RequestError, match="max_thinking_tokens"):
            parse_generate({"text": "x", "max_thinking_tokens": bad}, vocab_size=100)


def _thinking(thinking: Any) -> dict[str, Any]:
    body = {"model": "m", "max_tokens": 8, "messages": HI, "thinking": thinking}
    chat = messages_chat_body(body)
    parse_chat(chat, **OPTS)  # what it means is a valid chat body
    return {k: v for k, v in chat.items() if k not in ("model", "max_tokens", "messages")}


def test_anthropic_thinking_is_the_template_switch_and_the_budget() -> None:
    assert _thinking({"type": "enabled", "budget_tokens": 2048}) == {
        "chat_template_kwargs": {"enable_thinking": True},
        "thinking_token_budget": 2048,
    }
    assert _thinking({"type": "disabled"}) == {"chat_template_kwargs": {"enable_thinking": False}}
    assert _thinking({"type": "adaptive"}) == {"chat_template_kwargs": {"enable_thinking": True}}
    assert _thinking(None) == {}
    for bad, message in (({"type": "enabled"}, "budget_tokens"), ({"type": "on"}, "type"),
                         ({"type": "enabled", "budget_tokens": -5}, "budget_tokens")):  # fmt: skip
        with pytest.raises(OpenAIError, match=message) as err:
            _thinking(bad)
        assert err.value.status == 400


class _Chars:
    """A tokenizer whose ids are the characters' code points."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]


def test_the_frontend_sends_the_formats_tags_as_ids(caplog: pytest.LogCaptureFixture) -> None:
    fmt = REASONING_PARSERS["qwen3"]
    tok: Any = _Chars()
    ids = tuple(ord(c) for c in "</think>")
    opened = budget_option(7, fmt, True, tok)
    assert opened == ReasoningBudget(7, ids, (10, *ids))  # "\n</think>" forced
    closed = budget_option(7, fmt, False, tok)
    assert closed is not None and closed.start == tuple(ord(c) for c in "<think>")
    assert budget_option(None, fmt, True, tok) is None
    reasoning._unread[0] = True
    with caplog.at_level(logging.INFO, logger="lifecycle.core.reasoning"):
        assert budget_option(7, None, False, tok) is None  # no reasoning: kept by any output
        assert budget_option(7, None, False, tok) is None
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 1
    assert "ignored" in caplog.records[0].getMessage()
