"""One subscriber of the tracer's live feed (``GET /debug/feed``): the send side of its
bounded stream, and whether it lost a message.

The ``Tracer`` (``lifecycle/tracing/tracer.py``) builds one JSON message per tick and
offers it to every subscriber; an offer never waits. A client more than
``subscriber_queue`` messages behind loses the message, and the next one it takes says
``"resync": true`` so that it re-reads ``/debug/requests`` (docs/tracing.md). An offer
to a client that went away does nothing; the tracer's next tick drops it.
"""

from __future__ import annotations

import anyio
from anyio.streams.memory import MemoryObjectSendStream

__all__ = ["Subscriber"]


class Subscriber:
    """One feed client: the send side of its stream and whether it lost a message."""

    __slots__ = ("send", "lagging")

    def __init__(self, send: MemoryObjectSendStream[bytes]) -> None:
        self.send = send
        self.lagging = False

    @property
    def closed(self) -> bool:
        return self.send.statistics().open_receive_streams == 0

    def offer(self, message: bytes) -> None:
        if self.lagging:
            # Tell the client it missed messages: it re-reads /debug/requests.
            message = message.replace(b'"resync":false', b'"resync":true', 1)
        try:
            self.send.send_nowait(message)
            self.lagging = False
        except anyio.WouldBlock:
            self.lagging = True
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass
