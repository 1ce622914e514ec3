"""A deadline bounds the request wherever its owner waits (issue 54, point 10).

A cumulative /generate stream with top-20 logprobs grows by megabytes; a client with a
4 KiB receive buffer that does not read blocks the server's write long before the
request's 1 s ``X-Request-Timeout``. ``wait`` checks the deadline only between writes,
so the worker used to generate on past it (2,941 tokens for 30.7 s in the issue's run).
The frontend's deadline watch now ends the call at its deadline: the worker holds
nothing soon after, and the client that reads again gets the 504 error event and
``[DONE]``. A real server, the scripted worker (5 ms a step: 1,500 tokens are 7.5 s)."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from tests.scripted import lifecycle_server

pytestmark = pytest.mark.timeout(90)


def test_a_deadline_ends_a_stream_whose_write_is_blocked() -> None:
    with lifecycle_server("--scripted-worker", "--worker-args", "--step-delay 0.005") as url:
        port = int(url.rsplit(":", 1)[1])
        body = json.dumps({
            "input_ids": [5, 6, 7], "stream": True, "return_logprob": True,
            "top_logprobs_num": 20, "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True},
        }).encode()  # fmt: skip
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", port))
        head = b"POST /generate HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        s.sendall(head + b"X-Request-Timeout: 1\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        t0 = time.monotonic()
        held = None
        while time.monotonic() - t0 < 3.0:  # the client reads nothing meanwhile
            state = httpx.get(url + "/server_info", timeout=5).json()["internal_states"][0]
            held = state["running"] + state["waiting"]
            if held == 0 and time.monotonic() - t0 > 1.0:
                break
            time.sleep(0.1)
        stopped_after = time.monotonic() - t0
        assert held == 0, "the worker still runs the request past its deadline"
        assert stopped_after < 2.5, stopped_after
        data = b""
        s.settimeout(30)
        while not data.endswith(b"\r\n0\r\n\r\n"):
            chunk = s.recv(1 << 20)
            assert chunk, "the stream ended without its last chunk"
            data += chunk
        s.close()
        events = [line[6:] for line in data.decode().split("\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == 504 and "deadline" in error["message"], error
