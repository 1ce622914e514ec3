"""Length-prefixed framing (sans-IO): 4-byte big-endian length, then one CBOR item."""

from __future__ import annotations

import struct

__all__ = ["MAX_FRAME_BYTES", "FrameBuffer", "frame_bytes"]

MAX_FRAME_BYTES = 64 * 1024 * 1024
_LEN = struct.Struct(">I")


def frame_bytes(payload: bytes) -> bytes:
    """Prefix one encoded frame with its length."""
    if len(payload) > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {len(payload)} bytes exceeds {MAX_FRAME_BYTES}")
    return _LEN.pack(len(payload)) + payload


class FrameBuffer:
    """Accumulates received bytes and yields complete frame payloads.

    Raises ``ValueError`` for a declared length over ``MAX_FRAME_BYTES``: the peer is
    broken or hostile, and the connection must be closed.
    """

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        out: list[bytes] = []
        buf = self._buf
        pos = 0
        while len(buf) - pos >= 4:
            (size,) = _LEN.unpack_from(buf, pos)
            if size > MAX_FRAME_BYTES:
                raise ValueError(f"declared frame length {size} exceeds {MAX_FRAME_BYTES}")
            if len(buf) - pos - 4 < size:
                break
            out.append(bytes(buf[pos + 4 : pos + 4 + size]))
            pos += 4 + size
        if pos:
            del buf[:pos]
        return out

    @property
    def pending(self) -> int:
        return len(self._buf)
