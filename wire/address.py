"""Worker addresses: ``unix:/path/to/sock`` or ``tcp:HOST:PORT`` (a bare ``HOST:PORT`` is
read as TCP). One parser for both ends: the worker's ``--listen`` and the frontend's
``--worker`` take the same spelling."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Address", "parse_address"]


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
