"""A real worker over TCP on loopback: the token check, TLS, reconnecting after the
worker comes back, and a remote worker beside a spawned one (docs/scaling.md).

Each test starts ``python -m gpu.worker`` on a tiny GGUF and ``lifecycle serve
--worker tcp:...`` as real processes, and talks HTTP to the server."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest

import wire

from .scripted import ROOT, free_port, lifecycle_server

TOKEN = "s3cret-worker-token"


@contextmanager
def tcp_worker(model: Path, *args: str, port: int | None = None, env: dict[str, str] | None = None,
               log: Path | None = None) -> Iterator[tuple[str, int]]:  # fmt: skip
    """``gpu.worker`` listening on 127.0.0.1; yields (address, port) once it accepts."""
    port = port or free_port()
    listen = next((a for a in args if a.startswith("tls:")), None) or f"tcp:127.0.0.1:{port}"
    rest = [a for a in args if not a.startswith("tls:")]
    argv = [sys.executable, "-m", "gpu.worker", "--model", str(model), "--device", "cpu"]
    argv += ["--listen", listen, "--threads", "1", "--kv-cache-tokens", "1024", *rest]
    out = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, **(env or {})}, stderr=out)
    try:
        deadline = time.monotonic() + 60
        host_port = listen.rsplit(":", 1)
        while True:
            assert proc.poll() is None, f"the worker exited with {proc.returncode}"
            assert time.monotonic() < deadline, "the worker did not listen"
            try:
                socket.create_connection(("127.0.0.1", int(host_port[1])), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        yield listen, int(host_port[1])
    finally:
        proc.kill()
        proc.wait()
        if log:
            out.close()  # type: ignore[union-attr]


def _generate(url: str, n: int = 4) -> dict:
    r = httpx.post(url + "/generate", timeout=60, json={
        "text": "hello", "sampling_params": {"max_new_tokens": n, "ignore_eos": True}})  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()


def _wait(pred, timeout: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_a_worker_with_a_token_serves_the_frontend_that_knows_it(tiny_gguf, tmp_path) -> None:
    with tcp_worker(tiny_gguf.path, env={wire.TOKEN_ENV: TOKEN}) as (address, _):
        with lifecycle_server("--model", str(tiny_gguf.path), "--worker", address,
                              "--worker-token", TOKEN) as url:  # fmt: skip
            out = _generate(url)
            assert out["meta_info"]["completion_tokens"] == 4
            info = httpx.get(url + "/server_info").json()
            assert info["worker"] == [address]
            assert "worker_token" not in info  # a secret is not echoed
            assert info["internal_states"][0]["status"] == "ready"


def test_a_wrong_token_is_refused_logged_and_health_stays_503(tiny_gguf, tmp_path) -> None:
    log = tmp_path / "worker.log"
    with tcp_worker(tiny_gguf.path, "--token", TOKEN, log=log) as (address, _):
        with lifecycle_server("--model", str(tiny_gguf.path), "--worker", address,
                              "--worker-token", "not-the-token", "--restart-backoff", "0.5",
                              wait_ready=False) as url:  # fmt: skip

            def refused() -> bool:
                r = httpx.get(url + "/health", timeout=5)
                return r.status_code == 503 and "wrong worker token" in r.text

            _wait(refused, 60, "/health never said why the worker refused")
            time.sleep(1.5)  # a retry or two later: still refused, still 503
            r = httpx.get(url + "/health", timeout=5)
            assert r.status_code == 503 and "unauthorized" in r.json()["error"]["message"]
            r = httpx.post(url + "/generate", timeout=10, json={"text": "hi"})
            assert r.status_code == 503
        _wait(lambda: "wrong worker token" in log.read_text(), 10, "the worker did not log it")
        assert "refused a frontend from ('127.0.0.1'" in log.read_text()


def test_no_token_at_a_worker_that_asks_for_one_is_reported(tiny_gguf) -> None:
    with tcp_worker(tiny_gguf.path, "--token", TOKEN) as (address, _):
        with lifecycle_server("--model", str(tiny_gguf.path), "--worker", address,
                              wait_ready=False) as url:  # fmt: skip

            def asked() -> bool:
                r = httpx.get(url + "/health", timeout=5)
                return r.status_code == 503 and "asks for a token" in r.text

            _wait(asked, 60, "/health never said the worker wants a token")


def test_tls_link_with_a_token(tiny_gguf, tmp_path) -> None:
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert_pem, ca_pem = tmp_path / "worker.pem", tmp_path / "ca.pem"
    cert.private_key_and_cert_chain_pem.write_to_path(str(cert_pem))
    ca.cert_pem.write_to_path(str(ca_pem))
    port = free_port()
    log = tmp_path / "worker.log"
    with tcp_worker(tiny_gguf.path, f"tls:127.0.0.1:{port}", "--tls-cert", str(cert_pem),
                    "--token", TOKEN, log=log) as (address, _):  # fmt: skip
        assert address.startswith("tls:")
        with lifecycle_server("--model", str(tiny_gguf.path), "--worker", address,
                              "--worker-token", TOKEN, "--worker-tls-ca", str(ca_pem)) as url:  # fmt: skip
            for _ in range(3):
                assert _generate(url, 8)["meta_info"]["completion_tokens"] == 8
            r = httpx.post(url + "/generate", timeout=60, json={"text": "hello", "stream": True,
                           "sampling_params": {"max_new_tokens": 16, "ignore_eos": True}})  # fmt: skip
            assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
        # Plain TCP to the TLS port: the handshake fails, the worker logs it and goes on.
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(wire.frame_bytes(wire.encode_frame(wire.Shutdown())))
            s.settimeout(15)
            try:
                while s.recv(4096):
                    pass
            except OSError:
                pass
        _wait(lambda: "refused a frontend" in log.read_text(), 10, "no refusal logged")
        with lifecycle_server("--model", str(tiny_gguf.path), "--worker", address,
                              "--worker-token", TOKEN, "--worker-tls-ca", str(ca_pem)) as url:  # fmt: skip
            assert _generate(url)["meta_info"]["completion_tokens"] == 4  # still serving


def test_the_frontend_reconnects_when_the_worker_comes_back(tiny_gguf) -> None:
    port = free_port()
    with ExitStack() as first_life:
        address, _ = first_life.enter_context(tcp_worker(tiny_gguf.path, port=port))
        with lifecycle_server("--model", str(tiny_gguf.path), "--worker", address,
                              "--restart-backoff", "0.2,0.5,1") as url:  # fmt: skip
            assert _generate(url)["meta_info"]["completion_tokens"] == 4
            pid = httpx.get(url + "/server_info").json()["internal_states"][0]["pid"]
            first_life.close()  # the worker is killed
            _wait(lambda: httpx.get(url + "/health").status_code == 503, 30, "still 200")
            time.sleep(2.0)  # a few failed reconnects, backing off
            with tcp_worker(tiny_gguf.path, port=port):
                _wait(lambda: httpx.get(url + "/health").status_code == 200, 60, "not back")
                assert _generate(url)["meta_info"]["completion_tokens"] == 4
                info = httpx.get(url + "/server_info").json()["internal_states"][0]
                assert info["pid"] != pid and info["restarts"] >= 1


def test_a_remote_worker_beside_a_spawned_one(tiny_gguf) -> None:
    with tcp_worker(tiny_gguf.path) as (address, _):
        with lifecycle_server("--model", str(tiny_gguf.path), "--dp", "1", "--worker", address,
                              "--router-policy", "round_robin", "--kv-cache-tokens", "1024",
                              "--worker-args", "--threads 1") as url:  # fmt: skip
            _wait(lambda: len([s for s in httpx.get(url + "/server_info").json()[
                "internal_states"] if s.get("status") == "ready"]) == 2, 60, "one not ready")  # fmt: skip
            for _ in range(6):
                _generate(url)
            info = httpx.get(url + "/server_info").json()
            states = info["internal_states"]
            assert len(states) == 2 and all(s["status"] == "ready" for s in states)
            assert info["router"]["policy"] == "round_robin"
            assert min(info["router"]["picks"]) >= 3, info["router"]
            metrics = httpx.get(url + "/metrics").text
            for w in ("0", "1"):  # each with its model's model_name label
                assert re.search(rf'^lifecycle_worker_ready{{model_name="[^"]+",worker="{w}"}} 1.0$',
                                 metrics, re.M), metrics  # fmt: skip
