"""``lifecycle batch INPUT.jsonl OUTPUT.jsonl``: a file of requests through an Engine,
one result line per input line, resumable (docs/engine.md).

Input lines are OpenAI batch-file requests (``{"custom_id", "method", "url", "body"}``
for ``/v1/chat/completions``, ``/v1/completions`` or ``/v1/embeddings``) or native ones
(``{"text"|"prompt" | "input_ids", "sampling_params", ...}``, any ``/generate`` field,
optional ``custom_id``). Each output line names its input line (``line``, counted from 1
as an editor counts them) and is written
whole, in one ``write``, as its request ends; a rerun with the same output first drops a
torn last line, then skips every line already written, so each line's result is there
exactly once however often the run is cut.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from lifecycle.engine.requests import EngineError, Requests, caller_left, windowed
from lifecycle.faces.embeddings import EmbeddingsFace
from lifecycle.faces.openai import OpenAIFace
from lifecycle.faces.openai_errors import OpenAIError

__all__ = ["BatchSummary", "done_lines", "read_lines", "run_lines"]


@dataclass(slots=True)
class BatchSummary:
    lines: int = 0  # input lines read
    skipped: int = 0  # already in the output
    ok: int = 0
    failed: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    errors: dict[str, int] = field(default_factory=dict)

    def line(self) -> str:
        rate = self.completion_tokens / self.seconds if self.seconds else 0.0
        return (
            f"{self.lines} lines: {self.ok} done, {self.failed} failed, {self.skipped} skipped "
            f"(done before); {self.completion_tokens} tokens in {self.seconds:.1f} s "
            f"({rate:.1f} tok/s)"
        )


def done_lines(output: Path) -> set[int]:
    """The input lines the output already answers; a torn last line (a run cut in the
    middle of its write) is cut off the file."""
    if not output.exists():
        return set()
    data = output.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with open(output, "r+b") as f:
            f.truncate(end)
    done = set()
    for raw in data[:end].splitlines():
        try:
            done.add(int(orjson.loads(raw)["line"]))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            continue  # not ours: left as it is
    return done


def read_lines(path: Path, skip: set[int]) -> Iterator[tuple[int, Any]]:
    """``(line number, parsed JSON or the parse error)`` of each non-blank line not in
    ``skip``, read as the run goes (the file is never all in memory)."""
    with open(path, "rb") as f:
        for i, raw in enumerate(f, 1):  # numbered from 1, as editors and messages count
            if i in skip or not raw.strip():
                continue
            try:
                yield i, orjson.loads(raw)
            except orjson.JSONDecodeError as exc:
                yield i, ValueError(f"line {i} is not JSON: {exc}")


async def run_lines(
    requests: Requests,
    openai: OpenAIFace,
    lines: Iterator[tuple[int, Any]],
    output: Path,
    window: int,
    summary: BatchSummary,
    progress: Any = None,
) -> None:
    """Every line, ``window`` at a time; each result appended as one write."""
    fd = os.open(output, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    t0 = time.monotonic()

    def counted() -> Iterator[tuple[int, Any]]:
        for line in lines:
            summary.lines += 1
            yield line

    async def one(line: tuple[int, Any]) -> None:
        record = await _answer(requests, openai, *line)  # never raises: errors are lines
        _count(summary, record)
        os.write(fd, orjson.dumps(record) + b"\n")
        if progress is not None:
            progress.update(1)

    try:
        await windowed(counted(), window, one)
    finally:
        os.close(fd)
        summary.seconds += time.monotonic() - t0


async def _answer(requests: Requests, openai: OpenAIFace, i: int, obj: Any) -> dict[str, Any]:
    if isinstance(obj, ValueError):
        return {"line": i, "custom_id": None, "error": {"cause": "invalid", "message": str(obj)}}
    if not isinstance(obj, dict):
        obj = {"_": obj}
    custom_id = obj.get("custom_id")
    if "url" in obj or "body" in obj:
        return await _openai_line(openai, i, custom_id, obj)
    body = {k: v for k, v in obj.items() if k not in ("custom_id", "id")}
    if "prompt" in body and "text" not in body:
        body["text"] = body.pop("prompt")
    body.setdefault("rid", uuid.uuid4().hex)
    try:
        results = await requests.run(body)
    except EngineError as exc:
        err = {"cause": exc.cause, "status": exc.status, "message": exc.message}
        return {"line": i, "custom_id": custom_id, "error": err}
    result: Any = results if len(results) > 1 or isinstance(body.get("text"), list) else results[0]
    return {"line": i, "custom_id": custom_id, "result": result}


async def _openai_line(
    openai: OpenAIFace, i: int, custom_id: Any, obj: dict[str, Any]
) -> dict[str, Any]:
    request_id = f"batch_req_{uuid.uuid4().hex}"
    try:
        if obj.get("url") == "/v1/embeddings":  # OpenAI's Batch API takes them too
            face = EmbeddingsFace(
                openai.fe, model_id=openai.model_id, model_names=openai.model_names
            )
            reply = await face.reply(obj.get("body"), caller_left)
        else:
            reply = await openai.reply(obj.get("url"), obj.get("body"), caller_left)
        response = {"status_code": 200, "request_id": request_id, "body": reply}
    except OpenAIError as exc:
        response = {"status_code": exc.status, "request_id": request_id, "body": exc.body()}
    return {
        "id": request_id,
        "line": i,
        "custom_id": custom_id,
        "response": response,
        "error": None,
    }


def _count(summary: BatchSummary, record: dict[str, Any]) -> None:
    if "result" in record:
        summary.ok += 1
        results = record["result"] if isinstance(record["result"], list) else [record["result"]]
        summary.completion_tokens += sum(r["meta_info"]["completion_tokens"] for r in results)
        return
    response = record.get("response")
    if response is not None and response["status_code"] == 200:
        summary.ok += 1
        # an embeddings reply has no completion tokens
        summary.completion_tokens += response["body"]["usage"].get("completion_tokens", 0)
        return
    summary.failed += 1
    cause = (
        record["error"]["cause"]
        if record.get("error")
        else str(response["body"]["error"].get("code") or response["status_code"])
        if response is not None
        else "unknown"
    )
    summary.errors[cause] = summary.errors.get(cause, 0) + 1
