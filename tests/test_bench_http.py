"""The serving load generator's HTTP/1.1 response parser and SSE decoder: a chunked body
cut at any byte, length- and close-delimited bodies, keep-alive, truncated and interim
responses; events over LF and CRLF, multi-line data and comments."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.http1 import (
    BodyChunk,
    IncompleteResponse,
    ResponseEnd,
    ResponseHead,
    ResponseParser,
    SSEDecoder,
)

CHUNKED = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    b"7\r\ndata: a\r\n2\r\n\n\n\r\n0\r\n\r\n"
)


def _parse_in_pieces(raw: bytes, cuts: list[int]) -> list[object]:
    p = ResponseParser()
    events: list[object] = []
    prev = 0
    for cut in sorted(set(cuts)) + [len(raw)]:
        events += p.feed(raw[prev:cut])
        prev = cut
    return events


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, len(CHUNKED)), max_size=12))
def test_chunked_body_survives_any_split(cuts: list[int]) -> None:
    events = _parse_in_pieces(CHUNKED, cuts)
    assert isinstance(events[0], ResponseHead) and events[0].status == 200
    assert isinstance(events[-1], ResponseEnd)
    body = b"".join(e.data for e in events if isinstance(e, BodyChunk))
    assert body == b"data: a\n\n"


def test_content_length_and_keep_alive() -> None:
    p = ResponseParser()
    ev = p.feed(b"HTTP/1.1 500 Internal\r\nContent-Length: 2\r\n\r\nok")
    assert [type(e) for e in ev] == [ResponseHead, BodyChunk, ResponseEnd]
    assert p.head is not None and p.head.keep_alive and p.head.status == 500
    p = ResponseParser()
    p.feed(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
    assert p.done and p.head is not None and not p.head.keep_alive


def test_close_delimited_body_ends_at_eof() -> None:
    p = ResponseParser()
    p.feed(b"HTTP/1.0 200 OK\r\n\r\nabc")
    assert p.eof() == [ResponseEnd()]


@pytest.mark.parametrize(
    "raw",
    [
        CHUNKED[:-5],  # cut before the last chunk
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc",
        b"HTTP/1.1 200 OK\r\n",
        b"",
    ],
)
def test_truncated_response_raises(raw: bytes) -> None:
    p = ResponseParser()
    p.feed(raw)
    with pytest.raises(IncompleteResponse):
        p.eof()


def test_interim_response_is_skipped() -> None:
    ev = ResponseParser().feed(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n")
    assert isinstance(ev[0], ResponseHead) and ev[0].status == 204 and ev[-1] == ResponseEnd()


def test_sse_decoder_lf_crlf_multiline_and_comments() -> None:
    d = SSEDecoder()
    assert d.feed(b'data: {"a"') == []
    assert d.feed(b": 1}\n\n: ping\r\n\r\nevent: x\r\ndata: one\r\ndata:two\r\n\r\ndata: [DO") == [
        '{"a": 1}',
        "one\ntwo",
    ]
    assert d.pending
    assert d.feed(b"NE]\n\n") == ["[DONE]"] and not d.pending
