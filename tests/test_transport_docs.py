"""The embedding example in docs/transport.md runs as written (with a probe inserted)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from websockets.asyncio.client import connect as ws_connect

DOC = Path(__file__).resolve().parent.parent / "docs" / "transport.md"


@pytest.mark.timeout(30)
def test_embedding_example_serves_every_kind_of_response(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert code is not None
    source = code.group(1)
    for old, new in [
        ("port=8000", "port=0"),
        ('print("listening on", bound)', "await _probe(bound)"),
        ("await anyio.sleep(3600)", "pass"),
        ("anyio.run(main)", ""),
    ]:
        assert old in source, old
        source = source.replace(old, new)
    seen: dict[str, Any] = {}

    async def probe(bound: list[tuple[str, int]]) -> None:
        base = f"http://127.0.0.1:{bound[0][1]}"
        async with httpx.AsyncClient(base_url=base) as http:
            seen["model"] = (await http.get("/v1/models/smol")).json()
            seen["echo"] = (await http.post("/v1/echo", json={"a": 1})).json()
            async with http.stream("GET", "/v1/ticks") as r:
                seen["tick"] = await anext(r.aiter_lines())
        async with ws_connect(base.replace("http", "ws") + "/v1/ws") as ws:
            await ws.send("ping")
            seen["ws"] = await ws.recv()

    namespace: dict[str, Any] = {"_probe": probe}
    exec(compile(source, str(DOC), "exec"), namespace)
    anyio.run(namespace["main"])
    assert seen == {
        "model": {"id": "smol"},
        "echo": {"got": {"a": 1}},
        "tick": 'data: {"tick": 0}',
        "ws": "ping",
    }
    assert "stream ended: client_gone" in capsys.readouterr().out
