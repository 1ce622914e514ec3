"""The baseline a Python LLM server usually is: FastAPI on uvicorn, no model.

Every request gets ``max_new_tokens`` (or ``max_tokens``) scripted tokens at once, in
the response shapes of SGLang's ``/generate`` (cumulative ``text`` and ``output_ids``,
``meta_info.completion_tokens``, ``data: [DONE]``) and OpenAI's ``/v1/completions`` and
``/v1/chat/completions``. Prompts are not tokenized (``prompt_tokens`` counts words or
ids), so the CPU it spends per request is the HTTP + JSON + streaming cost of the stack,
a floor for a real Python frontend.

    python -m bench.baseline_fastapi --port 0     # prints "LISTENING <host> <port>"

A request may carry ``"scripted_fault"``: ``"http_500"`` (answer 500), ``"truncate"``
(stop the stream half-way without ``[DONE]``), ``"drop"`` (break the connection
half-way), or, on ``/generate``, ``"short"`` (one token fewer than asked, ended as if
whole). The load generator's tests use these to check failures and short answers are
counted.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

__all__ = ["build_app", "main", "token_text"]

_WORDS = ("the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as")


def token_text(i: int) -> str:
    """The text of scripted token i (one word, a leading space: one BPE token)."""
    return " " + _WORDS[i % len(_WORDS)]


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


_DONE = b"data: [DONE]\n\n"


class _Fault(Exception):
    """A scripted mid-stream failure: the server drops the connection."""


def _prompt_tokens(body: dict[str, Any], key: str) -> int:
    value = body.get(key)
    if isinstance(value, list):
        return len(value)
    return len(str(value or "").split())


async def _pace(delay_s: float) -> None:
    if delay_s > 0:
        await asyncio.sleep(delay_s)


def _generate_frames(n: int, prompt_tokens: int, rid: str) -> list[bytes]:
    """SGLang's default (cumulative) stream: the full text and ids so far in each frame."""
    frames = []
    text = ""
    for i in range(n):
        text += token_text(i)
        finish = {"type": "length", "length": n} if i == n - 1 else None
        meta = {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": i + 1,
            "cached_tokens": 0,
        }
        frames.append(
            _sse({"text": text, "output_ids": list(range(100, 101 + i)), "meta_info": meta})
        )
    return frames


def _openai_frames(n: int, prompt_tokens: int, rid: str, chat: bool) -> list[bytes]:
    kind = "chat.completion.chunk" if chat else "text_completion"
    frames = []
    for i in range(n):
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length" if i == n - 1 else None}
        if chat:
            choice["delta"] = {"content": token_text(i)}
        else:
            choice.update(text=token_text(i), logprobs=None)
        frames.append(
            _sse(
                {"id": rid, "object": kind, "created": 0, "model": "scripted", "choices": [choice]}
            )
        )
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": n,
        "total_tokens": prompt_tokens + n,
    }
    frames.append(
        _sse(
            {
                "id": rid,
                "object": kind,
                "created": 0,
                "model": "scripted",
                "choices": [],
                "usage": usage,
            }
        )
    )
    return frames


async def _stream(frames: list[bytes], fault: str | None, delay_s: float) -> AsyncIterator[bytes]:
    cut = len(frames) // 2 if fault in ("truncate", "drop") else None
    for i, frame in enumerate(frames):
        if i == cut:
            if fault == "drop":
                raise _Fault("scripted connection drop")
            return  # "truncate": the body ends cleanly but without [DONE]
        await _pace(delay_s)
        yield frame
    yield _DONE


def build_app(delay_s: float = 0.0) -> FastAPI:
    """The app; ``delay_s`` paces scripted tokens (0: all at once)."""
    app = FastAPI()
    counter = iter(range(1 << 62))

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "scripted", "object": "model"}]}

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = orjson.loads(await request.body())
        fault = body.get("scripted_fault")
        if fault == "http_500":
            return JSONResponse({"error": {"message": "scripted failure"}}, status_code=500)
        n = int((body.get("sampling_params") or {}).get("max_new_tokens", 16))
        n -= fault == "short"
        key = "input_ids" if "input_ids" in body else "text"
        frames = _generate_frames(n, _prompt_tokens(body, key), str(next(counter)))
        if body.get("stream"):
            return StreamingResponse(
                _stream(frames, fault, delay_s), media_type="text/event-stream"
            )
        text = "".join(token_text(i) for i in range(n))
        meta = {
            "id": str(next(counter)),
            "finish_reason": {"type": "length", "length": n},
            "prompt_tokens": _prompt_tokens(body, key),
            "completion_tokens": n,
            "cached_tokens": 0,
            "e2e_latency": 0.0,
        }
        return Response(
            orjson.dumps(
                {"text": text, "output_ids": list(range(100, 100 + n)), "meta_info": meta}
            ),
            media_type="application/json",
        )

    async def openai(request: Request, chat: bool) -> Response:
        body = orjson.loads(await request.body())
        fault = body.get("scripted_fault")
        if fault == "http_500":
            return JSONResponse({"error": {"message": "scripted failure"}}, status_code=500)
        n = int(body.get("max_tokens", 16))
        ptoks = _prompt_tokens(body, "messages" if chat else "prompt")
        rid = f"cmpl-{next(counter)}"
        if body.get("stream"):
            frames = _openai_frames(n, ptoks, rid, chat)
            return StreamingResponse(
                _stream(frames, fault, delay_s), media_type="text/event-stream"
            )
        text = "".join(token_text(i) for i in range(n))
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice.update(text=text, logprobs=None)
        usage = {"prompt_tokens": ptoks, "completion_tokens": n, "total_tokens": ptoks + n}
        obj = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": "scripted",
            "choices": [choice],
            "usage": usage,
        }
        return Response(orjson.dumps(obj), media_type="application/json")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await openai(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await openai(request, chat=True)

    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.baseline_fastapi",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30001, help="0 picks a free port")
    p.add_argument(
        "--http",
        choices=("auto", "h11", "httptools"),
        default="auto",
        help="uvicorn's HTTP parser (auto: httptools when installed)",
    )
    p.add_argument("--token-delay-ms", type=float, default=0.0)
    args = p.parse_args(argv)
    # proto must be IPPROTO_TCP: asyncio sets TCP_NODELAY on accepted sockets only when
    # it is, and without it Nagle + delayed ACK add ~40 ms to every keep-alive response.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(1024)
    sock.set_inheritable(True)
    host, port = sock.getsockname()[:2]
    print(f"LISTENING {host} {port}", flush=True)
    config = uvicorn.Config(
        build_app(args.token_delay_ms / 1e3),
        http=args.http,
        loop="asyncio",
        lifespan="off",
        access_log=False,
        log_level="warning",
    )
    uvicorn.Server(config).run(sockets=[sock])
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
