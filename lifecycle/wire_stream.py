"""Frames over an anyio byte stream: the thin driver around the sans-IO ``wire`` codec.

Addresses are ``unix:/path/to/sock`` or ``tcp:HOST:PORT`` (a bare ``HOST:PORT`` is read
as TCP), the same spelling the worker's ``--listen`` takes.
"""

from __future__ import annotations

import anyio
import anyio.abc

from wire import Frame, FrameBuffer, decode_frame, encode_frame, frame_bytes
from wire.address import Address, parse_address
from wire.faults import Fault, fault_point

__all__ = ["Address", "FrameStream", "connect", "listen", "parse_address"]

_READ_SIZE = 1 << 20


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

    __slots__ = ("_stream", "_buf", "_ready", "_lock", "_send_point", "_recv_point")

    def __init__(self, stream: anyio.abc.ByteStream, side: str = "frontend") -> None:
        self._stream = stream
        self._buf = FrameBuffer()
        self._ready: list[bytes] = []
        self._lock = anyio.Lock()
        # Fault points (``wire.faults``): "frontend.frame_send", "worker.frame_recv", ...
        self._send_point = f"{side}.frame_send"
        self._recv_point = f"{side}.frame_recv"

    async def send(self, frame: Frame) -> None:
        data = frame_bytes(encode_frame(frame))
        if (f := fault_point(self._send_point)) is not None:
            data = await self._inject(await f.apply_async(), data)
        async with self._lock:
            await self._stream.send(data)

    async def _inject(self, fault: Fault | None, data: bytes) -> bytes:
        if fault is None:
            return data
        if fault.action == "drop":
            await self.aclose()
            raise anyio.BrokenResourceError(fault.message)
        return _corrupt(data, head=4)

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
        payload = self._ready.pop()
        if (f := fault_point(self._recv_point)) is not None:
            f = await f.apply_async()
            if f is not None and f.action == "drop":
                await self.aclose()
                raise anyio.EndOfStream
            if f is not None:
                payload = _corrupt(payload, head=0)
        return decode_frame(payload)

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            await self._stream.aclose()


def _corrupt(data: bytes, head: int) -> bytes:
    """Keep the length prefix, garble the CBOR: the peer must refuse the frame, not crash."""
    return data[:head] + b"\xff" * (len(data) - head)
