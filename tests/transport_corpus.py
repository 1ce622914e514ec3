"""Hostile HTTP/1.1 and WebSocket inputs, each with what the transport promises to answer.

The table behind ``tests/test_transport_corpus.py`` and the table in ``docs/transport.md``.
An ``Outcome`` is the statuses of the responses that come back, in order, and whether the
connection then closes (``Connection: close`` and EOF) or stays open for the next request;
for a WebSocket, the code of the server's close frame. An input is bytes sent at once, or
a list of pieces sent ``DRIP`` seconds apart (a slow client).
"""

from __future__ import annotations

import base64
import struct
from dataclasses import dataclass

__all__ = ["CASES", "DRIP", "Case", "Outcome", "markdown_table"]

DRIP = 0.04  # seconds between the pieces of a slow input; more than the test's timeouts / 3


@dataclass(frozen=True, slots=True)
class Outcome:
    statuses: tuple[int, ...]
    closes: bool  # True: the last response says Connection: close and the server closes
    ws_close: int | None = None  # the close code the server sends after a 101

    def __str__(self) -> str:
        if self.ws_close is not None:
            return f"101, then close frame {self.ws_close}"
        shown = ", ".join(map(str, self.statuses)) or "nothing"
        return f"{shown}, {'close' if self.closes else 'keep-alive'}"


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    data: bytes | list[bytes]
    expect: Outcome
    what: str  # the attack or the rule, for the docs table


def close(*statuses: int) -> Outcome:
    return Outcome(statuses, True)


def keep(*statuses: int) -> Outcome:
    return Outcome(statuses, False)


def ws_close(code: int) -> Outcome:
    return Outcome((101,), False, code)


_POST = b"POST /echo HTTP/1.1\r\nHost: a\r\n"
_CHUNKED = _POST + b"Transfer-Encoding: chunked\r\n\r\n"
_HELLO = b"5\r\nhello\r\n0\r\n\r\n"
_SMUGGLED = b"GET /smuggled HTTP/1.1\r\nHost: a\r\n\r\n"
_KEY = base64.b64encode(b"0123456789abcdef")


def _get(*fields: bytes, target: bytes = b"/", version: bytes = b"HTTP/1.1") -> bytes:
    return (
        b"GET "
        + target
        + b" "
        + version
        + b"\r\n"
        + b"".join(f + b"\r\n" for f in fields)
        + b"\r\n"
    )


def _te(value: bytes) -> bytes:
    """A chunked body under a Transfer-Encoding field written as ``value``."""
    return _POST + value + b"\r\n\r\n" + _HELLO


def _upgrade(key: bytes = _KEY, version: bytes = b"13", method: bytes = b"GET") -> bytes:
    return (
        method + b" /ws HTTP/1.1\r\nHost: a\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: " + key + b"\r\nSec-WebSocket-Version: " + version + b"\r\n\r\n"
    )


def _frame(opcode: int, payload: bytes, fin: bool = True, mask: bool = True, rsv: int = 0) -> bytes:
    """One client frame (RFC 6455 section 5.2), masked unless told otherwise."""
    size = len(payload)
    bit = 0x80 if mask else 0
    head = bytes([(0x80 if fin else 0) | rsv | opcode])
    if size < 126:
        head += bytes([bit | size])
    else:
        head += bytes([bit | 126]) + struct.pack("!H", size)
    if not mask:
        return head + payload
    key = b"\x01\x02\x03\x04"
    return head + key + bytes(b ^ key[i % 4] for i, b in enumerate(payload))


def _ws(*frames: bytes) -> bytes:
    return _upgrade() + b"".join(frames)


_C = Case
CASES: list[Case] = [
    # -- request smuggling: Content-Length against Transfer-Encoding (RFC 9112 6.1, 6.3)
    _C("cl-te", _POST + b"Content-Length: 6\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nG",
       close(400), "CL.TE: Content-Length before Transfer-Encoding: chunked"),
    _C("cl-te-smuggle", _POST + b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
       b"5c\r\n" + b"x" * 0x5C + b"\r\n0\r\n\r\n" + _SMUGGLED,
       close(400), "CL.TE with a request hidden behind the body: never answered"),
    _C("te-cl", _POST + b"Transfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n8\r\nSMUGGLED\r\n0\r\n\r\n",
       close(400), "TE.CL: Transfer-Encoding before Content-Length"),
    _C("te-cl-zero", _POST + b"Transfer-Encoding: chunked\r\nContent-Length: 0\r\n\r\n0\r\n\r\n",
       close(400), "TE.CL with Content-Length: 0"),
    _C("te-cl-http10", b"POST /echo HTTP/1.0\r\nHost: a\r\nContent-Length: 5\r\n"
       b"Transfer-Encoding: chunked\r\n\r\nhello", close(400), "CL and TE on HTTP/1.0"),
    _C("te-cl-unknown", _POST + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n"
       b"Transfer-Encoding: x\r\n\r\nhello", close(501), "CL with two Transfer-Encoding fields"),
    _C("te-http10", b"POST /echo HTTP/1.0\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n" + _HELLO,
       close(400), "Transfer-Encoding on HTTP/1.0 (RFC 9112 6.1: faulty framing)"),
    # -- TE.TE: Transfer-Encoding written so that one parser reads it and another does not
    _C("te-ows", _te(b"Transfer-Encoding:  chunked "), keep(200), "TE.TE: spaces around the value"),
    _C("te-tab", _te(b"Transfer-Encoding:\tchunked"), keep(200), "TE.TE: a tab before the value"),
    _C("te-upper", _te(b"Transfer-Encoding: CHUNKED"), keep(200), "TE.TE: upper case (codings ignore case)"),
    _C("te-xchunked", _te(b"Transfer-Encoding: xchunked"), close(501), "TE.TE: xchunked"),
    _C("te-suffix", _te(b"Transfer-Encoding: chunked-false"), close(501), "TE.TE: chunked-false"),
    _C("te-twice-in-value", _te(b"Transfer-Encoding: chunked, chunked"), close(501), "TE.TE: chunked, chunked"),
    _C("te-identity", _te(b"Transfer-Encoding: identity, chunked"), close(501), "TE.TE: identity, chunked"),
    _C("te-gzip", _te(b"Transfer-Encoding: gzip, chunked"), close(501), "a coding we do not implement"),
    _C("te-two-fields", _te(b"Transfer-Encoding: chunked\r\nTransfer-Encoding: identity"),
       close(501), "TE.TE: two fields, one bogus"),
    _C("te-two-same", _te(b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked"),
       close(501), "TE.TE: the same field twice"),
    _C("te-quoted", _te(b'Transfer-Encoding: "chunked"'), close(501), 'TE.TE: "chunked" quoted'),
    _C("te-empty", _te(b"Transfer-Encoding:"), close(501), "TE.TE: an empty value"),
    _C("te-space-before-colon", _te(b"Transfer-Encoding : chunked"), close(400),
       "TE.TE: a space before the colon (RFC 9112 5.1)"),
    _C("te-vtab", _te(b"Transfer-Encoding:\x0bchunked"), close(400), "TE.TE: a vertical tab"),
    _C("te-nul", _te(b"Transfer-Encoding: chun\x00ked"), close(400), "TE.TE: NUL in the value"),
    _C("te-bare-cr", _te(b"Transfer-Encoding: chunked\rX: y"), close(400), "TE.TE: a bare CR"),
    _C("te-underscore", _te(b"Transfer_Encoding: chunked"), close(200, 400),
       "TE.TE: Transfer_Encoding is another field: no body, the chunks are a bad request"),
    _C("te-folded", _te(b"X: y\r\n Transfer-Encoding: chunked"), close(200, 400),
       "TE.TE: folded into X (obs-fold is unfolded): no body, the chunks are a bad request"),
    # -- Content-Length
    _C("cl-two-differ", _POST + b"Content-Length: 5\r\nContent-Length: 6\r\n\r\nhello!",
       close(400), "two different Content-Lengths"),
    _C("cl-two-same", _POST + b"Content-Length: 5\r\nContent-Length: 5\r\n\r\nhello",
       keep(200), "the same Content-Length twice (RFC 9110 8.6)"),
    _C("cl-list", _POST + b"Content-Length: 5, 5\r\n\r\nhello", keep(200), "Content-Length: 5, 5"),
    _C("cl-negative", _POST + b"Content-Length: -1\r\n\r\nhello", close(400), "Content-Length: -1"),
    _C("cl-plus", _POST + b"Content-Length: +5\r\n\r\nhello", close(400), "Content-Length: +5"),
    _C("cl-hex", _POST + b"Content-Length: 0x5\r\n\r\nhello", close(400), "Content-Length: 0x5"),
    _C("cl-overflow", _POST + b"Content-Length: " + b"9" * 23 + b"\r\n\r\nhello",
       close(400), "a 23-digit Content-Length"),
    _C("cl-over-limit", _POST + b"Content-Length: 5000\r\n\r\nhello", close(413),
       "Content-Length over max_body_bytes: refused before the handler runs"),
    _C("cl-space-before-colon", _POST + b"Content-Length : 5\r\n\r\nhello", close(400),
       "a space before the colon"),
    # -- line endings, folding, bytes that are not allowed (RFC 9112 2.2, 5.2; RFC 9110 5.5)
    _C("bare-lf", b"GET / HTTP/1.1\nHost: a\n\n", keep(200), "bare LF line endings (RFC 9112 2.2 MAY)"),
    _C("bare-lf-mixed", b"GET / HTTP/1.1\r\nHost: a\nX: y\r\n\r\n", keep(200), "CRLF and bare LF mixed"),
    _C("bare-cr", b"GET / HTTP/1.1\rHost: a\r\r", close(408), "bare CR only: never a complete head"),
    _C("obs-fold", _get(b"Host: a", b"X-A: one", b" two"), keep(200),
       "obs-fold: unfolded into one space (RFC 9112 5.2)"),
    _C("obs-fold-first", _get(b" Host: a"), close(400), "a folded line before any field"),
    _C("nul-in-name", _get(b"Host: a", b"X-\x00A: b"), close(400), "NUL in a field name"),
    _C("nul-in-value", _get(b"Host: a", b"X-A: b\x00c"), close(400), "NUL in a field value"),
    _C("ctl-in-value", _get(b"Host: a", b"X-A: b\x01c"), keep(200), "a control byte in a value (kept, RFC 9110 5.5)"),
    _C("del-in-value", _get(b"Host: a", b"X-A: b\x7fc"), keep(200), "DEL in a value (kept)"),
    _C("ctl-in-name", _get(b"Host: a", b"X\x1bA: b"), close(400), "ESC in a field name"),
    _C("space-in-name", _get(b"Host: a", b"X A: b"), close(400), "a space inside a field name"),
    _C("empty-name", _get(b"Host: a", b": b"), close(400), "an empty field name"),
    _C("no-colon", _get(b"Host: a", b"nocolon"), close(400), "a field line without a colon"),
    _C("latin1-value", _get(b"Host: a", b"X-A: caf\xe9"), keep(200), "obs-text in a value"),
    _C("no-host", _get(), close(400), "HTTP/1.1 without Host (RFC 9112 3.2)"),
    _C("two-hosts", _get(b"Host: a", b"Host: b"), close(400), "two Host fields"),
    # -- chunked bodies (RFC 9112 7.1)
    _C("chunk-size-junk", _CHUNKED + b"zz\r\nhello\r\n0\r\n\r\n", close(400), "a chunk size that is not hex"),
    _C("chunk-size-negative", _CHUNKED + b"-5\r\nhello\r\n0\r\n\r\n", close(400), "a negative chunk size"),
    _C("chunk-size-overflow", _CHUNKED + b"f" * 40 + b"\r\nhello\r\n0\r\n\r\n", close(400),
       "a 40-digit chunk size"),
    _C("chunk-size-over-limit", _CHUNKED + b"100000\r\nhello\r\n0\r\n\r\n", close(408),
       "a 1 MiB chunk that never comes: body timeout"),
    _C("chunk-size-space", _CHUNKED + b"5 \r\nhello\r\n0\r\n\r\n", keep(200), "a space after the size"),
    _C("chunk-ext", _CHUNKED + b"5;name=value\r\nhello\r\n0\r\n\r\n", keep(200), "a chunk extension (ignored)"),
    _C("chunk-ext-nul", _CHUNKED + b"5;\x00\r\nhello\r\n0\r\n\r\n", keep(200), "NUL in a chunk extension (ignored)"),
    _C("chunk-data-overrun", _CHUNKED + b"5\r\nhelloXX0\r\n\r\n", close(400), "data longer than its size"),
    _C("chunk-bare-lf", _CHUNKED + b"5\nhello\n0\n\n", close(408), "bare LF in chunk lines: never complete"),
    _C("chunk-trailers", _CHUNKED + b"5\r\nhello\r\n0\r\nX-Trailer: v\r\n\r\n", keep(200),
       "a trailer field (dropped)"),
    _C("chunk-trailer-cl", _CHUNKED + b"5\r\nhello\r\n0\r\nContent-Length: 99\r\n\r\n", keep(200),
       "Content-Length as a trailer (framing ignores it)"),
    _C("chunk-trailer-bad", _CHUNKED + b"5\r\nhello\r\n0\r\nbad trailer\r\n\r\n", close(400),
       "a malformed trailer"),
    _C("chunked-over-limit", _CHUNKED + (b"400\r\n" + b"x" * 1024 + b"\r\n") * 5 + b"0\r\n\r\n",
       close(413), "a chunked body over max_body_bytes"),
    # -- request lines and targets (RFC 9112 3)
    _C("absolute-form", _get(b"Host: a", target=b"http://a/"), keep(200), "absolute form: routed by its path"),
    _C("absolute-form-query", _get(b"Host: a", target=b"HTTP://elsewhere?x=1"), keep(200),
       "absolute form, another authority, no path"),
    _C("absolute-form-no-host", _get(b"Host: a", target=b"http:///"), close(400), "absolute form without authority"),
    _C("absolute-form-ftp", _get(b"Host: a", target=b"ftp://a/"), close(400), "a scheme that is not http(s)"),
    _C("authority-form", b"CONNECT a:443 HTTP/1.1\r\nHost: a:443\r\n\r\n", close(400),
       "authority form (CONNECT: no tunnels here)"),
    _C("authority-form-get", _get(b"Host: a", target=b"a:443"), close(400), "authority form on GET"),
    _C("asterisk-form", b"OPTIONS * HTTP/1.1\r\nHost: a\r\n\r\n", keep(404), "`OPTIONS *` (no such route)"),
    _C("asterisk-form-get", _get(b"Host: a", target=b"*"), close(400), "`*` on GET"),
    _C("http09", b"GET /\r\n\r\n", close(400), "an HTTP/0.9 request"),
    _C("http09-unended", b"GET /\r\n", close(408), "an HTTP/0.9 request line alone"),
    _C("http10", _get(version=b"HTTP/1.0"), close(200), "HTTP/1.0 without Host: answered, then closed"),
    _C("http2-version", _get(b"Host: a", version=b"HTTP/2.0"), close(505), "HTTP/2.0 in HTTP/1 syntax"),
    _C("http-lower", _get(b"Host: a", version=b"http/1.1"), close(400), "http/1.1 in lower case"),
    _C("version-junk", _get(b"Host: a", version=b"HTTP/1.1x"), close(400), "junk after the version"),
    _C("method-lower", b"get / HTTP/1.1\r\nHost: a\r\n\r\n", keep(405), "get: methods are case-sensitive"),
    _C("method-unknown", b"BREW / HTTP/1.1\r\nHost: a\r\n\r\n", keep(405), "a method no route has"),
    _C("method-bad-char", b"G@T / HTTP/1.1\r\nHost: a\r\n\r\n", close(400), "a method that is not a token"),
    _C("double-space", b"GET  / HTTP/1.1\r\nHost: a\r\n\r\n", close(400), "two spaces in the request line"),
    _C("nul-in-target", _get(b"Host: a", target=b"/a\x00b"), close(400), "NUL in the target"),
    _C("space-in-target", _get(b"Host: a", target=b"/a b"), close(400), "a space in the target"),
    _C("leading-crlf", b"\r\n" + _get(b"Host: a"), close(400), "an empty line before the request"),
    _C("tls-hello", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", close(400), "TLS on the plain port"),
    # -- sizes (max_header_bytes: 2048 in the test)
    _C("long-method", b"G" * 3000 + b" / HTTP/1.1\r\nHost: a\r\n\r\n", close(431), "a 3000-byte method"),
    _C("long-target", _get(b"Host: a", target=b"/" + b"a" * 3000), close(431), "a 3000-byte target"),
    _C("long-version", _get(b"Host: a", version=b"HTTP/1." + b"1" * 3000), close(400), "a 3000-byte version"),
    _C("long-value", _get(b"Host: a", b"X-A: " + b"v" * 3000), close(431), "a 3000-byte field value"),
    _C("many-fields", _get(b"Host: a", *(b"X-%d: v" % i for i in range(400))), close(431), "400 fields"),
    _C("head-under-limit", _get(b"Host: a", b"X-A: " + b"v" * 1900), keep(200), "a head just under the limit"),
    # -- Expect (RFC 9110 10.1.1)
    _C("expect-with-body", _POST + b"Expect: 100-continue\r\nContent-Length: 5\r\n\r\nhello", keep(200),
       "Expect: 100-continue, body sent anyway"),
    _C("expect-no-body", [_POST + b"Expect: 100-continue\r\nContent-Length: 5\r\n\r\n"], close(100, 408),
       "Expect: 100-continue, body never sent: 100, then body timeout"),
    _C("expect-unknown", _POST + b"Expect: 200-ok\r\nContent-Length: 5\r\n\r\nhello", keep(200),
       "an Expect we do not know (ignored)"),
    # -- slow and unfinished clients (header_timeout, body_timeout: 0.1 s in the test)
    _C("slow-head", [b"GET / HTTP/1.1\r\n"] + [b"X-%d: v\r\n" % i for i in range(6)] + [b"Host: a\r\n\r\n"],
       close(408), "a head dripped a line at a time (slowloris)"),
    _C("slow-body", [_POST + b"Content-Length: 8\r\n\r\n"] + [b"x"] * 8, close(408), "a body dripped a byte at a time"),
    _C("slow-chunked-body", [_CHUNKED] + [b"1\r\nx\r\n"] * 8 + [b"0\r\n\r\n"], close(408),
       "a chunked body dripped a chunk at a time"),
    _C("truncated-body", [_POST + b"Content-Length: 10\r\n\r\nhel"], close(408), "a body cut short"),
    _C("pipelined", _get(b"Host: a") * 2, keep(200, 200), "two pipelined requests: answered in order"),
    # -- WebSocket handshakes (RFC 6455 4.2) and frames (5)
    _C("ws-echo", _ws(_frame(1, b"hi"), _frame(8, struct.pack("!H", 1000))), ws_close(1000),
       "a good session, closed by the client"),
    _C("ws-bad-key", _upgrade(key=b"short"), keep(400), "Sec-WebSocket-Key not 16 bytes of base64"),
    _C("ws-no-key", _upgrade(key=b""), keep(400), "an empty Sec-WebSocket-Key"),
    _C("ws-bad-version", _upgrade(version=b"8"), keep(426), "Sec-WebSocket-Version: 8"),
    _C("ws-post", _upgrade(method=b"POST"), keep(405), "an upgrade on POST"),
    _C("ws-too-big", _ws(_frame(2, b"x" * 2000)), ws_close(1009), "a frame over ws_max_message_bytes"),
    _C("ws-too-big-fragments", _ws(_frame(2, b"x" * 700, fin=False), _frame(0, b"x" * 700)),
       ws_close(1009), "fragments that add up to too much"),
    _C("ws-unmasked", _ws(_frame(1, b"hi", mask=False)), ws_close(1002), "an unmasked client frame"),
    _C("ws-fragmented-ping", _ws(_frame(9, b"p", fin=False)), ws_close(1002), "a fragmented control frame"),
    _C("ws-long-ping", _ws(_frame(9, b"p" * 200)), ws_close(1002), "a control frame over 125 bytes"),
    _C("ws-bad-utf8", _ws(_frame(1, b"\xff\xfe")), ws_close(1007), "a text frame that is not UTF-8"),
    _C("ws-close-bad-code", _ws(_frame(8, struct.pack("!H", 999))), ws_close(1002), "close code 999"),
    _C("ws-close-reserved", _ws(_frame(8, struct.pack("!H", 1005))), ws_close(1002),
       "close code 1005 (never sent on the wire)"),
    _C("ws-close-one-byte", _ws(_frame(8, b"\x03")), ws_close(1002), "a close frame of one byte"),
    _C("ws-rsv", _ws(_frame(1, b"hi", rsv=0x40)), ws_close(1002), "RSV1 set, no extension agreed"),
    _C("ws-bad-opcode", _ws(_frame(3, b"hi")), ws_close(1002), "a reserved opcode"),
    _C("ws-lone-continuation", _ws(_frame(0, b"hi")), ws_close(1002), "a continuation with nothing to continue"),
]  # fmt: skip


def markdown_table() -> str:
    """The corpus as the table in docs/transport.md (a test keeps the two equal)."""
    rows = ["| input | what it is | what it gets |", "|---|---|---|"]
    for case in CASES:
        rows.append(f"| `{case.name}` | {case.what} | {case.expect} |")
    return "\n".join(rows) + "\n"
