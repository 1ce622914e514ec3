"""HTTP/1.1 behaviour of the transport over real loopback sockets (and a socketpair)."""

from __future__ import annotations

import importlib.util
import socket
import ssl
from collections.abc import AsyncIterator

import anyio
import h11
import httpx
import pytest
import trustme

from transport import (
    Headers,
    HTTPError,
    JSONResponse,
    Request,
    Response,
    Router,
    Server,
    ServerConfig,
    SSEResponse,
    StreamResponse,
    http_util,
)
from transport.http11 import HTTPConnection

from .transport_helpers import RawClient, connect, read_until_closed, request_bytes, running

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


HAVE_TRIO = importlib.util.find_spec("trio") is not None


# The same code runs on trio where it is installed (it is not a dependency).
@pytest.fixture(params=["asyncio", "trio"] if HAVE_TRIO else ["asyncio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param


def make_router() -> Router:
    router = Router()

    @router.route("GET", "/hello/{name}")
    async def hello(request: Request) -> Response:
        return JSONResponse({"hello": request.path_params["name"], "q": request.query()})

    @router.route(["POST", "PUT"], "/echo")
    async def echo(request: Request) -> Response:
        return Response(await request.body(), headers=[("x-method", request.method)])

    @router.route("POST", "/json")
    async def parse(request: Request) -> Response:
        return JSONResponse({"got": await request.json()})

    @router.route("GET", "/boom")
    async def boom(request: Request) -> Response:
        raise RuntimeError("secret internals")

    @router.route("GET", "/teapot")
    async def teapot(request: Request) -> Response:
        raise HTTPError(418, "short and stout", headers=[("x-tea", "earl grey")])

    @router.route("GET", "/whoami")
    async def whoami(request: Request) -> Response:
        assert request.client is not None
        agent = request.headers.get("USER-AGENT")
        return JSONResponse({"client": list(request.client), "agent": agent})

    @router.route("GET", "/stream")
    async def stream(request: Request) -> Response:
        async def chunks() -> AsyncIterator[bytes]:
            for i in range(5):
                yield f"chunk{i};".encode()

        return StreamResponse(chunks(), content_type="text/plain")

    @router.route("GET", "/stream-gaps")
    async def stream_gaps(request: Request) -> Response:
        async def chunks() -> AsyncIterator[bytes]:
            for part in (b"a", b"", b"bc", b"", b"d" * 300):
                yield part

        return StreamResponse(chunks(), content_type="text/plain")

    return router


async def test_keepalive_and_pipelined_requests_answered_in_order() -> None:
    async with running(make_router()) as (_, port), await connect(port) as stream:
        client = RawClient(stream)
        await client.send(
            request_bytes("GET", "/hello/a")
            + request_bytes("POST", "/echo", b"second")
            + request_bytes("GET", "/hello/c?x=1&x=2")
        )
        first, body1 = await client.response()
        second, body2 = await client.response(method="POST")
        third, body3 = await client.response()
        assert [first.status_code, second.status_code, third.status_code] == [200, 200, 200]
        assert body1 == b'{"hello":"a","q":{}}'
        assert body2 == b"second"
        assert body3 == b'{"hello":"c","q":{"x":["1","2"]}}'
        await client.send(request_bytes("GET", "/hello/again"))  # still alive
        fourth, body4 = await client.response()
        assert fourth.status_code == 200 and b"again" in body4


async def test_streams_on_a_kept_alive_connection_with_pipelining_then_close() -> None:
    """A stream answered on the fast path leaves the connection as a whole response does:
    pipelined requests behind it are answered in order, and a client's Connection: close
    is honoured in the stream's head and by closing after it."""
    async with running(make_router()) as (_, port), await connect(port) as stream:
        client = RawClient(stream)
        await client.send(
            request_bytes("GET", "/stream")
            + request_bytes("GET", "/hello/b")
            + request_bytes("GET", "/stream")
        )
        first, body1 = await client.response()
        second, body2 = await client.response()
        third, body3 = await client.response()
        assert (first.status_code, second.status_code, third.status_code) == (200, 200, 200)
        assert body1 == body3 == b"chunk0;chunk1;chunk2;chunk3;chunk4;"
        assert body2 == b'{"hello":"b","q":{}}'
        assert (b"transfer-encoding", b"chunked") in first.headers
        await client.send(request_bytes("GET", "/stream", connection="close"))
        last, body4 = await client.response()
        assert (b"connection", b"close") in last.headers
        assert body4 == body1
        closed, _ = await client.response()
        assert isinstance(closed, h11.ConnectionClosed)


async def test_chunked_request_body_in_pieces() -> None:
    async with running(make_router()) as (_, port), await connect(port) as stream:
        client = RawClient(stream)
        await client.send(b"POST /echo HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n")
        for piece in (b"5\r\nhello\r\n", b"1\r\n \r\n", b"5\r\nworld\r\n", b"0\r\n\r\n"):
            await client.send(piece)
            await anyio.sleep(0.01)
        response, body = await client.response(method="POST")
        assert response.status_code == 200 and body == b"hello world"


async def test_expect_100_continue_is_sent_when_the_body_is_read() -> None:
    async with running(make_router()) as (_, port), await connect(port) as stream:
        client = RawClient(stream)
        await client.send(request_bytes("POST", "/echo", expect="100-continue", content_length="4"))
        interim, _ = await client.response(method="POST")
        assert isinstance(interim, h11.InformationalResponse) and interim.status_code == 100
        await client.send(b"body")
        final, body = await client.response()
        assert final.status_code == 200 and body == b"body"


async def test_head_is_served_by_get_without_a_body() -> None:
    async with running(make_router()) as (_, port):
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            get = await http.get("/hello/x")
            head = await http.head("/hello/x")
            assert head.status_code == 200 and head.content == b""
            assert head.headers["content-length"] == str(len(get.content))
            stream_head = await http.head("/stream")
            assert stream_head.status_code == 200 and stream_head.content == b""


async def test_date_server_and_error_shapes() -> None:
    async with running(make_router(), server_header="unit") as (_, port):
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            ok = await http.get("/hello/x")
            assert ok.headers["server"] == "unit" and ok.headers["date"].endswith("GMT")
            missing = await http.get("/nowhere")
            assert missing.status_code == 404
            assert missing.json() == {"error": {"message": "Not Found: /nowhere"}}
            wrong = await http.delete("/echo")
            assert wrong.status_code == 405 and wrong.headers["allow"] == "POST, PUT"
            assert "message" in wrong.json()["error"]
            tea = await http.get("/teapot")
            assert tea.status_code == 418 and tea.headers["x-tea"] == "earl grey"
            assert tea.json() == {"error": {"message": "short and stout"}}


async def test_handler_exception_is_a_logged_500_without_internals(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with running(make_router()) as (_, port):
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            r = await http.get("/boom")
            assert r.status_code == 500
            assert r.json() == {"error": {"message": "Internal Server Error"}}
            assert "secret" not in r.text
            assert (await http.get("/hello/after")).status_code == 200  # same connection
    assert any("secret internals" in str(rec.exc_info) for rec in caplog.records)


async def test_invalid_json_is_400() -> None:
    async with running(make_router()) as (_, port):
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            good = await http.post("/json", content=b'{"a": [1, 2]}')
            assert good.json() == {"got": {"a": [1, 2]}}
            bad = await http.post("/json", content=b"{nope")
            assert bad.status_code == 400
            assert bad.json()["error"]["message"].startswith("Invalid JSON: ")


async def test_request_headers_and_client_address() -> None:
    async with running(make_router()) as (_, port):
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            r = await http.get("/whoami", headers={"user-agent": "probe/1"})
            data = r.json()
            assert data["client"][0] == "127.0.0.1" and data["agent"] == "probe/1"


async def test_connection_close_both_directions() -> None:
    async with running(make_router()) as (_, port), await connect(port) as stream:
        client = RawClient(stream)
        await client.send(request_bytes("GET", "/hello/x", connection="close"))
        response, _ = await client.response()
        assert (b"connection", b"close") in response.headers
        assert await client.closed()
    router = make_router()

    @router.route("GET", "/bye")
    async def bye(request: Request) -> Response:
        return Response(b"bye", headers=[("connection", "close")])

    async with running(router) as (_, port), await connect(port) as stream:
        client = RawClient(stream)
        await client.send(request_bytes("GET", "/bye"))
        response, body = await client.response()
        assert body == b"bye" and await client.closed()


async def test_streaming_response_is_chunked() -> None:
    async with running(make_router()) as (_, port), await connect(port) as stream:
        client = RawClient(stream)
        await client.send(request_bytes("GET", "/stream"))
        response, body = await client.response()
        assert (b"transfer-encoding", b"chunked") in response.headers
        assert body == b"chunk0;chunk1;chunk2;chunk3;chunk4;"


async def test_stream_chunk_framing_on_the_wire() -> None:
    """Chunks are framed as h11 frames them; an empty item never ends the body early;
    an HTTP/1.0 client gets the raw body, ended by the close."""
    async with running(make_router()) as (_, port):
        async with await connect(port) as stream:
            await stream.send(request_bytes("GET", "/stream-gaps", connection="close"))
            wire = await read_until_closed(stream)
        head, _, body = wire.partition(b"\r\n\r\n")
        assert b"Transfer-Encoding: chunked" in head
        assert body == b"1\r\na\r\n2\r\nbc\r\n12c\r\n" + b"d" * 300 + b"\r\n0\r\n\r\n"
        async with await connect(port) as stream:
            await stream.send(b"GET /stream-gaps HTTP/1.0\r\n\r\n")
            wire = await read_until_closed(stream)
        head, _, body = wire.partition(b"\r\n\r\n")
        assert b"chunked" not in head.lower()
        assert body == b"abc" + b"d" * 300


async def test_sse_framing_and_idle_pings() -> None:
    router = Router()

    @router.route("GET", "/events")
    async def events(request: Request) -> Response:
        async def gen() -> AsyncIterator[str | bytes]:
            yield '{"n": 1}'
            await anyio.sleep(0.35)
            yield b"line1\nline2"

        return SSEResponse(gen())

    async with running(router, sse_ping_interval=0.1) as (_, port):
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            r = await http.get("/events")
    assert r.headers["content-type"] == "text/event-stream"
    assert r.text.startswith('data: {"n": 1}\n\n: ping\n\n')
    assert r.text.endswith("data: line1\ndata: line2\n\n")
    assert r.text.count(": ping\n\n") >= 2


async def test_protocol_garbage_gets_400_and_close() -> None:
    async with running(make_router()) as (_, port), await connect(port) as stream:
        await stream.send(b"NOT HTTP AT ALL\r\n\r\n")
        data = b""
        with anyio.fail_after(5):
            try:
                while chunk := await stream.receive():
                    data += chunk
            except anyio.EndOfStream:
                pass
        assert data.startswith(b"HTTP/1.1 400 ")
        assert b'{"error":{"message":' in data


async def test_exact_bytes_over_a_socketpair(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http_util, "http_date", lambda: b"Thu, 01 Jan 2026 00:00:00 GMT")
    left, right = socket.socketpair()

    async def app(request: Request) -> Response:
        return Response(b"hi")

    server = await anyio.abc.SocketStream.from_socket(left)
    client = await anyio.abc.SocketStream.from_socket(right)
    conn = HTTPConnection(server, app, ServerConfig())
    async with anyio.create_task_group() as tg:
        tg.start_soon(conn.run)
        await client.send(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = await read_until_closed(client)
        await client.aclose()
    assert data == (
        b"HTTP/1.1 200 OK\r\ndate: Thu, 01 Jan 2026 00:00:00 GMT\r\nserver: lifecycle\r\n"
        b"content-type: text/plain; charset=utf-8\r\ncontent-length: 2\r\n"
        b"Connection: close\r\n\r\nhi"
    )


async def test_unix_socket_listener(tmp_path: pytest.TempPathFactory) -> None:
    path = str(tmp_path / "t.sock")  # type: ignore[operator]
    server = Server(make_router(), ServerConfig(uds=path))
    async with anyio.create_task_group() as tg:
        bound = await tg.start(server.serve)
        assert bound == path
        transport = httpx.AsyncHTTPTransport(uds=path)
        async with httpx.AsyncClient(transport=transport, base_url="http://local") as http:
            r = await http.get("/hello/unix")
            assert r.json()["hello"] == "unix"
        await server.shutdown()


async def test_tls_with_trustme_certificate(tmp_path: pytest.TempPathFactory) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    certfile, keyfile = tmp_path / "cert.pem", tmp_path / "key.pem"  # type: ignore[operator]
    cert.cert_chain_pems[0].write_to_path(str(certfile))
    cert.private_key_pem.write_to_path(str(keyfile))
    context = ssl.create_default_context()
    ca.configure_trust(context)
    async with running(make_router(), ssl_certfile=str(certfile), ssl_keyfile=str(keyfile)) as (
        _,
        port,
    ):
        async with httpx.AsyncClient(base_url=f"https://127.0.0.1:{port}", verify=context) as http:
            r = await http.get("/hello/tls")
            assert r.status_code == 200 and r.json()["hello"] == "tls"
            r = await http.post("/echo", content=b"z" * 200_000)
            assert r.content == b"z" * 200_000


async def test_streamed_upload_arrives_in_order_through_the_bounded_queue() -> None:
    router = Router()

    @router.route("POST", "/count")
    async def count(request: Request) -> Response:
        total, chunks = 0, 0
        async for chunk in request.stream():
            total += len(chunk)
            chunks += 1
            await anyio.sleep(0)  # a slow consumer: the reader must wait, not buffer it all
        return JSONResponse({"total": total, "chunks": chunks})

    async def body() -> AsyncIterator[bytes]:
        for _ in range(64):
            yield b"u" * 16384

    async with running(router) as (_, port):
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            r = await http.post("/count", content=body())
    assert r.json()["total"] == 64 * 16384 and r.json()["chunks"] > 1


async def test_producer_failure_mid_stream_truncates_and_closes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    router = Router()

    @router.route("GET", "/broken")
    async def broken(request: Request) -> Response:
        async def gen() -> AsyncIterator[str]:
            yield "first"
            raise RuntimeError("producer blew up")

        return SSEResponse(gen())

    async with running(router) as (_, port), await connect(port) as stream:
        client = RawClient(stream)
        await client.send(request_bytes("GET", "/broken"))
        with pytest.raises(h11.RemoteProtocolError):  # no terminating chunk: visibly cut
            await client.response()
    assert any("producer blew up" in str(rec.exc_info) for rec in caplog.records)


async def test_http10_request_gets_an_answer_then_close() -> None:
    async with running(make_router()) as (_, port), await connect(port) as stream:
        await stream.send(b"GET /hello/old HTTP/1.0\r\n\r\n")
        data = b""
        with anyio.fail_after(5):
            try:
                while True:
                    data += await stream.receive()
            except anyio.EndOfStream:
                pass
    assert data.startswith(b"HTTP/1.1 200 ") and data.endswith(b'{"hello":"old","q":{}}')


async def test_expect_100_rejected_without_reading_skips_the_body_and_closes() -> None:
    router = make_router()

    @router.route("POST", "/deny")
    async def deny(request: Request) -> Response:
        raise HTTPError(401, "no")

    async with running(router) as (_, port), await connect(port) as stream:
        client = RawClient(stream)
        await client.send(request_bytes("POST", "/deny", expect="100-continue", content_length="9"))
        response, body = await client.response(method="POST")
        assert response.status_code == 401 and b"no" in body  # no 100 Continue first
        assert await client.closed()


async def test_body_exactly_at_the_limit_is_accepted() -> None:
    async with running(make_router(), max_body_bytes=1000) as (_, port):
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            assert (await http.post("/echo", content=b"k" * 1000)).status_code == 200
            assert (await http.post("/echo", content=b"k" * 1001)).status_code == 413


async def test_on_disconnect_calls_back_once_at_once_or_never_after_removal() -> None:
    request = Request("GET", "/", Headers([]))
    calls: list[str] = []
    forget_a = request.on_disconnect(lambda: calls.append("a"))
    forget_b = request.on_disconnect(lambda: calls.append("b"))
    forget_b()
    request.mark_disconnected("client_gone")
    request.mark_disconnected("send_stall")  # a second reason: no second call
    assert calls == ["a"]
    assert request.disconnect_reason == "client_gone"
    forget_a()  # harmless after the fact
    request.on_disconnect(lambda: calls.append("late"))  # already gone: called at once
    assert calls == ["a", "late"]
