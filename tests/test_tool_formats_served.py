"""Each tool format read back by the real server on the real model (SmolLM2-135M): the
chat API's ``regex`` forces the model to write a call in the server's format
(``tool_call_parser``), so the parser, not the model, is under test. Unary and streamed
run side by side: the calls read back, and the streamed fragments of each call add up to
the unary reply's arguments. One in-process app per format (the format is the frontend's),
each in turn connected to one real worker started for the module (``lifecycle worker
--listen``, as a worker started elsewhere is); the CLI accepts every name
(``--tool-call-parser``)."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import httpx
import pytest

from lifecycle.app import App
from lifecycle.chat.tool_formats import TOOL_FORMAT_ALIASES, TOOL_FORMATS, tool_format
from lifecycle.option_args import add_flags, option_values

from .app_helpers import running_app
from .scripted import listening_worker
from .tool_cases import TOOLS, USER

ADD_ONLY = [t for t in TOOLS if t["function"]["name"] == "add"]  # a short prompt

pytestmark = [pytest.mark.model, pytest.mark.timeout(300)]

SUM = {"a": 1, "b": 2}  # integers: the tagged formats' values typed by the schema
LEAD_ONLY = ("llama3",)  # a call only at the start of the reply


def _forced_text(fmt: str) -> tuple[str, str | None]:
    """The text the model is forced to write, and the content it leaves."""
    f = tool_format(fmt)
    call = f.prefix + f.write("add", SUM) + f.suffix
    return (call, None) if fmt in LEAD_ONLY else ("Sure. " + call, "Sure.")


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The bundled model's real worker, listening on a unix socket, for every format."""
    folder = tmp_path_factory.mktemp("formats")
    args = ("--device", "cpu", "--max-running", "2", "--kv-cache-tokens", "1024")
    with listening_worker(folder / "w.sock", *args, log=folder / "worker.log") as address:
        yield address


@pytest.fixture(params=sorted(TOOL_FORMATS))
async def served(request: Any, worker: str) -> AsyncIterator[tuple[str, App]]:
    async with running_app(worker=worker, tool_call_parser=request.param) as app:
        yield request.param, app


async def _unary(client: httpx.AsyncClient, body: dict[str, Any], out: list[Any]) -> None:
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out.append(r.json()["choices"][0])


async def _streamed(client: httpx.AsyncClient, body: dict[str, Any], out: list[Any]) -> None:
    content, calls, finish = "", {}, None
    async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                content += choice["delta"].get("content") or ""
                finish = choice.get("finish_reason") or finish
                for tc in choice["delta"].get("tool_calls") or ():
                    if "id" in tc:  # the head: name first, no arguments yet
                        assert tc["function"]["arguments"] == "" and tc["index"] == len(calls)
                        calls[tc["index"]] = [tc["function"]["name"], []]
                    else:
                        calls[tc["index"]][1].append(tc["function"]["arguments"])
    out.append((content or None, calls, finish))


@pytest.mark.anyio
async def test_the_server_reads_back_its_formats_calls(served: tuple[str, App]) -> None:
    fmt, app = served
    text, content = _forced_text(fmt)
    body = {"model": "default", "messages": USER, "tools": ADD_ONLY, "regex": re.escape(text),
            "max_tokens": 200, "temperature": 0}  # fmt: skip
    unary: list[Any] = []
    streamed: list[Any] = []
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.port}", timeout=120) as c:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_unary, c, body, unary)
            tg.start_soon(_streamed, c, body, streamed)
    (choice,) = unary
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls", choice
    assert message["content"] == content
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "add"
    assert json.loads(call["function"]["arguments"]) == SUM
    got_content, calls, finish = streamed[0]
    assert (got_content, finish) == (content, "tool_calls")
    assert len(calls) == 1 and calls[0][0] == "add"
    assert "".join(calls[0][1]) == call["function"]["arguments"]
    if fmt not in ("qwen3_coder", "glm45", "pythonic"):  # JSON text as it arrives
        assert len(calls[0][1]) > 1, calls


@pytest.mark.parametrize("name", [*TOOL_FORMATS, *TOOL_FORMAT_ALIASES])
def test_the_cli_accepts_every_name(name: str) -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser)
    args = parser.parse_args(["--tool-call-parser", name])
    assert option_values(args)["tool_call_parser"] == name
    assert tool_format(name).name in TOOL_FORMATS
