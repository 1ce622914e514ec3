"""API keys and TLS: the ``Auth`` core in memory, then a real in-process server (scripted
worker process) over real sockets, with caplog watching every log line."""

from __future__ import annotations

import json
import logging
import ssl
from pathlib import Path

import httpx
import pytest
import trustme
import websockets
from hypothesis import given, settings
from hypothesis import strategies as st
from websockets.asyncio.client import connect

from lifecycle.api.auth import Auth, AuthConfig, Caller
from lifecycle.cli import _build_parser
from lifecycle.option_args import option_values, read_key_file
from lifecycle.runtime import app_config
from transport import Headers, Request

from .app_helpers import running_app
from .scripted import without_model_label
from .ws_helpers import collect, echo_body, echo_ids, gen_msg

KEY = "sk-user-7d1c2b9a4f"
KEY2 = "sk-user-second-0e8f"
ADMIN = "sk-admin-55aa33cc"
WRONG = "sk-wrong-1234"
SERVER_LOGGERS = {"lifecycle", "transport", "gpu", "wire"}


def _req(path: str, *headers: tuple[str, str]) -> Request:
    raw = [(n.lower().encode(), v.encode()) for n, v in headers]
    return Request("POST", path, Headers(raw))


# -- the core ----------------------------------------------------------------------------
def test_auth_matrix() -> None:
    auth = Auth(AuthConfig(api_keys=(KEY, KEY2), admin_api_keys=(ADMIN,)))
    ok = [("authorization", f"Bearer {KEY}")]
    assert auth.check(_req("/generate", *ok), admin=False) is None
    assert auth.check(_req("/generate", ("x-api-key", KEY2)), admin=False) is None
    assert auth.check(_req("/generate", ("authorization", f"bearer  {KEY} ")), admin=False) is None
    assert auth.check(_req("/generate", ("authorization", f"Bearer {ADMIN}")), admin=False) is None
    for headers in ([], [("authorization", f"Bearer {WRONG}")], [("authorization", KEY)],
                    [("x-api-key", KEY[:-1])], [("x-api-key", KEY + "x")]):  # fmt: skip
        denied = auth.check(_req("/generate", *headers), admin=False)
        assert denied is not None and denied.status == 401
        err = json.loads(denied.body)["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["code"] == "invalid_api_key" and KEY not in denied.body.decode()
    denied = auth.check(_req("/flush_cache", *ok), admin=True)  # a user key on an admin route
    assert denied is not None and denied.status == 401
    assert "admin" in json.loads(denied.body)["error"]["message"]
    admin = _req("/flush_cache", ("x-api-key", ADMIN))
    assert auth.check(admin, admin=True) is None
    assert isinstance(admin.user, Caller) and admin.user.admin
    assert auth.check_route(_req("/health"), "/health") is None
    assert auth.check_route(_req("/metrics"), "/metrics") is None
    assert auth.check_route(_req("/debug/requests"), "/debug/requests") is not None


def test_auth_without_admin_keys_and_disabled() -> None:
    users_only = Auth(AuthConfig(api_keys=(KEY,)))
    closed = users_only.check(_req("/abort_request", ("x-api-key", KEY)), admin=True)
    assert closed is not None and closed.status == 403  # closed by default (issue 23)
    assert "--admin-api-key" in json.loads(closed.body)["error"]["message"]
    denied = users_only.check(_req("/abort_request", ("x-api-key", WRONG)), admin=True)
    assert denied is not None and denied.status == 401  # a wrong key is still a 401
    opened = Auth(AuthConfig(api_keys=(KEY,), open_admin_routes=True))
    request = _req("/abort_request", ("x-api-key", KEY))
    assert opened.check(request, admin=True) is None
    assert isinstance(request.user, Caller) and not request.user.admin
    assert Auth().check(_req("/abort_request"), admin=True) is None  # no keys: open
    admins_only = Auth(AuthConfig(admin_api_keys=(ADMIN,)))
    assert admins_only.check(_req("/generate"), admin=False) is None
    assert admins_only.check(_req("/flush_cache"), admin=True) is not None
    assert admins_only.check(_req("/flush_cache", ("x-api-key", ADMIN)), admin=True) is None
    closed = Auth(AuthConfig(api_keys=(KEY,), public_routes=()))
    assert closed.check_route(_req("/health"), "/health") is not None


def test_cli_key_options(tmp_path: Path) -> None:
    keyfile = tmp_path / "keys"
    keyfile.write_text(f"# operators\n{KEY2}\n\n  {WRONG}  \n")
    assert read_key_file(keyfile) == (KEY2, WRONG)
    args = _build_parser().parse_args(
        ["serve", "--api-key", KEY, "--api-key-file", str(keyfile), "--admin-api-key", ADMIN,
         "--public-route", "/health", "--ssl-certfile", "c.pem", "--ssl-keyfile", "k.pem"]
    )  # fmt: skip
    cfg = app_config(option_values(args))
    assert cfg.api_keys == (KEY, KEY2, WRONG) and cfg.admin_api_keys == (ADMIN,)
    assert cfg.public_routes == ("/health",)
    assert (cfg.ssl_certfile, cfg.ssl_keyfile) == ("c.pem", "k.pem")
    none = app_config(option_values(_build_parser().parse_args(["serve", "--no-public-routes"])))
    assert none.public_routes == () and none.api_keys == ()


# -- a real server -------------------------------------------------------------------------
@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the websockets client is asyncio-only


@pytest.mark.anyio
async def test_keys_on_every_route_and_never_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    async with running_app(api_keys=(KEY,), admin_api_keys=(ADMIN,)) as app:
        base = f"http://127.0.0.1:{app.port}"
        user = {"authorization": f"Bearer {KEY}"}
        body = echo_body(1, 4)
        async with httpx.AsyncClient(base_url=base, timeout=30) as c:
            for public in ("/health", "/metrics"):
                assert (await c.get(public)).status_code == 200
            for method, path in (("POST", "/generate"), ("GET", "/server_info"),
                                 ("POST", "/tokenize"), ("GET", "/model_info"),
                                 ("POST", "/abort_request"), ("GET", "/flush_cache")):  # fmt: skip
                for headers in ({}, {"authorization": f"Bearer {WRONG}"}, {"x-api-key": WRONG}):
                    r = await c.request(method, path, json={}, headers=headers)
                    assert r.status_code == 401, (path, headers)
                    assert r.json()["error"]["code"] == "invalid_api_key"
            r = await c.post("/generate", json=body, headers=user)
            assert r.status_code == 200 and r.json()["output_ids"] == echo_ids(body)
            r = await c.post("/generate", json=body, headers={"x-api-key": ADMIN})
            assert r.status_code == 200
            assert (await c.get("/flush_cache", headers=user)).status_code == 401
            assert (await c.get("/flush_cache", headers={"x-api-key": ADMIN})).status_code == 200
            info = (await c.get("/server_info", headers=user)).json()
            assert KEY not in json.dumps(info) and ADMIN not in json.dumps(info)
            metrics = (await c.get("/metrics")).text
            assert 'endpoint="/generate",method="POST",status="401"' in without_model_label(metrics)
        ws = base.replace("http", "ws") + "/v1/stream"
        with pytest.raises(websockets.InvalidStatus) as exc:
            async with connect(ws, additional_headers={"authorization": f"Bearer {WRONG}"}):
                pass
        assert exc.value.response.status_code == 401
        async with connect(ws, additional_headers={"x-api-key": KEY}) as sock:
            await sock.send(gen_msg("k", body))
            assert (await collect(sock, 1)).ids("k") == echo_ids(body)
    # The server's loggers only: the client libraries log their own request headers.
    server_records = [r for r in caplog.records if r.name.split(".")[0] in SERVER_LOGGERS]
    logged = "\n".join(f"{r.getMessage()} {r.args!r} {r.exc_text}" for r in server_records)
    assert "401" in logged  # the refusals were logged...
    for secret in (KEY, ADMIN, WRONG):
        assert secret not in logged  # ...without any key, right or wrong


ADMIN_CALLS = (
    ("POST", "/abort_request", {"abort_all": True}),
    ("POST", "/flush_cache", None),
    ("GET", "/flush_cache", None),
    ("GET", "/debug/requests", None),
)


@pytest.mark.anyio
async def test_admin_routes_are_closed_with_api_keys_and_no_admin_key(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 23: with --api-key alone, any key could abort everything, flush the cache and
    read every request's trace. Now a valid key gets 403 naming --admin-api-key."""
    caplog.set_level(logging.INFO, logger="lifecycle.api.auth")
    async with running_app(api_keys=(KEY,)) as app:
        base = f"http://127.0.0.1:{app.port}"
        async with httpx.AsyncClient(base_url=base, timeout=30) as c:
            for method, path, body in ADMIN_CALLS:
                r = await c.request(method, path, json=body, headers={"x-api-key": KEY})
                assert r.status_code == 403, path
                err = r.json()["error"]
                assert err["code"] == "admin_routes_closed" and "--admin-api-key" in err["message"]
                assert (await c.request(method, path, json=body)).status_code == 401
            r = await c.post("/generate", json=echo_body(1, 3), headers={"x-api-key": KEY})
            assert r.status_code == 200  # the other routes are as before
    assert (
        "admin routes (/abort_request, /flush_cache, /models/load and unload, /replicas, "
        "/debug): closed" in caplog.text
    )


@pytest.mark.anyio
async def test_tls_end_to_end_with_streaming(tmp_path: Path) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    certfile, keyfile = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.private_key_and_cert_chain_pem.write_to_path(str(certfile))
    cert.private_key_pem.write_to_path(str(keyfile))
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    async with running_app(ssl_certfile=str(certfile), ssl_keyfile=str(keyfile)) as app:
        base = f"https://127.0.0.1:{app.port}"
        body = echo_body(2, 6)
        async with httpx.AsyncClient(base_url=base, verify=client_ctx, timeout=30) as c:
            r = await c.post("/generate", json=body)
            assert r.status_code == 200 and r.json()["output_ids"] == echo_ids(body)
            frames = []
            async with c.stream("POST", "/generate", json={**body, "stream": True}) as s:
                async for line in s.aiter_lines():
                    if line.startswith("data: "):
                        frames.append(line[6:])
            assert frames[-1] == "[DONE]" and json.loads(frames[-2])["output_ids"] == echo_ids(body)
        async with httpx.AsyncClient(base_url=base, timeout=5) as untrusting:
            with pytest.raises(httpx.ConnectError):
                await untrusting.get("/health")  # the system store does not know our CA
        wss = f"wss://127.0.0.1:{app.port}/v1/stream"
        async with connect(wss, ssl=client_ctx) as sock:
            await sock.send(gen_msg("t", body))
            got = await collect(sock, 1)
        assert got.final["t"]["type"] == "done" and got.ids("t") == echo_ids(body)


@given(
    keys=st.lists(
        st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1),
        min_size=1,
        max_size=4,
    ),  # fmt: skip
    presented=st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40),
    header=st.sampled_from(["authorization", "x-api-key"]),
)
@settings(max_examples=200, deadline=None)
def test_auth_accepts_exactly_the_configured_keys(
    keys: list[str], presented: str, header: str
) -> None:
    auth = Auth(AuthConfig(api_keys=tuple(keys)))
    value = f"Bearer {presented}" if header == "authorization" else presented
    denied = auth.check(_req("/generate", (header, value)), admin=False)
    assert (denied is None) == (presented.strip() in keys)
    assert denied is None or denied.status == 401
