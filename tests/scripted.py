"""Helpers to run the scripted worker (``lifecycle.testing.scripted_worker``) as a real process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from wire.child import stop_process

ROOT = Path(__file__).resolve().parent.parent


def scripted_worker_argv(address: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "lifecycle.testing.scripted_worker", "--listen", address, *args]


@contextmanager
def scripted_worker(*args: str) -> Iterator[str]:
    """Start a scripted worker on a Unix socket; yields its address."""
    with tempfile.TemporaryDirectory(prefix="lc-sw-") as tmp:
        path = os.path.join(tmp, "w.sock")
        proc = subprocess.Popen(scripted_worker_argv(f"unix:{path}", *args), cwd=ROOT)
        try:
            deadline = time.monotonic() + 20
            while not os.path.exists(path):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("scripted worker did not start")
                time.sleep(0.02)
            yield f"unix:{path}"
        finally:
            proc.kill()
            proc.wait()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def without_model_label(line: str) -> str:
    """A ``/metrics`` sample line less its ``model_name`` label (every series of a model
    has one)."""
    line = re.sub(r',model_name="[^"]*"', "", line)
    return re.sub(r'model_name="[^"]*",?', "", line)


@contextmanager
def lifecycle_server(*args: str, wait_ready: bool = True) -> Iterator[str]:
    """``python -m lifecycle serve`` as a real process; yields its base URL."""
    with server_process(*args, wait_ready=wait_ready) as (url, _):
        yield url


@contextmanager
def listening_worker(sock: Path, *args: str, log: Path, timeout: float = 120.0) -> Iterator[str]:
    """``python -m lifecycle worker --listen unix:SOCK ARGS`` from this checkout, its
    output in ``log``: a worker started elsewhere, as a frontend's ``--worker`` names it.
    Yields that address once the socket exists; stopped at the end."""
    argv = [sys.executable, "-m", "lifecycle", "worker", "--listen", f"unix:{sock}", *args]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout
        while not sock.exists():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the worker did not listen in time"
            time.sleep(0.05)
        yield f"unix:{sock}"
    finally:
        stop_process(proc)


@contextmanager
def server_process(
    *args: str,
    wait_ready: bool = True,
    env: dict[str, str] | None = None,
    ready: Callable[[str], bool] | None = None,
    timeout: float = 120.0,
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``python -m lifecycle serve`` as a real process (``env``: added to this one's);
    yields its base URL and the process once ``/health`` is 200 (and ``ready(url)``
    holds, when given), or at once it answers with ``wait_ready=False``."""
    import httpx

    port = free_port()
    argv = [sys.executable, "-m", "lifecycle", "serve", "--port", str(port), *args]
    proc = subprocess.Popen(argv, cwd=ROOT, env=None if env is None else {**os.environ, **env})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError("server did not become ready")
            try:
                r = httpx.get(url + "/health", timeout=2)
                if not wait_ready or (r.status_code == 200 and (ready is None or ready(url))):
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        yield url, proc
    finally:
        stop_process(proc)


async def count_stream(
    url: str, i: int, tokens: int, progress: list[int] | None = None
) -> tuple[str, int]:
    """A streamed /generate of ``tokens`` forced tokens on a connection of its own, and
    how it ended: ("done" | "short" | "error" | "cut", tokens seen). "done" is [DONE]
    after every token and no error event, "short" [DONE] after fewer, "error" an error
    event, "cut" a stream that ended without [DONE]; ``progress[i]`` follows the tokens."""
    import json

    import httpx

    body = {"input_ids": [100 + i, 200 + i, 300], "stream": True,
            "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}}  # fmt: skip
    seen, error = 0, False
    try:
        async with httpx.AsyncClient(timeout=60) as c:
            async with c.stream("POST", url + "/generate", json=body) as r:
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        return ("error" if error else "done" if seen == tokens else "short"), seen
                    if line.startswith("data: "):
                        event = json.loads(line[6:])
                        if "error" in event:
                            error = True
                        else:
                            seen = len(event["output_ids"])
                            if progress is not None:
                                progress[i] = seen
    except httpx.TransportError:
        pass
    return ("error" if error else "cut"), seen


@contextmanager
def template_server(folder: Path, template: str) -> Iterator[str]:
    """A server on the scripted worker whose chat template is ``template``
    (``--chat-template``, written under ``folder``): the worker echoes the prompt, so a
    reply shows the text the template rendered (``echoed_chat_prompt``)."""
    path = folder / "chat.jinja"
    path.write_text(template, encoding="utf-8")
    with lifecycle_server("--scripted-worker", "--chat-template", str(path)) as base:
        yield base


def echoed_chat_prompt(url: str, **body: object) -> str:
    """The prompt a chat request rendered, as ``template_server``'s worker echoes it back
    (one token a step: a first call learns its length, a second generates that many)."""
    import httpx

    def post(max_tokens: int) -> dict[str, Any]:
        r = httpx.post(url + "/v1/chat/completions", json={"max_tokens": max_tokens, **body})
        assert r.status_code == 200, r.text
        return dict(r.json())

    n = post(1)["usage"]["prompt_tokens"]
    return str(post(n)["choices"][0]["message"]["content"])
