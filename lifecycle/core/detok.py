"""Tokenize and detokenize for the request path.

- ``TextCodec.encode``: prompts that arrive in the same event-loop tick are encoded
  together with one ``encode_batch`` call; a batch whose text is long goes to a worker
  thread (``tokenizers`` encode holds the GIL for its whole run, ~1 us per character,
  which would stall every other connection), a short one runs inline (a thread hop costs
  ~80 us, more than encoding a short prompt).
- ``SampleText``: incremental text of one output sample (``DecodeStream``, ~1 us per
  token), with stop-string hold-back while streaming and trimming at the end.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
import anyio.lowlevel

from wire import Finish
from wire.faults import fault_point

__all__ = ["SampleText", "TextCodec", "TokenizerLike", "held_back"]


class TokenizerLike(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def encode_batch(
        self, texts: list[str], add_special_tokens: bool = True
    ) -> list[list[int]]: ...

    def decode(
        self, ids: Any, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True
    ) -> str: ...

    def decode_stream(self, skip_special_tokens: bool = True) -> Any: ...

    def token_text(self, token_id: int) -> str: ...


@dataclass(slots=True)
class _Pending:
    texts: list[str]
    add_special_tokens: bool
    done: anyio.Event = field(default_factory=anyio.Event)
    result: list[list[int]] | None = None
    error: BaseException | None = None


class TextCodec:
    def __init__(self, tokenizer: TokenizerLike, *, inline_chars: int = 2048) -> None:
        # ``encode_batch`` would otherwise fan a batch out to a thread pool per core whose
        # threads spin (sched_yield) between batches: measured at concurrency 32, 100-200
        # us more CPU per request, on cores the worker needs. One core encodes a batch of
        # prompts in well under a millisecond. An explicit setting wins.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.tokenizer = tokenizer
        self.inline_chars = inline_chars
        self._pending: list[_Pending] = []
        self.batches = 0  # encode_batch calls made (for tests and metrics)

    async def encode(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each text; joins the batch of whoever else asks in this tick."""
        if (f := fault_point("frontend.tokenize")) is not None:
            await f.apply_async()
        mine = _Pending(texts, add_special_tokens)
        self._pending.append(mine)
        if len(self._pending) == 1:
            # The first caller leads: one checkpoint lets the other requests parsed in
            # this tick join, then it encodes everyone's texts. Shielded, because the
            # followers wait on its result.
            with anyio.CancelScope(shield=True):
                await anyio.lowlevel.checkpoint()
                batch, self._pending = self._pending, []
                await self._run(batch)
        else:
            await mine.done.wait()
        if mine.error is not None:
            raise mine.error
        assert mine.result is not None
        return mine.result

    async def _run(self, batch: list[_Pending]) -> None:
        for flag in (True, False):
            group = [p for p in batch if p.add_special_tokens is flag]
            if not group:
                continue
            texts = [t for p in group for t in p.texts]
            try:
                if sum(map(len, texts)) <= self.inline_chars:
                    ids = self.tokenizer.encode_batch(texts, flag)
                else:
                    ids = await anyio.to_thread.run_sync(self.tokenizer.encode_batch, texts, flag)
                self.batches += 1
            except Exception as exc:  # noqa: BLE001 - handed to every waiter
                for p in group:
                    p.error = exc
                    p.done.set()
                continue
            pos = 0
            for p in group:
                p.result = ids[pos : pos + len(p.texts)]
                pos += len(p.texts)
                p.done.set()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def held_back(text: str, markers: tuple[str, ...]) -> int:
    """How much of ``text``'s end to hold back while streaming: the longest suffix that
    is a proper prefix of one of ``markers`` (a stop string, a tag, a tool-call opener
    that the next tokens may complete)."""
    best = 0
    for marker in markers:
        for k in range(min(len(text), len(marker) - 1), best, -1):
            if marker.startswith(text[-k:]):
                best = k
                break
    return best


class SampleText:
    """The text of one output sample, grown token by token.

    While streaming, a tail that could be the beginning of a stop string is held back, so
    text shown to the client never has to be taken back when the stop string completes
    (the worker ends the request on the token that completes it, ``[Finish.STOP, str]``). A
    ``stop_regex`` match is trimmed at the end only: what could still become a match of
    a regex is not known while streaming (SGLang holds nothing back either).
    """

    __slots__ = ("_decoder", "_stops", "_trim", "raw", "_before_last", "_last_id")

    def __init__(
        self,
        tokenizer: TokenizerLike,
        *,
        skip_special_tokens: bool = True,
        stops: tuple[str, ...] = (),
        no_stop_trim: bool = False,
    ) -> None:
        self._decoder = tokenizer.decode_stream(skip_special_tokens)
        self._stops = stops
        self._trim = not no_stop_trim
        self.raw = ""
        self._before_last = 0
        self._last_id = -1

    def feed(self, ids: list[int]) -> None:
        step = self._decoder.step
        for i in ids:
            self._before_last = len(self.raw)
            self._last_id = i
            self.raw += step(i)

    def visible(self, sent: int) -> str:
        """Text safe to show now; ``sent`` is how much was shown already."""
        raw = self.raw
        if not self._stops or not self._trim:
            return raw
        end = len(raw)
        for stop in self._stops:
            at = raw.find(stop, sent)  # a whole match (its finish is on its way)
            if at >= 0:
                end = min(end, at)
                continue
            end = min(end, len(raw) - held_back(raw, (stop,)))  # could become a match
        return raw[: max(sent, end)]

    def final(self, finish: Any, sent: int) -> str:
        """The whole text once the sample ended with ``finish`` (a finish-reason dict)."""
        self.raw += self._decoder.flush()
        raw = self.raw
        if not self._trim or not isinstance(finish, dict) or finish.get("type") != Finish.STOP:
            return raw
        matched = finish.get("matched")
        if isinstance(matched, str) and matched and finish.get("regex") is not None:
            # A stop_regex match: the worker found it in the text's last tokens, so it
            # is the last occurrence (an earlier one would have ended the text there).
            idx = raw.rfind(matched)
            return raw[:idx] if idx >= 0 else raw
        if isinstance(matched, str) and matched:
            idx = raw.find(matched, min(sent, len(raw)))
            if idx < 0:
                idx = raw.rfind(matched)
            return raw[:idx] if idx >= 0 else raw
        if isinstance(matched, int) and matched == self._last_id:
            return raw[: self._before_last]
        return raw
