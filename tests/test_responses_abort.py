"""``/v1/responses`` aborted by ``/abort_request`` ends ``cancelled``, never ``completed``
(issue 37 item 6), against a real server and a real scripted worker, streamed and unary,
with and without a reasoning parser (the two stream paths of ``lifecycle.api.responses``).

The server's chat template renders only the last message's text, and the scripted worker
echoes its prompt cyclically, so a response runs to ``max_output_tokens`` unless it is
aborted."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from lifecycle.testing.pytest_plugin import LiveServer, start_server

LIMIT = 500
TEMPLATES = {
    "plain": "{{ messages[-1]['content'] }}",
    # the comment shows the template's <think>: the qwen3 reasoning parser is on
    "reasoning": "{#- <think> -#}{{ messages[-1]['content'] }}",
}
PROMPTS = {"plain": "one two three four five", "reasoning": "<think>\none two three four five"}


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def server(request: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    path = Path(tmp_path_factory.mktemp("tpl")) / "echo.jinja"
    path.write_text(TEMPLATES[request.param])
    args = ("--scripted-worker", "--chat-template", str(path),
            "--worker-args", "--step-delay 0.01")  # fmt: skip
    with start_server(*args) as srv:
        srv.flavour = request.param  # type: ignore[attr-defined]
        yield srv


def _body(srv: LiveServer, **extra: Any) -> dict[str, Any]:
    prompt = PROMPTS[srv.flavour]  # type: ignore[attr-defined]
    return {"model": "m", "input": prompt, "max_output_tokens": LIMIT, **extra}


def _abort_all(srv: LiveServer) -> None:
    r = httpx.post(srv.url + "/abort_request", json={"abort_all": True}, timeout=10)
    assert r.status_code == 200


def _check_cancelled(final: dict[str, Any]) -> None:
    assert final["status"] == "cancelled", final
    assert final["error"] is None and final["incomplete_details"] is None
    assert 0 < final["usage"]["output_tokens"] < LIMIT
    assert final["output"], final
    assert {item["status"] for item in final["output"]} <= {"incomplete", "completed"}
    assert final["output"][-1]["status"] == "incomplete"


def test_aborted_stream_ends_cancelled_not_completed(server: LiveServer) -> None:
    """issue 37 item 6: ``abort_all`` mid-stream ended with ``response.completed``,
    ``status: completed`` after 23 of 500 tokens. Protection: ``_Reply.final`` maps the
    abort finish to ``cancelled``; the stream's terminal event is ``response.incomplete``
    and the open items end ``incomplete``."""
    events: list[dict[str, Any]] = []
    body = _body(server, stream=True)
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(json.loads(line[6:]))
            deltas = [e for e in events if e["type"].endswith("_text.delta")]
            if len(deltas) == 10:
                _abort_all(server)
    kinds = [e["type"] for e in events]
    assert "response.completed" not in kinds and "response.failed" not in kinds, kinds
    assert kinds[-1] == "response.incomplete"
    final = events[-1]["response"]
    _check_cancelled(final)
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == final["output"]
    server.assert_invariants()


def test_aborted_unary_response_is_cancelled(server: LiveServer) -> None:
    """issue 37 item 6: the unary reply of an aborted response said ``completed``.
    Protection: the same mapping in ``_Reply.final``; the official client reads it."""

    def abort_when_streaming() -> None:
        server.wait_state("streaming", timeout=10)
        _abort_all(server)

    t = threading.Thread(target=abort_when_streaming)
    t.start()
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
        r = client.responses.create(**_body(server), timeout=30)
    t.join(10)
    assert r.status == "cancelled"
    _check_cancelled(r.model_dump(mode="json"))
    server.assert_invariants()
