"""What a finished or streaming generate call gives its owner, in SGLang's ``/generate``
shapes: the one place the native HTTP API, the WebSocket route and the in-process Engine
take their result dicts and stream chunks from."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from lifecycle.core.call import GenerateCall

__all__ = ["chunks", "indexed", "is_multi", "unary_results"]


def is_multi(call: GenerateCall) -> bool:
    """A batch or ``n > 1``: the answer is a list, stream chunks carry ``index``."""
    return call.req.is_batch or len(call.samples()) > 1


def unary_results(call: GenerateCall) -> list[dict[str, Any]]:
    """Every sample's result of a call that ended well, in SGLang's order."""
    e2e = call.e2e()
    return [s.result(e2e) for s in call.samples()]


async def chunks(call: GenerateCall, incremental: bool) -> AsyncIterator[dict[str, Any]]:
    """The stream's chunks (cumulative or ``incremental``); ends when the call does, and
    the owner then reads ``call.error()``."""
    multi = is_multi(call)
    async for index, _sample, frame in call.frames(incremental):
        yield indexed(frame, index, multi)


def indexed(frame: dict[str, Any], index: int, multi: bool) -> dict[str, Any]:
    """A stream chunk: the frame, with its ``index`` when the answer is a list."""
    if multi:
        frame["index"] = index
    return frame
