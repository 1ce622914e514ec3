"""``/v1/score`` aborted while queued answers as ``/v1/embeddings`` does in the same spot:
400 with code ``aborted`` (issue 37 item 9), against a real server and a real scripted
worker. One worker credit (``--max-pending 1``) held by a long generation keeps the next
request queued in the frontend until ``/abort_request`` ends it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from lifecycle.testing.pytest_plugin import LiveServer, start_server

ARGS = ("--scripted-worker", "--max-pending", "1", "--worker-args", "--step-delay 0.01")
SCORE = {"query": [5, 6, 7], "items": [[8], [9, 10]], "label_token_ids": [11, 12]}
EMBED = {"model": "m", "input": [[5, 6, 7, 8], [5, 6, 7, 9, 10]]}


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with start_server(*ARGS) as srv:
        yield srv


def _aborted_while_queued(srv: LiveServer, path: str, body: dict[str, Any]) -> httpx.Response:
    """POST ``body`` behind a long generation holding the only credit; abort everything
    once it is queued; returns its answer."""
    blocker = {"input_ids": [1], "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
    got: dict[str, httpx.Response] = {}

    def post(key: str, route: str, payload: dict[str, Any]) -> None:
        got[key] = httpx.post(srv.url + route, json=payload, timeout=30)

    threads = [threading.Thread(target=post, args=("blocker", "/generate", blocker))]
    threads[0].start()
    srv.wait_state("streaming", timeout=10)
    threads.append(threading.Thread(target=post, args=("it", path, body)))
    threads[1].start()
    try:
        srv.wait_state("queued", len(body.get("items") or body.get("input") or ()), timeout=10)
    finally:
        r = httpx.post(srv.url + "/abort_request", json={"abort_all": True}, timeout=10)
        for t in threads:
            t.join(30)
    assert r.status_code == 200
    assert got["blocker"].status_code == 200  # its partial output, finish_reason abort
    srv.assert_invariants()
    return got["it"]


def test_score_aborted_while_queued_is_the_documented_400(server: LiveServer) -> None:
    """issue 37 item 9: ``/v1/score`` aborted while queued was a 500 (``IndexError``: no
    logprobs to score); embeddings in the same spot give the documented 400. Protection:
    ``ScoreAPI.score`` answers an aborted item as ``/v1/embeddings`` does."""
    score = _aborted_while_queued(server, "/v1/score", SCORE)
    embed = _aborted_while_queued(server, "/v1/embeddings", EMBED)
    assert embed.status_code == 400, embed.text
    assert score.status_code == 400, score.text
    assert score.json() == embed.json()
    assert score.json()["error"]["code"] == "aborted"
    # The server goes on scoring.
    r = httpx.post(server.url + "/v1/score", json=SCORE, timeout=30)
    assert r.status_code == 200 and len(r.json()["scores"]) == 2
