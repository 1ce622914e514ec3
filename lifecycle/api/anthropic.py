"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages
API over the chat machinery (docs/api.md, "Messages API").

A Messages body is read as the chat body it means (``anthropic_params``) and run as
``/v1/chat/completions`` runs it: the same checks, chat template, tool format,
reasoning splitter and call. The reply is a ``message`` whose content blocks are the
reasoning (``thinking``), the text (``text``) and the calls (``tool_use``), in that
order; ``stop_reason`` is ``max_tokens`` when cut by the limit, ``tool_use`` when the
reply calls a tool, ``stop_sequence`` (with ``stop_sequence`` set) when one of the
request's ``stop_sequences`` ended it, else ``end_turn``. ``usage`` counts as Anthropic
does: ``input_tokens`` are the prompt's tokens that the prefix cache did not hold,
``cache_read_input_tokens`` those it did (their sum is ``count_tokens``'
``input_tokens``).

A stream sends Anthropic's typed events, each ``event: NAME`` and ``data: JSON``:
``message_start``, ``ping``, then per content block ``content_block_start``, its
``content_block_delta`` events (``thinking_delta``, ``text_delta``, ``input_json_delta``)
and ``content_block_stop``, then ``message_delta`` (the stop reason and the final
usage) and ``message_stop``. A failure after the start is an ``error`` event, and so
is an abort (``/abort_request``; unary: a 500 ``api_error``). The reply's id is
``msg_`` and the request id, which finds its trace.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson

from lifecycle.api.anthropic_params import (
    anthropic_error,
    anthropic_reply,
    error_event,
    messages_chat_body,
)
from lifecycle.api.calls import http_call
from lifecycle.api.openai import OpenAIAPI, run_call, start_call
from lifecycle.core.call import GenerateCall
from lifecycle.core.origin import current_request_id
from lifecycle.core.states import Cause
from lifecycle.faces.openai_errors import OpenAIError
from lifecycle.faces.openai_outputs import ChoiceState, finish_reason
from lifecycle.faces.openai_params import OpenAIRequest, parse_chat
from transport import JSONResponse, Request, Response, Router, SSEEvent, SSEResponse

__all__ = ["ABORTED", "AnthropicAPI", "stop_reason"]

ABORTED = "The request was aborted (/abort_request) before it finished."


def stop_reason(finish: Any, called: bool, stops: tuple[str, ...]) -> tuple[str, str | None]:
    """``(stop_reason, stop_sequence)`` of a sample's finish (``called``: the reply
    calls a tool; ``stops``: the request's ``stop_sequences``)."""
    if finish_reason(finish) == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    matched = finish.get("matched") if isinstance(finish, dict) else None
    if isinstance(matched, str) and matched in stops:
        return "stop_sequence", matched
    return "end_turn", None


def _aborted(choice: ChoiceState) -> bool:
    """Whether ``/abort_request`` ended the sample: Anthropic has no stop reason for it,
    and the output so far is no whole reply, so the client gets an error (500
    ``api_error``), never a ``stop_reason`` that passes a cut reply off as finished."""
    return finish_reason(choice.sample.finish) == "abort"


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    """A chat tool call as a ``tool_use`` block (its id in Anthropic's ``toolu_`` form
    when it is OpenAI's ``call_`` one; a family's own id form is kept)."""
    fn = call["function"]
    cid = call["id"]
    cid = "toolu_" + cid.removeprefix("call_") if cid.startswith("call_") else cid
    return {"type": "tool_use", "id": cid, "name": fn["name"],
            "input": orjson.loads(fn["arguments"])}  # fmt: skip


def _event(name: str, **fields: Any) -> SSEEvent:
    return SSEEvent(name, orjson.dumps({"type": name, **fields}))


class AnthropicAPI:
    def __init__(self, openai: OpenAIAPI) -> None:
        self.openai = openai
        self.fe = openai.fe

    def install(self, router: Router) -> None:
        router.add("POST", "/v1/messages", self.create)
        router.add("POST", "/v1/messages/count_tokens", self.count_tokens)

    async def _prompt(
        self, request: Request, count: bool
    ) -> tuple[dict[str, Any], OpenAIRequest, list[int]]:
        """The body, its chat request and its prompt ids; raises ``OpenAIError``."""
        o = self.openai
        body = await o.json_body(request)
        oreq, messages = parse_chat(messages_chat_body(body, count=count), **o.chat_opts())
        ids = await o.chat_prompt(messages, oreq.continue_final, oreq.tools,
                                  oreq.template_kwargs)  # fmt: skip
        return body, oreq, ids

    async def count_tokens(self, request: Request) -> Response:
        try:
            _body, _oreq, ids = await self._prompt(request, count=True)
        except OpenAIError as exc:
            return anthropic_error(exc)
        return JSONResponse({"input_tokens": len(ids)})

    async def create(self, request: Request) -> Response:
        try:
            body, oreq, ids = await self._prompt(request, count=False)
        except OpenAIError as exc:
            return anthropic_error(exc)
        o = self.openai
        async with http_call(self.fe, oreq.generate_request([ids]), request) as call:
            reply = _Message(o.model_id, tuple(body.get("stop_sequences") or ()))
            refused = await start_call(call, "messages")
            if refused is not None:
                return anthropic_reply(refused)
            (choice,) = o.choices(call, oreq, [""])
            if oreq.stream:
                return await request.respond(SSEResponse(self._events(call, choice, reply)))
            refused = await run_call(call, request)
            if refused is not None:
                return anthropic_reply(refused)
            if _aborted(choice):
                return anthropic_error(OpenAIError(ABORTED, 500))
            message = choice.result(call.e2e())["message"]
            blocks: list[dict[str, Any]] = []
            if message.get("reasoning_content"):
                blocks.append({"type": "thinking", "thinking": message["reasoning_content"],
                               "signature": ""})  # fmt: skip
            if message["content"]:
                blocks.append({"type": "text", "text": message["content"]})
            blocks += [_tool_use(c) for c in message["tool_calls"] or ()]
            stop = reply.stop(choice)
            return JSONResponse(reply.message(blocks, *stop, self._usage(call)))

    def _usage(self, call: GenerateCall) -> dict[str, Any]:
        """Anthropic's usage: ``input_tokens`` not read from the prefix cache."""
        u = self.openai.usage(call)
        cached = u["prompt_tokens_details"]["cached_tokens"]
        return {
            "input_tokens": u["prompt_tokens"] - cached,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
            "output_tokens": u["completion_tokens"],
        }

    async def _events(
        self, call: GenerateCall, choice: ChoiceState, reply: _Message
    ) -> AsyncIterator[SSEEvent]:
        """The typed events; owns nothing (the handler's call scope does)."""
        yield _event("message_start", message=reply.message([], None, None, self._usage(call)))
        yield _event("ping")
        blocks = _Blocks()
        async for _index, _sample, frame in call.frames(True):
            for d in choice.deltas(frame["text"], choice.sample.finish is not None, streamed=True):
                for event in blocks.events(d):
                    yield event
        failed = call.error()
        if failed is not None or _aborted(choice):
            cause, message = failed or (Cause.INTERNAL, ABORTED)
            yield SSEEvent("error", orjson.dumps(error_event(cause, message)))
            return
        for event in blocks.close():
            yield event
        reason, sequence = reply.stop(choice)
        yield _event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                     usage=self._usage(call))  # fmt: skip
        yield _event("message_stop")


class _Blocks:
    """A stream's content blocks: the one open, numbered in the order they start."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # the open block's type

    def close(self) -> list[SSEEvent]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", index=self.index)]

    def _start(self, block: dict[str, Any]) -> list[SSEEvent]:
        out = self.close()
        self.index += 1
        self.open = block["type"]
        return [*out, _event("content_block_start", index=self.index, content_block=block)]

    def _delta(self, delta: dict[str, Any]) -> SSEEvent:
        return _event("content_block_delta", index=self.index, delta=delta)

    def events(self, d: dict[str, Any]) -> list[SSEEvent]:
        """The events of one chat delta (``ChoiceState.deltas``)."""
        out: list[SSEEvent] = []
        if d.get("reasoning_content"):
            if self.open != "thinking":
                out += self._start({"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": d["reasoning_content"]}))
        if d.get("content"):
            if self.open != "text":
                out += self._start({"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": d["content"]}))
        for tc in d.get("tool_calls") or ():
            fn = tc.get("function") or {}
            if "id" in tc:  # a call starts: its id and name; the input follows as JSON
                head = _tool_use({"id": tc["id"], "function": {**fn, "arguments": "{}"}})
                out += self._start(head)
            if fn.get("arguments"):
                out.append(self._delta({"type": "input_json_delta",
                                        "partial_json": fn["arguments"]}))  # fmt: skip
        return out


class _Message:
    """The ``message`` object's fixed parts."""

    def __init__(self, model: str, stops: tuple[str, ...]) -> None:
        self.id = f"msg_{current_request_id()}"  # X-Request-Id: finds its trace
        self.model = model
        self.stops = stops

    def stop(self, choice: ChoiceState) -> tuple[str, str | None]:
        called = choice.parser is not None and bool(choice.parser.calls)
        return stop_reason(choice.sample.finish, called, self.stops)

    def message(
        self,
        content: list[dict[str, Any]],
        reason: str | None,
        sequence: str | None,
        usage: dict[str, Any],
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": usage,
        }
