"""``POST /v1/responses``: the OpenAI Responses API, text in and text out, unary and
streamed with its typed events (docs/api.md).

A request becomes a chat request (``input`` a string or a list of messages,
``instructions`` a system message first, ``max_output_tokens``, the sampling fields:
``lifecycle.api.responses_params``) checked by the same rules as ``/v1/chat/completions``
and run through the same chat template and call; the reply is a ``response`` object with
one assistant message. Stored conversations (``previous_response_id``) are refused with a
400 that says so.
A stream sends ``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``, the
``response.output_text.delta`` events, then the ``.done`` events and
``response.completed`` (also when cut by ``max_output_tokens``: its response then says
``status: incomplete``); an error after the start is an ``error`` event, then
``response.failed``. ``usage`` carries SGLang's ``prompt_tokens`` and
``completion_tokens`` beside OpenAI's ``input_tokens`` and ``output_tokens``. An aborted
response (``/abort_request``) ends ``cancelled``, the Responses API's status for a
response stopped on request, never ``completed``: its output so far with the open items
``incomplete``; streamed, the items' ``.done`` events and then ``response.incomplete``
carrying it (the API has no ``response.cancelled`` event; ``response.incomplete`` is its
terminal event for a response that did not complete).

Function tools (``tools`` of type ``function``, written flat as the Responses API does,
``tool_choice``, ``parallel_tool_calls``) become chat tools, so they are rendered,
forced and parsed as on ``/v1/chat/completions`` (docs/tools.md). ``function_call`` and
``function_call_output`` input items become the assistant's ``tool_calls`` and ``tool``
messages. Calls come out as ``function_call`` output items (after the message, which is
left out when it has no text); a stream with tools opens the message item at its first
text and sends each call as ``response.output_item.added`` at its head (name and id),
``response.function_call_arguments.delta`` as its arguments are written, then ``.done``
and ``response.output_item.done``.
A reasoning model's reasoning (docs/api.md, "Reasoning") is a ``reasoning`` output item
first, its text as one ``reasoning_text`` content part; streamed as
``response.reasoning_text.delta`` and ``.done`` events between the item's ``added`` and
``done``; ``usage.output_tokens_details.reasoning_tokens`` counts its tokens.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson

from lifecycle.api.calls import http_call
from lifecycle.api.openai import OpenAIAPI, openai_error, run_call, start_call
from lifecycle.api.responses_params import chat_body, reasoning_effort
from lifecycle.core.call import GenerateCall
from lifecycle.core.origin import current_request_id
from lifecycle.faces.openai_errors import OpenAIError
from lifecycle.faces.openai_outputs import ChoiceState
from lifecycle.faces.openai_params import OpenAIRequest, parse_chat
from transport import JSONResponse, Request, Response, Router, SSEResponse

__all__ = ["ResponsesAPI"]


class ResponsesAPI:
    def __init__(self, openai: OpenAIAPI) -> None:
        self.openai = openai
        self.fe = openai.fe

    def install(self, router: Router) -> None:
        router.add("POST", "/v1/responses", self.create)

    async def create(self, request: Request) -> Response:
        o = self.openai
        try:
            body = await o.json_body(request)
            oreq, messages = parse_chat(chat_body(body), **o.chat_opts())
            ids = await o.chat_prompt(messages, tools=oreq.tools, variables=oreq.template_kwargs)
        except OpenAIError as exc:
            return openai_error(exc)
        async with http_call(self.fe, oreq.generate_request([ids]), request) as call:
            reply = _Reply(body, oreq, o.model_id)  # after the call named the request
            refused = await start_call(call, "input")
            if refused is not None:
                return refused
            (choice,) = o.choices(call, oreq, [""])
            if oreq.stream:
                return await request.respond(SSEResponse(self._events(call, choice, reply)))
            refused = await run_call(call, request)
            if refused is not None:
                return refused
            result = choice.result(call.e2e())
            message, finish = result["message"], result["finish_reason"]
            calls = [reply.function_call(c, "completed") for c in message["tool_calls"] or ()]
            text = message["content"] or ""
            status, thought = _item_status(finish), message.get("reasoning_content")
            # As a stream sends them: no empty message beside calls, nor after reasoning
            # an abort cut (a finished reasoning-only reply has an empty message).
            cut_thinking = bool(thought) and status == "incomplete" and not text
            items = [reply.message(text, status)] if text or not (calls or cut_thinking) else []
            if thought:  # the reasoning item comes first
                ended = "completed" if text or calls else status  # else cut in the reasoning
                items.insert(0, reply.reasoning(thought, ended))
            usage = self._usage(call, choice)
            out = reply.final(text, finish, usage, items=items + calls)
            return JSONResponse(out)

    def _usage(self, call: GenerateCall, choice: ChoiceState) -> dict[str, Any]:
        u = self.openai.usage(call)
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return {
            "input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": choice.reasoning_tokens()},
            "total_tokens": u["total_tokens"],
            # SGLang's names for the same counts (its usage is chat's UsageInfo)
            "prompt_tokens": u["prompt_tokens"],
            "completion_tokens": u["completion_tokens"],
        }

    async def _events(
        self, call: GenerateCall, choice: ChoiceState, reply: _Reply
    ) -> AsyncIterator[bytes]:
        """The typed events; owns nothing (the handler's call scope does)."""
        if choice.parser is not None or choice.splitter is not None:
            async for event in self._item_events(call, choice, reply):
                yield event
            return
        yield reply.event("response.created", response=reply.envelope("in_progress"))
        yield reply.event("response.in_progress", response=reply.envelope("in_progress"))
        yield reply.event("response.output_item.added", output_index=0,
                          item=reply.message("", "in_progress"))  # fmt: skip
        yield reply.event("response.content_part.added", **reply.where(),
                          part=_text_part(""))  # fmt: skip
        text, finish = "", None
        async for _index, _sample, frame in call.frames(True):
            c = choice.chunk_choice(frame)
            if c is None:
                continue
            delta = c["delta"].get("content") or ""
            finish = c.get("finish_reason") or finish
            if delta:
                text += delta
                yield reply.event("response.output_text.delta", **reply.where(), delta=delta,
                                  logprobs=[])  # fmt: skip
        failed = call.error()
        if failed is not None:
            async for event in _failed(reply, *failed):
                yield event
            return
        yield reply.event("response.output_text.done", **reply.where(), text=text, logprobs=[])
        yield reply.event("response.content_part.done", **reply.where(), part=_text_part(text))
        yield reply.event("response.output_item.done", output_index=0,
                          item=reply.message(text, _item_status(finish)))  # fmt: skip
        final = reply.final(text, finish, self._usage(call, choice))
        yield reply.event(_terminal_event(final), response=final)

    async def _item_events(
        self, call: GenerateCall, choice: ChoiceState, reply: _Reply
    ) -> AsyncIterator[bytes]:
        """With tools or reasoning: output items in the order they appear, the reasoning
        item at its first text, the message at its first text, each call at its head
        (name and id), its arguments as they are written, done when the parser has it
        whole."""
        yield reply.event("response.created", response=reply.envelope("in_progress"))
        yield reply.event("response.in_progress", response=reply.envelope("in_progress"))
        items: list[dict[str, Any]] = []  # the output so far, completed ones as sent
        text, msg_index, thought, rs_index = "", None, "", None
        open_calls: dict[int, int] = {}  # a call's parser index -> its output index
        async for _index, _sample, frame in call.frames(True):
            ended = choice.sample.finish is not None
            for d in choice.deltas(frame["text"], ended, streamed=True):
                if d.get("reasoning_content"):
                    if rs_index is None:
                        rs_index = len(items)
                        items.append(reply.reasoning("", "in_progress"))
                        yield reply.event("response.output_item.added", output_index=rs_index,
                                          item=items[rs_index])  # fmt: skip
                    thought += d["reasoning_content"]
                    yield reply.event("response.reasoning_text.delta", item_id=reply.rs_id,
                                      output_index=rs_index, content_index=0,
                                      delta=d["reasoning_content"])  # fmt: skip
                    continue
                if rs_index is not None and items[rs_index]["status"] != "completed":
                    async for event in _reasoning_done(reply, items, rs_index, thought):
                        yield event
                if d.get("content"):
                    if msg_index is None:
                        msg_index = reply.open_message(len(items))
                        items.append({})
                        yield reply.event("response.output_item.added", output_index=msg_index,
                                          item=reply.message("", "in_progress"))  # fmt: skip
                        yield reply.event("response.content_part.added", **reply.where(),
                                          part=_text_part(""))  # fmt: skip
                    text += d["content"]
                    yield reply.event("response.output_text.delta", **reply.where(),
                                      delta=d["content"], logprobs=[])  # fmt: skip
                for tc in d.get("tool_calls") or ():
                    if "id" in tc:  # a call's head: its item opens, arguments to come
                        open_calls[tc["index"]] = len(items)
                        items.append(reply.function_call(tc, "in_progress"))
                        yield reply.event("response.output_item.added",
                                          output_index=open_calls[tc["index"]],
                                          item=items[-1])  # fmt: skip
                    fragment = tc["function"].get("arguments")
                    if fragment:  # the arguments as they are written
                        index = open_calls[tc["index"]]
                        yield reply.event("response.function_call_arguments.delta",
                                          item_id=items[index]["id"], output_index=index,
                                          delta=fragment)  # fmt: skip
            async for event in _calls_done(reply, choice, items, open_calls):
                yield event
        failed = call.error()
        if failed is not None:
            async for event in _failed(reply, *failed):
                yield event
            return
        called = choice.parser is not None and bool(choice.parser.calls)
        finish = choice._tail(called)["finish_reason"]
        status = _item_status(finish)
        if rs_index is not None and items[rs_index]["status"] != "completed":
            async for event in _reasoning_done(reply, items, rs_index, thought, status):
                yield event
        if msg_index is not None:
            items[msg_index] = reply.message(text, status)
            yield reply.event("response.output_text.done", **reply.where(), text=text,
                              logprobs=[])  # fmt: skip
            yield reply.event("response.content_part.done", **reply.where(),
                              part=_text_part(text))  # fmt: skip
            yield reply.event("response.output_item.done", output_index=msg_index,
                              item=items[msg_index])  # fmt: skip
        if msg_index is None and not called and status == "completed":
            items.append(reply.message("", status))  # reasoning only: an empty message
        final = reply.final(text, finish, self._usage(call, choice), items=items)
        yield reply.event(_terminal_event(final), response=final)


async def _calls_done(
    reply: _Reply, choice: ChoiceState, items: list[dict[str, Any]], open_calls: dict[int, int]
) -> AsyncIterator[bytes]:
    """The calls the parser has completed (``parser.calls`` holds a call once it ended,
    a cut one at the end of the output) end: their arguments whole, then the item."""
    calls = choice.parser.calls if choice.parser is not None else []
    for k in sorted(k for k in open_calls if k < len(calls)):
        index = open_calls.pop(k)
        items[index] = done = reply.function_call(calls[k], "completed")
        yield reply.event("response.function_call_arguments.done", item_id=done["id"],
                          output_index=index, arguments=done["arguments"])  # fmt: skip
        yield reply.event("response.output_item.done", output_index=index, item=done)


async def _reasoning_done(
    reply: _Reply, items: list[dict[str, Any]], index: int, text: str, status: str = "completed"
) -> AsyncIterator[bytes]:
    """The reasoning item ends: its text whole, then the item (``incomplete`` when the
    response was aborted inside the reasoning)."""
    items[index] = reply.reasoning(text, status)
    yield reply.event("response.reasoning_text.done", item_id=reply.rs_id, output_index=index,
                      content_index=0, text=text)  # fmt: skip
    yield reply.event("response.output_item.done", output_index=index, item=items[index])


async def _failed(reply: _Reply, cause: Any, message: str) -> AsyncIterator[bytes]:
    """An error after the stream began: an ``error`` event, then ``response.failed``."""
    err = OpenAIError.from_cause(cause, message).body()["error"]
    yield reply.event("error", code=err.get("code") or cause.value, message=message,
                      param=None)  # fmt: skip
    yield reply.event("response.failed", response=reply.envelope("failed", error={
        "code": "server_error", "message": message}))  # fmt: skip


# finish_reason -> the response's status (docs/api.md): cut by max_output_tokens is
# "incomplete", aborted (/abort_request) "cancelled", anything else "completed".
_STATUS = {"length": "incomplete", "abort": "cancelled"}


def _item_status(finish: str | None) -> str:
    """An output item's status at the end: ``incomplete`` when the response was aborted."""
    return "incomplete" if finish == "abort" else "completed"


def _terminal_event(final: dict[str, Any]) -> str:
    """``response.completed`` for a response that ran to its end: finished, or cut by
    ``max_output_tokens`` (its ``status`` then says ``incomplete``, with
    ``incomplete_details``; OpenAI's API streams ``response.incomplete`` there, but the
    official client's ``responses.stream()`` helper and SGLang's clients take the final
    response only from ``response.completed``: docs/api.md). A ``cancelled`` response
    (``/abort_request``) ends with ``response.incomplete``: the Responses API streams no
    ``response.cancelled`` event, and an abort is never reported completed."""
    return "response.incomplete" if final["status"] == "cancelled" else "response.completed"


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class _Reply:
    """The ``response`` object's fixed parts and the stream's numbering."""

    def __init__(self, body: dict[str, Any], oreq: OpenAIRequest, model: str) -> None:
        self.id = f"resp_{current_request_id()}"  # X-Request-Id: finds its trace
        self.msg_id = f"msg_{uuid.uuid4().hex}"
        self.rs_id = f"rs_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.body, self.oreq, self.model = body, oreq, model
        self.seq = 0
        self.msg_index = 0

    def where(self) -> dict[str, Any]:
        return {"item_id": self.msg_id, "output_index": self.msg_index, "content_index": 0}

    def open_message(self, index: int) -> int:
        """The message item's place in the output (0 unless calls came first)."""
        self.msg_index = index
        return index

    def function_call(self, call: dict[str, Any], status: str) -> dict[str, Any]:
        """A chat tool call as a Responses ``function_call`` output item."""
        fn = call["function"]
        return {"id": f"fc_{call['id'].removeprefix('call_')}", "type": "function_call",
                "status": status, "call_id": call["id"], "name": fn["name"],
                "arguments": fn["arguments"]}  # fmt: skip

    def reasoning(self, text: str, status: str) -> dict[str, Any]:
        """The reasoning output item (its text as ``reasoning_text`` content, as OpenAI's
        open-weight models return it; no summary)."""
        content = [] if status == "in_progress" else [{"type": "reasoning_text", "text": text}]
        return {"id": self.rs_id, "type": "reasoning", "summary": [], "content": content,
                "encrypted_content": None, "status": status}  # fmt: skip

    def event(self, kind: str, **fields: Any) -> bytes:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return orjson.dumps(event)

    def message(self, text: str, status: str) -> dict[str, Any]:
        content = [] if status == "in_progress" else [_text_part(text)]
        return {"id": self.msg_id, "type": "message", "status": status, "role": "assistant",
                "content": content}  # fmt: skip

    def envelope(self, status: str, **extra: Any) -> dict[str, Any]:
        b = self.body
        text_format = b.get("text") if isinstance(b.get("text"), dict) else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": [],
            "instructions": b.get("instructions"),
            "max_output_tokens": b.get("max_output_tokens"),
            "temperature": b.get("temperature", 1.0),
            "top_p": b.get("top_p", 1.0),
            "parallel_tool_calls": b.get("parallel_tool_calls", True),
            "tool_choice": b.get("tool_choice", "auto"),
            "tools": b.get("tools") or [],
            "text": text_format or {"format": {"type": "text"}},
            "truncation": b.get("truncation", "disabled"),
            "store": False,
            "metadata": b.get("metadata") or {},
            "user": b.get("user"),
            "previous_response_id": None,
            "reasoning": {"effort": reasoning_effort(b), "summary": None},
            "error": None,
            "incomplete_details": None,
            "usage": None,
            **extra,
        }

    def final(
        self,
        text: str,
        finish: str | None,
        usage: dict[str, Any],
        calls: list[dict[str, Any]] | None = None,
        items: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """The finished ``response``: ``items`` as a stream sent them, else the message
        (left out when it has no text and there are calls) and then the calls."""
        status = _STATUS.get(finish or "", "completed")
        out = self.envelope(status, usage=usage)
        if items is None:
            items = [self.message(text, _item_status(finish))] if text or not calls else []
            items += calls or []
        out["output"] = items or [self.message(text, _item_status(finish))]
        if status == "incomplete":
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        return out
