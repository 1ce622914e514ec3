"""Worker addresses: ``unix:/path/to/sock``, ``tcp:HOST:PORT`` (a bare ``HOST:PORT`` is
read as TCP) or ``tls:HOST:PORT`` (TCP inside TLS). One parser for both ends: the
worker's ``--listen`` and the frontend's ``--worker`` take the same spelling."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

__all__ = ["Address", "listen_unix", "parse_address"]


@dataclass(frozen=True, slots=True)
class Address:
    kind: str  # "unix" | "tcp"
    path: str = ""
    host: str = ""
    port: int = 0
    tls: bool = False  # TCP only: the link runs inside TLS

    def __str__(self) -> str:
        if self.kind == "unix":
            return f"unix:{self.path}"
        return f"{'tls' if self.tls else 'tcp'}:{self.host}:{self.port}"


def parse_address(text: str) -> Address:
    if text.startswith("unix:"):
        return Address("unix", path=text[5:])
    tls = text.startswith("tls:")
    rest = text[4:] if text.startswith(("tcp:", "tls:")) else text
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(
            f"bad worker address {text!r}: use unix:/path, tcp:HOST:PORT or tls:HOST:PORT"
        )
    return Address("tcp", host=host.strip("[]") or "127.0.0.1", port=int(port), tls=tls)


def listen_unix(path: str, backlog: int = 16) -> socket.socket:
    """A listening Unix socket at ``path`` that appears there only once it listens: bound
    under a temporary name, listening, then renamed into place (replacing a stale one).
    A peer that waits for the path to exist never meets a bound socket that refuses it."""
    tmp = f"{path}.{os.getpid()}.tmp"
    if os.path.exists(tmp):
        os.unlink(tmp)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(tmp)
        s.listen(backlog)
        os.replace(tmp, path)
    except BaseException:
        s.close()
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return s
