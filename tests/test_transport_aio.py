"""The asyncio socket stream and listener (``transport/aio.py``) and the worker side's
frame connection (``lifecycle/link/wire_stream.py``), over real sockets."""

from __future__ import annotations

import socket
import struct

import anyio
import anyio.abc
import pytest

from lifecycle.link.wire_stream import (
    _MAX_READY,
    Address,
    FrameStream,
    connect,
    parse_address,
    serve,
)
from transport import aio
from wire import Probe, Stats, encode_frame
from wire.framing import frame_bytes

from .transport_helpers import read_until_closed

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _pair() -> tuple[anyio.abc.SocketStream, anyio.abc.SocketStream, anyio.abc.Listener]:
    """(our accepted stream, the client's plain anyio stream, the listener)."""
    listener = aio.wrap_listener(await anyio.create_tcp_listener(local_host="127.0.0.1"))
    assert isinstance(listener, anyio.abc.Listener)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with anyio.create_task_group() as tg:
        accepted: list[anyio.abc.SocketStream] = []

        async def accept() -> None:
            inner = listener.listeners[0] if hasattr(listener, "listeners") else listener
            accepted.append(await inner.accept())

        tg.start_soon(accept)
        client = await anyio.connect_tcp("127.0.0.1", port)
    return accepted[0], client, listener


async def test_listener_yields_our_streams_with_socket_attributes() -> None:
    ours, client, listener = await _pair()
    async with ours, client, listener:
        assert isinstance(ours, aio.AsyncioSocketStream)
        assert ours.extra(anyio.abc.SocketAttribute.remote_address) == client.extra(
            anyio.abc.SocketAttribute.local_address
        )
        sock = ours.extra(anyio.abc.SocketAttribute.raw_socket)
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


async def test_receive_respects_max_bytes_and_keeps_order() -> None:
    ours, client, listener = await _pair()
    async with ours, client, listener:
        payload = bytes(range(256)) * 64  # 16 KiB
        for i in range(0, len(payload), 1000):
            await client.send(payload[i : i + 1000])
        got = b""
        with anyio.fail_after(5):
            while len(got) < len(payload):
                part = await ours.receive(777)
                assert 0 < len(part) <= 777
                got += part
        assert got == payload
        with pytest.raises(ValueError):
            await ours.receive(0)


async def test_reading_pauses_above_the_high_water_mark_then_resumes() -> None:
    ours, client, listener = await _pair()
    async with ours, client, listener:
        assert isinstance(ours, aio.AsyncioSocketStream)
        total = 4 * aio.HIGH_WATER
        blob = bytes(i % 251 for i in range(total))

        async def write_all() -> None:
            await client.send(blob)

        async with anyio.create_task_group() as tg:
            tg.start_soon(write_all)
            with anyio.fail_after(5):
                while not ours._protocol.paused:
                    await anyio.sleep(0.01)
            # Paused: the read-ahead is bounded (one more chunk may land after the mark).
            assert ours._protocol.size <= aio.HIGH_WATER + 512 * 1024
            got = b""
            with anyio.fail_after(10):
                while len(got) < total:
                    got += await ours.receive(65536)
        assert got == blob and not ours._protocol.paused


async def test_eof_after_the_data_then_end_of_stream_and_closed_errors() -> None:
    ours, client, listener = await _pair()
    async with listener:
        await client.send(b"last words")
        await client.aclose()
        with anyio.fail_after(5):
            assert await ours.receive() == b"last words"
            with pytest.raises(anyio.EndOfStream):
                await ours.receive()
        await ours.aclose()
        with pytest.raises(anyio.ClosedResourceError):
            await ours.receive()
        with pytest.raises(anyio.ClosedResourceError):
            await ours.send(b"x")


async def test_send_to_a_reset_peer_raises_broken_resource() -> None:
    ours, client, listener = await _pair()
    async with ours, listener:
        sock = client.extra(anyio.abc.SocketAttribute.raw_socket)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await client.aclose()  # RST
        with anyio.fail_after(5), pytest.raises(anyio.BrokenResourceError):
            while True:
                await ours.send(b"x" * 65536)


async def test_send_waits_for_a_slow_reader() -> None:
    """A reader that does not read makes send() wait (backpressure), not buffer forever."""
    ours, client, listener = await _pair()
    async with ours, client, listener:
        sent = 0
        with anyio.move_on_after(1.0) as scope:
            while True:
                await ours.send(b"y" * 65536)
                sent += 65536
        assert scope.cancelled_caught
        assert sent < 64 * 1024 * 1024  # kernel buffers only, nothing piling up here
        assert ours._transport.get_write_buffer_size() <= 65536


async def test_closing_the_listener_ends_a_pending_accept() -> None:
    listener = aio.wrap_listener(await anyio.create_tcp_listener(local_host="127.0.0.1"))
    inner = listener.listeners[0]  # type: ignore[attr-defined]
    assert isinstance(inner, aio.AsyncioSocketListener)
    outcome: list[BaseException] = []

    async def accept() -> None:
        try:
            await inner.accept()
        except anyio.ClosedResourceError as exc:
            outcome.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(accept)
        await anyio.sleep(0.05)
        await inner.aclose()
    assert len(outcome) == 1


async def test_writes_of_one_loop_pass_leave_in_one_call_in_order() -> None:
    ours, client, listener = await _pair()
    async with ours, client, listener:
        assert isinstance(ours, aio.AsyncioSocketStream)
        calls: list[bytes] = []
        write = ours._transport.write

        def counting_write(data: bytes) -> None:  # type: ignore[override]
            calls.append(bytes(data))
            write(data)

        ours._transport.write = counting_write  # type: ignore[method-assign]
        for part in (b"head;", b"event;", b"done;", b"end"):
            await ours.send(part)  # no yield in between: one pass of the loop
        assert calls == []  # held until the end of the pass
        await anyio.sleep(0)
        assert calls == [b"head;event;done;end"]
        big = b"z" * aio.FLUSH_BYTES
        await ours.send(big)  # past FLUSH_BYTES: handed over at once, not at the pass's end
        assert calls[1:] == [big]
        got = b""
        with anyio.fail_after(5):
            while len(got) < 19 + len(big):
                got += await client.receive()
        assert got == b"head;event;done;end" + big


async def test_one_callback_flushes_every_stream_that_wrote_in_the_pass() -> None:
    """Two connections written in one pass: both leave at its end, from one callback."""
    a, client_a, listener_a = await _pair()
    b, client_b, listener_b = await _pair()
    async with a, b, client_a, client_b, listener_a, listener_b:
        assert isinstance(a, aio.AsyncioSocketStream) and isinstance(b, aio.AsyncioSocketStream)
        flushed: list[str] = []
        for name, stream in (("a", a), ("b", b)):
            write = stream._transport.write

            def counting(data: bytes, name: str = name, write=write) -> None:  # type: ignore[no-untyped-def]
                flushed.append(name)
                write(data)

            stream._transport.write = counting  # type: ignore[method-assign]
        await a.send(b"to a;")
        await b.send(b"to b;")
        await a.send(b"again")
        pass_end = aio._pass_end()
        assert pass_end._fns == [a._flush_fn, b._flush_fn]  # one entry a stream, in order
        assert flushed == []
        await anyio.sleep(0)
        assert flushed == ["a", "b"] and pass_end._fns == []
        with anyio.fail_after(5):
            assert await client_a.receive() == b"to a;again"
            assert await client_b.receive() == b"to b;"


async def test_try_send_writes_only_when_the_kernel_took_the_last_flush() -> None:
    """``try_send`` is ``send`` without the wait: True and queued for the pass's flush
    while the transport holds nothing; False, with nothing written, while a slow reader
    leaves bytes in it; the errors of ``send`` on a closed stream."""
    ours, client, listener = await _pair()
    async with client, listener:
        assert isinstance(ours, aio.AsyncioSocketStream)
        assert ours.try_send(b"quick") is True
        await anyio.sleep(0)
        with anyio.fail_after(5):
            assert await client.receive() == b"quick"
        with anyio.fail_after(10):  # the client reads nothing: fill the kernel's buffers
            while ours._transport.get_write_buffer_size() == 0:
                ours.try_send(b"w" * aio.FLUSH_BYTES)
                await anyio.sleep(0)
        held = ours._transport.get_write_buffer_size()
        assert ours.try_send(b"refused") is False
        assert ours._pending == [] and ours._transport.get_write_buffer_size() == held
        await ours.aclose()
        with pytest.raises(anyio.ClosedResourceError):
            ours.try_send(b"closed")


async def test_pending_writes_go_out_before_eof_and_close() -> None:
    ours, client, listener = await _pair()
    async with client, listener:
        await ours.send(b"last ")
        await ours.send_eof()  # the half-close follows the bytes
        with pytest.raises(anyio.ClosedResourceError):
            await ours.send(b"never")  # the write side is closed
        assert await read_until_closed(client) == b"last "
        await ours.aclose()
    ours2, client2, listener2 = await _pair()
    async with client2, listener2:
        await ours2.send(b"bye")
        await ours2.aclose()  # flushed first: the kernel takes it before the abort
        with anyio.fail_after(5):
            assert await client2.receive() == b"bye"


# -- the worker connection's frame protocol ------------------------------------------------
async def _connect_when_listening(address: Address) -> FrameStream:
    """Connect once the ``serve`` task started beside the test is listening."""
    with anyio.fail_after(5):
        while True:
            try:
                return await connect(address)
            except OSError:
                await anyio.sleep(0.02)


async def test_frame_connection_pauses_on_unread_frames_and_resumes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    address = parse_address(f"unix:{tmp_path}/w.sock")
    frame = frame_bytes(encode_frame(Stats(7, {"pad": "x" * 1000})))
    count = 3 * _MAX_READY

    async def flood(out: FrameStream) -> None:
        assert out._conn is not None
        await out._conn.send(frame * count)
        await anyio.sleep_forever()

    async with anyio.create_task_group() as tg:
        tg.start_soon(serve, address, flood)
        frames = await _connect_when_listening(address)
        conn = frames._conn
        assert conn is not None
        with anyio.fail_after(5):
            while not conn.paused:
                await anyio.sleep(0.01)
        # Bounded: at most one socket read (256 KiB) of frames past the mark.
        assert len(conn.ready) <= _MAX_READY + 256 * 1024 // len(frame) + 1
        with anyio.fail_after(10):
            for _ in range(count):
                assert await frames.receive() == Stats(7, {"pad": "x" * 1000})
        assert not conn.paused
        await frames.aclose()
        tg.cancel_scope.cancel()


async def test_frame_connection_reports_a_bad_length_after_the_good_frames(tmp_path) -> None:  # type: ignore[no-untyped-def]
    address = parse_address(f"unix:{tmp_path}/w.sock")
    good = frame_bytes(encode_frame(Probe(1)))

    async def bad(out: FrameStream) -> None:
        assert out._conn is not None
        await out._conn.send(good)
        await anyio.sleep(0.2)  # two reads: the good frame is whole before the bad length
        await out._conn.send(struct.pack(">I", 0xFFFFFFFF) + b"junk")
        await anyio.sleep_forever()

    async with anyio.create_task_group() as tg:
        tg.start_soon(serve, address, bad)
        frames = await _connect_when_listening(address)
        with anyio.fail_after(5):
            assert await frames.receive() == Probe(1)
            with pytest.raises(ValueError, match="exceeds"):
                await frames.receive()
        await frames.aclose()
        with pytest.raises(anyio.BrokenResourceError):
            await frames.send(Probe(2))
        tg.cancel_scope.cancel()


async def test_send_many_writes_frames_in_order_in_one_write(tmp_path) -> None:  # type: ignore[no-untyped-def]
    address = parse_address(f"unix:{tmp_path}/w.sock")
    sent = [Probe(1), Stats(2, {"a": 1}), Probe(3)]

    async def burst(out: FrameStream) -> None:
        assert out._conn is not None and out._conn.transport is not None
        writes: list[bytes] = []
        write = out._conn.transport.write
        out._conn.transport.write = lambda d: (writes.append(bytes(d)), write(d))[1]  # type: ignore[method-assign]
        await out.send_many(sent)
        assert writes == [b"".join(frame_bytes(encode_frame(f)) for f in sent)]
        await anyio.sleep_forever()

    async with anyio.create_task_group() as tg:
        tg.start_soon(serve, address, burst)
        frames = await _connect_when_listening(address)
        with anyio.fail_after(5):
            assert [await frames.receive() for _ in sent] == sent
        await frames.aclose()
        tg.cancel_scope.cancel()
