"""Frames over an anyio byte stream: the thin driver around the sans-IO ``wire`` codec.

Addresses are ``unix:/path/to/sock`` or ``tcp:HOST:PORT`` (a bare ``HOST:PORT`` is read
as TCP), the same spelling the worker's ``--listen`` takes.
"""

from __future__ import annotations

from dataclasses import dataclass

import anyio
import anyio.abc

from wire import Frame, FrameBuffer, decode_frame, encode_frame, frame_bytes

__all__ = ["Address", "FrameStream", "connect", "listen", "parse_address"]

_READ_SIZE = 1 << 20


@dataclass(frozen=True, slots=True)
class Address:
    kind: str  # "unix" | "tcp"
    path: str = ""
    host: str = ""
    port: int = 0

    def __str__(self) -> str:
        return f"unix:{self.path}" if self.kind == "unix" else f"tcp:{self.host}:{self.port}"


def parse_address(text: str) -> Address:
    if text.startswith("unix:"):
        return Address("unix", path=text[5:])
    rest = text[4:] if text.startswith("tcp:") else text
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"bad worker address {text!r}: use unix:/path or tcp:HOST:PORT")
    return Address("tcp", host=host.strip("[]") or "127.0.0.1", port=int(port))


async def connect(address: Address) -> FrameStream:
    if address.kind == "unix":
        stream: anyio.abc.ByteStream = await anyio.connect_unix(address.path)
    else:
        stream = await anyio.connect_tcp(address.host, address.port)
    return FrameStream(stream)


async def listen(address: Address) -> anyio.abc.Listener[anyio.abc.ByteStream]:
    if address.kind == "unix":
        return await anyio.create_unix_listener(address.path)
    return await anyio.create_tcp_listener(local_host=address.host, local_port=address.port)


class FrameStream:
    """Whole frames in and out. Sends are serialised by a lock (several tasks write)."""

    __slots__ = ("_stream", "_buf", "_ready", "_lock")

    def __init__(self, stream: anyio.abc.ByteStream) -> None:
        self._stream = stream
        self._buf = FrameBuffer()
        self._ready: list[bytes] = []
        self._lock = anyio.Lock()

    async def send(self, frame: Frame) -> None:
        data = frame_bytes(encode_frame(frame))
        async with self._lock:
            await self._stream.send(data)

    async def receive(self) -> Frame:
        """The next frame; ``anyio.EndOfStream`` when the peer closed.

        Raises ``WireError``/``ValueError`` for a corrupt frame (the caller closes)."""
        while not self._ready:
            try:
                data = await self._stream.receive(_READ_SIZE)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                raise anyio.EndOfStream from None
            self._ready = self._buf.feed(data)
            self._ready.reverse()
        return decode_frame(self._ready.pop())

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            await self._stream.aclose()
