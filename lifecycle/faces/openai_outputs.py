"""OpenAI reply shapes: completion and chat objects, stream chunks, usage, logprobs.

``ChoiceState`` turns one ``SampleOutput``'s frames into OpenAI choices: the legacy
completions logprobs (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``)
or chat's ``{"content": [{token, logprob, bytes, top_logprobs}]}``. Token strings are the
token's decoded text; a token that is part of a multi-byte character reads
``bytes:\\xNN`` as OpenAI writes it, and ``bytes`` always holds the exact UTF-8 bytes.
A chat choice with tools reads its text for tool calls (``tools.py``, in the family's
format): ``message.tool_calls`` and ``finish_reason`` ``tool_calls`` in a reply,
``delta.tool_calls`` chunks in a stream (a call's head as it begins, then its
``arguments`` in fragments as they are written). With a reasoning format (``reasoning.py``) the
reasoning is split out first, as ``message.reasoning_content`` / ``delta.reasoning_content``,
and only the rest is read for calls.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

from lifecycle.chat.reasoning import ReasoningFormat, ReasoningSplitter
from lifecycle.chat.tool_formats import Schemas, ToolFormat
from lifecycle.chat.tools import ToolCallParser, stream_deltas, whole_deltas
from lifecycle.core.detok import TokenizerLike
from lifecycle.core.origin import current_request_id
from lifecycle.core.outputs import SampleOutput

__all__ = ["ChoiceState", "ReplyIds", "TokenTexts", "fingerprint", "finish_reason", "usage"]


class TokenTexts:
    """Per-token text and bytes for logprobs, computed once per token id."""

    def __init__(self, tokenizer: TokenizerLike) -> None:
        self.tok = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._compute(token_id)
        return hit

    def _compute(self, token_id: int) -> tuple[str, list[int]]:
        exact = getattr(self.tok, "token_bytes", None)  # the tokenizer's own (modelfile)
        raw = exact(token_id) if exact is not None else self.tok.token_text(token_id).encode()
        try:
            return raw.decode("utf-8"), list(raw)
        except UnicodeDecodeError:  # part of a character: OpenAI's bytes:\xNN form
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), list(raw)


def finish_reason(finish: Any) -> str | None:
    if not isinstance(finish, dict):
        return None
    # The native types are OpenAI's names already: stop, length (and abort, ours).
    return str(finish.get("type"))


def usage(
    prompt: int, completion: int, cached: int, reasoning: int | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    if reasoning is not None:  # a reasoning model's (the server has a reasoning parser)
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return out


class ReplyIds:
    """``id``, ``created`` and ``system_fingerprint`` shared by a reply and its chunks."""

    def __init__(self, chat: bool, model: str, fingerprint: str) -> None:
        # The request's id (X-Request-Id, docs/api.md): the trace is found by this id too.
        self.id = ("chatcmpl-" if chat else "cmpl-") + current_request_id()
        self.created = int(time.time())
        self.model = model
        self.fingerprint = fingerprint

    def envelope(self, obj: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
        }


def fingerprint(*parts: str) -> str:
    """Stable for one server build and model (``fp_`` + 10 hex digits, as OpenAI)."""
    return "fp_" + hashlib.sha256("\0".join(parts).encode()).hexdigest()[:10]


def _entry_lp(entry: list[Any]) -> float | None:
    return entry[0]


class ChoiceState:
    """One OpenAI choice fed from one sample; keeps what the stream has sent so far."""

    def __init__(
        self,
        index: int,
        sample: SampleOutput,
        texts: TokenTexts,
        *,
        chat: bool,
        echo: str,
        tools: frozenset[str] | None = None,
        tool_format: ToolFormat | None = None,
        tool_schemas: Schemas | None = None,
        reasoning: ReasoningFormat | None = None,
        separate_reasoning: bool = True,
    ) -> None:
        self.index = index
        self.sample = sample
        self.texts = texts
        self.chat = chat
        self.echo = echo  # prompt text to show first ("" unless completions echo)
        self.offset = 0  # text_offset of the next token (legacy logprobs)
        self.started = False
        self.tools = tools  # chat: the tool names whose calls the text is read for
        self.tool_format = tool_format
        self.parser = (
            ToolCallParser(tools, tool_format, tool_schemas) if tools is not None else None
        )
        # reasoning: the format (counted always), split out unless the request said not to;
        # whether the prompt opened it is the request core's reading (OutputOptions)
        self.reasoning = reasoning
        self.splitter: ReasoningSplitter | None = None
        if chat and reasoning is not None and separate_reasoning:
            self.splitter = ReasoningSplitter(reasoning, sample.opts.reasoning_open)

    # -- logprobs ----------------------------------------------------------------------
    def _tops(self, row: Any) -> list[tuple[str, list[int], float | None]]:
        return [(*self.texts.get(e[1]), _entry_lp(e)) for e in row or ()]

    def _legacy(self, meta: dict[str, Any], first: bool) -> dict[str, Any]:
        entries = meta.get("output_token_logprobs", [])
        tops = meta.get("output_top_logprobs") or [None] * len(entries)
        if first and meta.get("input_token_logprobs"):  # echo: the prompt comes first
            entries = meta["input_token_logprobs"] + entries
            tops = (meta.get("input_top_logprobs") or [None] * len(entries)) + tops
        out: dict[str, Any] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for entry, row in zip(entries, tops, strict=False):
            text, _ = self.texts.get(entry[1])
            out["tokens"].append(text)
            out["token_logprobs"].append(_entry_lp(entry))
            top = {t: lp for t, _, lp in self._tops(row)}
            if not top and entry[0] is not None:
                top = {text: entry[0]}
            out["top_logprobs"].append(top if entry[0] is not None else None)
            out["text_offset"].append(self.offset)
            self.offset += len(self.texts.tok.token_text(entry[1]))
        return out

    def _chat(self, meta: dict[str, Any]) -> dict[str, Any]:
        entries = meta.get("output_token_logprobs", [])
        tops = meta.get("output_top_logprobs") or [None] * len(entries)
        content = []
        for entry, row in zip(entries, tops, strict=False):
            text, raw = self.texts.get(entry[1])
            content.append(
                {
                    "token": text,
                    "logprob": _entry_lp(entry),
                    "bytes": raw,
                    "top_logprobs": [
                        {"token": t, "logprob": lp, "bytes": b} for t, b, lp in self._tops(row)
                    ],
                }
            )
        return {"content": content, "refusal": None}

    def logprobs(self, meta: dict[str, Any], first: bool) -> dict[str, Any] | None:
        if not self.sample.opts.request.return_logprob:
            return None
        return self._chat(meta) if self.chat else self._legacy(meta, first)

    # -- replies -----------------------------------------------------------------------
    def _tail(self, called: bool = False) -> dict[str, Any]:
        finish = self.sample.finish
        matched = finish.get("matched") if isinstance(finish, dict) else None
        reason = finish_reason(finish)
        if called and reason == "stop":  # a call cut by the length limit stays "length"
            reason = "tool_calls"
        # SGLang sends matched_stop always: the matched id or text, else null
        return {"finish_reason": reason, "matched_stop": matched}

    def result(self, e2e: float) -> dict[str, Any]:
        """The choice of a unary reply."""
        res = self.sample.result(e2e)
        self.offset = 0
        lp = self.logprobs(res["meta_info"], True)
        if self.chat:
            if self.parser is None and self.splitter is None:
                message = {"role": "assistant", "content": res["text"], "tool_calls": None}
                return {"index": self.index, "message": message, "logprobs": lp, **self._tail()}
            deltas = self.deltas(res["text"], True)
            reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
            content = "".join(d.get("content", "") for d in deltas)
            calls = self.parser.calls if self.parser is not None else []
            message = {"role": "assistant", "content": content or None,
                       "tool_calls": calls or None}  # fmt: skip
            if self.splitter is not None:
                message["reasoning_content"] = reasoning or None
            return {"index": self.index, "message": message, "logprobs": lp,
                    **self._tail(bool(calls))}  # fmt: skip
        text = self.echo + res["text"]
        return {"index": self.index, "text": text, "logprobs": lp, **self._tail()}

    def deltas(self, text: str, ended: bool, streamed: bool = False) -> list[dict[str, Any]]:
        """The chat deltas ``text`` lets out (``ended``: it is the last of the output):
        reasoning first split out, the rest read for calls (``streamed``: each call's
        arguments as they are written, else whole when the call ends)."""
        render = stream_deltas if streamed else whole_deltas
        pieces = [("content", text)] if self.splitter is None else self.splitter.feed(text)
        if ended and self.splitter is not None:
            pieces += self.splitter.finish()
        out: list[dict[str, Any]] = []
        for kind, piece in pieces:
            if kind == "reasoning":
                out.append({"reasoning_content": piece})
            elif self.parser is not None:
                out += render(self.parser.read(piece))
            elif piece:
                out.append({"content": piece})
        if ended and self.parser is not None:
            out += render(self.parser.close(finish_reason(self.sample.finish) == "length"))
        return out

    def reasoning_tokens(self) -> int:
        """The output tokens of the reasoning (0 without a reasoning format)."""
        if self.reasoning is None:
            return 0
        # counted by the request core as the tokens came, in the same (the server's) format
        counted = self.sample.reasoning
        return counted.tokens if counted is not None else 0

    def role_choice(self) -> dict[str, Any]:
        """A chat stream's first chunk for this choice: the role alone, as OpenAI sends it."""
        # with tools the content may stay null (a reply of calls only), as OpenAI sends it
        delta = {"role": "assistant", "content": "" if self.parser is None else None}
        return {"index": self.index, "delta": delta, "logprobs": None, "finish_reason": None}

    def chunk_choice(self, frame: dict[str, Any]) -> dict[str, Any] | None:
        """The choice of a stream chunk for ``frame`` (an incremental frame); None when
        the frame carries nothing to show (no text, no token, not the end)."""
        ended = self.sample.finish is not None
        if self.started and not ended and not frame["text"] and not frame["output_ids"]:
            return None
        first, self.started = not self.started, True
        lp = self.logprobs(frame["meta_info"], first)
        tail = self._tail() if ended else {"finish_reason": None}
        if self.chat:  # the role went alone first (role_choice)
            return {"index": self.index, "delta": {"content": frame["text"]}, "logprobs": lp,
                    **tail}  # fmt: skip
        text = (self.echo if first else "") + frame["text"]
        return {"index": self.index, "text": text, "logprobs": lp, **tail}

    def chunk_choices(self, frame: dict[str, Any]) -> list[dict[str, Any]]:
        """The choices of the stream chunks for ``frame``: one (or none, as
        ``chunk_choice``) without tools; with tools, one per content or tool-call delta the
        parser lets out (the frame's logprobs on the first, the finish on the last)."""
        if self.parser is None and self.splitter is None:
            choice = self.chunk_choice(frame)
            return [] if choice is None else [choice]
        ended = self.sample.finish is not None
        self.started = True
        lp = self.logprobs(frame["meta_info"], False)
        deltas = self.deltas(frame["text"], ended, streamed=True)
        if not deltas and (ended or (lp is not None and lp["content"])):
            deltas = [{}]
        out = [{"index": self.index, "delta": d, "logprobs": None, "finish_reason": None}
               for d in deltas]  # fmt: skip
        if out:
            out[0]["logprobs"] = lp
        if ended:
            out[-1].update(self._tail(self.parser is not None and bool(self.parser.calls)))
        return out
