"""Server configuration: every limit and timeout in one place, with sane defaults."""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["ServerConfig"]

_FIELD_VALUE = re.compile(r"[\x21-\x7e\x80-\xff]+(?:[ \t]+[\x21-\x7e\x80-\xff]+)*")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Listener, limits and timeouts for one :class:`~transport.Server`.

    Timeouts are in seconds. ``header_timeout`` bounds the time from the first byte of a
    request (or from accept, for a fresh connection) to its complete head, which is what
    defeats slowloris; ``body_timeout`` bounds the time from the head to the end of the
    body; ``keepalive_timeout`` is how long an idle keep-alive connection may wait for
    its next request; ``send_timeout`` is how long one write may wait on a client that
    stopped reading before the connection is cut. ``drain_idle_timeout`` is how long,
    once a drain begins, an idle keep-alive connection still waits for a request: one
    already on its way gets 503 + Retry-After + ``Connection: close`` instead of a close
    the client cannot tell from a failure (RFC 9112 section 9.6).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    uds: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    # Sized so that 1,000 slowloris connections still leave room for real clients; the
    # server raises the process's open-file soft limit to fit (see Server.serve).
    max_connections: int = 4096
    max_header_bytes: int = 16384
    max_body_bytes: int = 8 * 1024 * 1024
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    keepalive_timeout: float = 5.0
    send_timeout: float = 30.0
    shutdown_timeout: float = 10.0
    drain_idle_timeout: float = 1.0
    ws_max_message_bytes: int = 4 * 1024 * 1024
    ws_ping_interval: float | None = None
    sse_ping_interval: float = 15.0
    server_header: str = "lifecycle"
    backlog: int = 2048
    # SO_REUSEPORT: several processes listen on the same port and the kernel spreads the
    # connections among them (TCP only).
    reuse_port: bool = False
    # False: every request goes through h11, none through the fast path (``fastpath``).
    # The two must answer alike; the corpus test (tests/test_transport_corpus.py) runs
    # every hostile input both ways to prove it.
    fast_path: bool = True

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_header_bytes", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"ServerConfig.{name} must be >= 1")
        for name in (
            "header_timeout",
            "body_timeout",
            "keepalive_timeout",
            "send_timeout",
            "shutdown_timeout",
            "drain_idle_timeout",
            "sse_ping_interval",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"ServerConfig.{name} must be > 0")
        if not _FIELD_VALUE.fullmatch(self.server_header):  # written as is, every response
            raise ValueError("ServerConfig.server_header must be a valid header value")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("ssl_certfile and ssl_keyfile go together")
