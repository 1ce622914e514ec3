"""The worker's side of a link before HELLO: TLS and the token check (``wire.auth``).

The worker serves a connection from two threads: the receiver blocks in ``recv`` while
the step loop sends. A Python ``SSLSocket`` may not be used that way (one OpenSSL object,
two threads), so ``TlsLink`` runs TLS over memory BIOs: the raw socket is read and
written without a lock, the SSL object only under ``_ssl``, and bytes the SSL object
produced leave in the order it produced them because they are taken from the outgoing
BIO and sent under ``_send`` (lock order: ``_send``, then ``_ssl``). TLS 1.3 only.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import threading

import wire

__all__ = ["AUTH_TIMEOUT", "Link", "TlsLink", "authenticate", "server_tls_context"]

log = logging.getLogger("gpu.worker")

AUTH_TIMEOUT = 10.0  # seconds a new connection has for TLS and AUTH
_READ = 1 << 20

Link = socket.socket  # what the worker reads and writes: a socket, or a TlsLink


def server_tls_context(certfile: str, keyfile: str | None) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(certfile, keyfile)
    return ctx


class TlsLink:
    """A server-side TLS session over a connected socket, with the socket's ``recv``,
    ``sendall``, ``shutdown``, ``close`` and ``settimeout``; the handshake runs here."""

    def __init__(self, sock: socket.socket, ctx: ssl.SSLContext, timeout: float) -> None:
        self._sock = sock
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._obj = ctx.wrap_bio(self._in, self._out, server_side=True)
        self._ssl = threading.Lock()
        self._send = threading.Lock()
        sock.settimeout(timeout)
        while True:
            try:
                self._obj.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._sock.sendall(self._out.read())
                data = self._sock.recv(_READ)
                if not data:
                    raise ConnectionError(
                        "the peer closed the link during the TLS handshake"
                    ) from None
                self._in.write(data)
        self._sock.sendall(self._out.read())  # the last flight and the session tickets
        sock.settimeout(None)

    def settimeout(self, value: float | None) -> None:
        self._sock.settimeout(value)

    def recv(self, n: int) -> bytes:
        while True:
            with self._ssl:
                try:
                    data: bytes | None = self._obj.read(n)
                except ssl.SSLWantReadError:
                    data = None
                except ssl.SSLZeroReturnError:  # close_notify
                    return b""
                produced = self._out.pending
            if produced:  # e.g. a key update's answer
                self.sendall(b"")
            if data:
                return data
            raw = self._sock.recv(_READ)
            if not raw:
                return b""
            with self._ssl:
                self._in.write(raw)

    def sendall(self, data: bytes) -> None:
        """Send ``data`` and whatever else the SSL object produced before it (``b""``: that
        alone)."""
        with self._send:
            with self._ssl:
                if data:
                    self._obj.write(data)
                out = self._out.read()
            if out:
                self._sock.sendall(out)

    def shutdown(self, how: int) -> None:
        self._sock.shutdown(how)

    def close(self) -> None:
        self._sock.close()


def authenticate(link: Link | TlsLink, token: str, peer: str) -> bool:
    """CHALLENGE, then one AUTH frame within ``AUTH_TIMEOUT``; True when its MAC is the
    token's. A refusal is logged with the peer's address and answered with FATAL."""
    nonce = wire.new_nonce()
    link.sendall(wire.frame_bytes(wire.encode_frame(wire.Challenge(nonce))))
    buf = wire.FrameBuffer()
    link.settimeout(AUTH_TIMEOUT)
    try:
        payloads: list[bytes] = []
        while not payloads:
            data = link.recv(_READ)
            if not data:
                log.warning("refused a frontend from %s: it closed before AUTH", peer)
                return False
            payloads = buf.feed(data)
        frame = wire.decode_frame(payloads[0])
        if len(payloads) > 1 or buf.pending:
            why = "frames before HELLO"
        elif not isinstance(frame, wire.Auth):
            why = f"{type(frame).__name__} instead of AUTH"
        elif not wire.check_mac(token, nonce, frame.mac):
            why = "wrong worker token"
        else:
            return True
    except TimeoutError:
        why = f"no AUTH within {AUTH_TIMEOUT:.0f}s"
    except ValueError as exc:  # WireError, or a declared length over the limit
        why = f"protocol error: {exc}"
    finally:
        link.settimeout(None)
    log.warning("refused a frontend from %s: %s", peer, why)
    with contextlib.suppress(OSError):
        link.sendall(wire.frame_bytes(wire.encode_frame(wire.Fatal(f"unauthorized: {why}"))))
    return False
