"""Readiness, worker death, hung worker and overload, through real HTTP to a real server
process whose scripted worker is told to misbehave (``lifecycle.testing.scripted_worker`` knobs)."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx

from .scripted import lifecycle_server


def _wait_status(url: str, path: str, status: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(url + path, timeout=5).status_code != status:
        assert time.monotonic() < deadline, f"{path} never answered {status}"
        time.sleep(0.05)


def test_not_ready_then_worker_death_then_recovery() -> None:
    args = (
        "--scripted-worker",
        "--worker-args",
        "--startup-delay 3 --step-delay 0.01 --die-after-steps 60",
    )
    with lifecycle_server(*args, wait_ready=False) as url:
        r = httpx.get(url + "/health")
        assert r.status_code == 503 and "error" in r.json()
        g = httpx.post(url + "/generate", json={"input_ids": [1, 2]})
        assert g.status_code == 503 and g.headers["retry-after"]
        _wait_status(url, "/health", 200, 60)

        # A stream in flight when the worker dies ends with an explicit error event.
        frames: list[Any] = []
        with httpx.stream(
            "POST",
            url + "/generate",
            timeout=30,
            json={
                "input_ids": [5, 6],
                "stream": True,
                "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True},
            },
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    frames.append(line[6:])
        assert frames[-1] == "[DONE]"
        err = json.loads(frames[-2])["error"]
        assert err["code"] == 503 and "worker" in err["message"]

        # The server stays up, restarts the worker and serves again.
        _wait_status(url, "/health", 200, 30)
        ok = httpx.post(
            url + "/generate",
            timeout=30,
            json={"input_ids": [7], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}},
        )
        assert ok.status_code == 200 and ok.json()["output_ids"] == [7, 7, 7]
        info = httpx.get(url + "/server_info").json()
        assert info["internal_states"][0]["restarts"] >= 1
        assert info["live_requests"] == 0
        assert info["failed_requests"].get("worker_lost", 0) >= 1


def test_hung_worker_turns_health_503_and_is_restarted() -> None:
    args = (
        "--scripted-worker",
        "--hung-timeout",
        "1.0",
        "--worker-args",
        "--step-delay 0.01 --hang-after-steps 20",
    )
    with lifecycle_server(*args) as url:
        result: dict[str, Any] = {}

        def unary() -> None:
            result["r"] = httpx.post(
                url + "/generate",
                timeout=30,
                json={
                    "input_ids": [1, 3],
                    "sampling_params": {"max_new_tokens": 500, "ignore_eos": True},
                },
            )

        t = threading.Thread(target=unary)
        t.start()
        _wait_status(url, "/health", 503, 10)
        t.join(20)
        assert result["r"].status_code == 503
        _wait_status(url, "/health", 200, 30)
        assert httpx.get(url + "/server_info").json()["live_requests"] == 0


def test_overload_answers_503_with_retry_after_at_once() -> None:
    args = (
        "--scripted-worker",
        "--max-pending",
        "1",
        "--max-queued",
        "1",
        "--worker-args",
        "--step-delay 0.02",
    )
    with lifecycle_server(*args) as url:
        body = {
            "input_ids": [4],
            "stream": True,
            "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True},
        }
        with httpx.Client(timeout=30) as c1, httpx.Client(timeout=30) as c2:
            with c1.stream("POST", url + "/generate", json=body) as running:
                lines = running.iter_lines()  # kept: a collected iterator closes the response
                next(lines)  # this request holds the worker's one credit
                with c2.stream("POST", url + "/generate", json=body) as queued:
                    assert queued.status_code == 200  # admitted: waits for a credit
                    t0 = time.monotonic()
                    refused = httpx.post(url + "/generate", json=body)
                    assert time.monotonic() - t0 < 2
                    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
                    assert "overloaded" in refused.json()["error"]["message"]
        deadline = time.monotonic() + 5
        while httpx.get(url + "/server_info").json()["live_requests"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_serve_with_a_worker_started_elsewhere() -> None:
    from .scripted import scripted_worker

    with scripted_worker("--step-delay", "0.005") as address:
        with lifecycle_server("--worker", address) as url:
            r = httpx.post(
                url + "/generate",
                timeout=30,
                json={
                    "input_ids": [42, 43],
                    "sampling_params": {"max_new_tokens": 3, "ignore_eos": True},
                },
            )
            assert r.status_code == 200 and r.json()["output_ids"] == [42, 43, 42]
            info = httpx.get(url + "/server_info").json()
            assert info["worker"] == [address] and info["internal_states"][0]["pid"]
