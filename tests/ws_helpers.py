"""Helpers for the WebSocket tests: a ``websockets`` client session and server probes."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import cbor2
import httpx
import psutil


def gen_msg(mid: Any, body: dict[str, Any]) -> str:
    return json.dumps({"type": "generate", "id": mid, "body": body})


def echo_body(i: int, max_new: int) -> dict[str, Any]:
    """A body whose scripted output is known: the prompt ids, cyclically (no id is EOS)."""
    prompt = [100 + 7 * i, 200 + i, 300 + 3 * i]
    return {"input_ids": prompt, "sampling_params": {"max_new_tokens": max_new}}


def echo_ids(body: dict[str, Any]) -> list[int]:
    prompt = body["input_ids"]
    n = body["sampling_params"]["max_new_tokens"]
    return [prompt[k % len(prompt)] for k in range(n)]


class Collected:
    """Messages of one socket, grouped by generation id."""

    def __init__(self) -> None:
        self.deltas: dict[Any, list[dict[str, Any]]] = defaultdict(list)
        self.final: dict[Any, dict[str, Any]] = {}

    def add(self, raw: str | bytes) -> dict[str, Any]:
        msg = cbor2.loads(raw) if isinstance(raw, bytes) else json.loads(raw)
        if msg["type"] == "delta":
            assert msg["id"] not in self.final, f"delta after the end of {msg['id']}"
            self.deltas[msg["id"]].append(msg)
        else:
            assert msg["id"] not in self.final, f"two terminal messages for {msg['id']}"
            self.final[msg["id"]] = msg
        return msg

    def ids(self, mid: Any) -> list[int]:
        return [t for d in self.deltas[mid] for t in d["output_ids"]]

    def text(self, mid: Any) -> str:
        return "".join(d["text"] for d in self.deltas[mid])


async def collect(ws: Any, expect: int, into: Collected | None = None) -> Collected:
    """Read until ``expect`` generations have their terminal message."""
    got = into or Collected()
    while len(got.final) < expect:
        got.add(await ws.recv())
    return got


def server_info(url: str) -> dict[str, Any]:
    return httpx.get(url + "/server_info", timeout=10).json()


def worker_load(url: str) -> int:
    s = server_info(url)["internal_states"][0]
    return int(s["running"]) + int(s["waiting"])


def wait_idle(url: str, timeout: float = 10.0) -> dict[str, Any]:
    """No live request, no tombstone, every KV block free, within ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        info = server_info(url)
        s = info["internal_states"][0]
        if (
            info["live_requests"] == 0
            and info["tombstones"] == 0
            and s["kv_blocks_free"] == s["kv_blocks_total"]
            and s["running"] == 0
            and s["waiting"] == 0
        ):
            return info
        if time.monotonic() > deadline:
            raise AssertionError(f"not idle: {info}")
        time.sleep(0.02)


def server_process(url: str) -> psutil.Process:
    """The ``lifecycle serve`` child of this test process listening on ``url``'s port."""
    port = url.rsplit(":", 1)[1]
    for child in psutil.Process().children(recursive=True):
        try:
            argv = child.cmdline()
        except psutil.Error:
            continue
        if "serve" in argv and port in argv:
            return child
    raise AssertionError(f"no server process for {url}")


class SilentClient:
    """A WebSocket client (wsproto) that sends and never reads after the handshake."""

    def __init__(self, host: str, port: int, path: str) -> None:
        import socket

        from wsproto import ConnectionType, WSConnection
        from wsproto.events import AcceptConnection, Request

        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect
        self.sock.connect((host, port))
        self.ws = WSConnection(ConnectionType.CLIENT)
        self.sock.sendall(self.ws.send(Request(host=host, target=path)))
        accepted = False
        while not accepted:
            data = self.sock.recv(4096)
            assert data, "closed during the handshake"
            self.ws.receive_data(data)
            accepted = any(isinstance(e, AcceptConnection) for e in self.ws.events())

    def send_text(self, text: str) -> None:
        from wsproto.events import TextMessage

        self.sock.sendall(self.ws.send(TextMessage(data=text)))

    def close(self) -> None:
        self.sock.close()

    def read_messages(self) -> Iterator[str | bytes]:
        """Start reading at last: every complete message, in order."""
        from wsproto.events import BytesMessage, TextMessage

        parts: list[Any] = []
        while True:
            data = self.sock.recv(65536)
            if not data:
                return
            self.ws.receive_data(data)
            for event in self.ws.events():
                if isinstance(event, (TextMessage, BytesMessage)):
                    parts.append(event.data)
                    if event.message_finished:
                        joined = (
                            "".join(parts) if isinstance(event, TextMessage) else b"".join(parts)
                        )
                        parts = []
                        yield joined
