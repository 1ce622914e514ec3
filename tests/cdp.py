"""A headless Chromium driven over the Chrome DevTools protocol (for the debug page test).

Just enough of CDP: launch with ``--remote-debugging-port=0``, read the port Chromium
picked from ``DevToolsActivePort``, attach to one page (flattened sessions), send
commands, evaluate JavaScript, and collect console errors and uncaught exceptions.
"""

from __future__ import annotations

import base64
import itertools
import json
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import websockets

from wire.child import stop_process

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,900",
]


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Page:
    """One browser tab: ``send`` a CDP command, ``eval`` JS, ``wait_for`` a JS condition."""

    def __init__(self, ws: Any) -> None:
        self._ws = ws
        self._ids = itertools.count(1)
        self._waiting: dict[int, Any] = {}
        self._session: str | None = None
        self.errors: list[str] = []

    async def _read(self) -> None:
        async for raw in self._ws:
            msg = json.loads(raw)
            if "id" in msg:
                send = self._waiting.pop(msg["id"], None)
                if send is not None:
                    send.send_nowait(msg)
            else:
                self._event(msg["method"], msg.get("params", {}))

    def _event(self, method: str, params: dict[str, Any]) -> None:
        if method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
            args = [a.get("value", a.get("description")) for a in params["args"]]
            self.errors.append(f"console.{params['type']}: {args}")
        elif method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            self.errors.append(f"exception: {text}")
        elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
            entry = params["entry"]
            self.errors.append(f"log {entry['source']}: {entry['text']} {entry.get('url', '')}")

    async def send(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        id = next(self._ids)
        send, recv = anyio.create_memory_object_stream[dict[str, Any]](1)
        self._waiting[id] = send
        msg: dict[str, Any] = {"id": id, "method": method, "params": params or {}}
        if self._session is not None and not method.startswith("Target."):
            msg["sessionId"] = self._session
        await self._ws.send(json.dumps(msg))
        with send, recv:
            reply = await recv.receive()
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return dict(reply.get("result", {}))

    async def eval(self, expression: str) -> Any:
        result = await self.send(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 15.0) -> Any:
        """Poll ``expression`` until it is truthy; its value.

        An evaluation that fails (the page is navigating, its context is gone) counts as
        not yet.
        """
        with anyio.fail_after(timeout):
            while True:
                try:
                    value = await self.eval(expression)
                except RuntimeError:
                    value = None
                if value:
                    return value
                await anyio.sleep(0.05)

    async def screenshot(self, path: Path) -> None:
        shot = await self.send("Page.captureScreenshot", {"format": "png"})
        path.write_bytes(base64.b64decode(shot["data"]))


async def _devtools_port(profile: Path, proc: subprocess.Popen[bytes]) -> tuple[int, str]:
    marker = profile / "DevToolsActivePort"
    with anyio.fail_after(60):
        while not marker.exists() or len(marker.read_text().splitlines()) < 2:
            if proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {proc.returncode}")
            await anyio.sleep(0.1)
    port, path = marker.read_text().splitlines()[:2]
    return int(port), path


@asynccontextmanager
async def chromium_page(binary: str) -> AsyncIterator[Page]:
    """A fresh headless Chromium (own profile dir) with one attached blank page."""
    # Chromium's helper processes can outlive the browser process by a moment and still
    # write into the profile (seen once in CI: "Directory not empty: 'Default'"):
    # clean up with retries, and never fail the test over a leftover temp file.
    with tempfile.TemporaryDirectory(
        prefix="lifecycle-chromium-", ignore_cleanup_errors=True
    ) as tmp:
        profile = Path(tmp)
        proc = subprocess.Popen(
            [binary, *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            port, path = await _devtools_port(profile, proc)
            async with websockets.connect(f"ws://127.0.0.1:{port}{path}", max_size=64 << 20) as ws:
                page = Page(ws)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(page._read)
                    target = await page.send("Target.createTarget", {"url": "about:blank"})
                    attached = await page.send(
                        "Target.attachToTarget", {"targetId": target["targetId"], "flatten": True}
                    )
                    page._session = attached["sessionId"]
                    for domain in ("Runtime", "Log", "Page"):
                        await page.send(f"{domain}.enable")
                    yield page
                    tg.cancel_scope.cancel()
        finally:
            stop_process(proc)
            for _ in range(50):
                try:
                    shutil.rmtree(profile)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    await anyio.sleep(0.1)
