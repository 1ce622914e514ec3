"""Two models in one server (``--model`` repeated; issue 55, point 2): requests for each,
interleaved on every route that takes a model (generation, streaming, embeddings,
scores, tokenizer routes, the WebSocket), give what that model gives served alone;
``/v1/models`` lists both; a third, unknown name is a 404 on every one of those routes
(OpenAI's ``model_not_found``, Anthropic's ``not_found_error`` on its routes)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
import pytest
import websockets

from lifecycle.app import slot_configs
from lifecycle.options import OPTIONS
from lifecycle.runtime import app_config, model_id
from tests.scripted import ROOT, lifecycle_server
from tests.tiny_gguf import TinySpec, write_tiny_gguf

_SERVE = ("--device", "cpu", "--max-running", "4", "--kv-cache-tokens", "1024")
_TOKENS = 8
_KEY = {"Authorization": "Bearer sk-two"}
_ANTHROPIC = ("/v1/messages", "/v1/messages/count_tokens")
# What a model card says of its model, beyond the names it is served under.
_CARD_NAMES = ("id", "root", "created")
# Vectors of floats: on these tiny models (not on SmolLM2, where they are bit-identical)
# a prompt whose prefix the cache holds gives other last bits than one computed whole
# (measured: 1.9e-7 at most in an embedding, 1e-6 relative in a score, the same on
# every repeat), and interleaved requests hit the cache in no fixed order; the bound is
# ten times that. The tokens are the same; the two models differ in every digit.
_VECTORS = ("POST /v1/embeddings", "POST /v1/score", "PUT /v1/score")

Answers = dict[tuple[int, str], Any]  # (the index of the model asked, the probe) -> answer


@pytest.fixture(scope="module")
def two_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, pathlib.Path]:
    """Two tiny GGUF models with different random weights (different greedy tokens,
    embeddings and scores), and beta with a BOS token and a longer context: its tokenizer
    routes (/tokenize, count_tokens) and card answer differently too."""
    folder = tmp_path_factory.mktemp("two")
    a, b = folder / "alpha.gguf", folder / "beta.gguf"
    write_tiny_gguf(a, TinySpec(seed=0))
    write_tiny_gguf(b, TinySpec(seed=1, add_bos=True, context_length=320))
    return a, b


@dataclass(frozen=True)
class Probe:
    """One request to a route that takes a model."""

    route: str
    body: dict[str, Any] = field(default_factory=dict)
    method: str = "POST"
    stream: bool = False

    @property
    def name(self) -> str:
        return f"{self.method} {self.route}" + (" stream" if self.stream else "")


def _probes(model: str | None) -> list[Probe]:
    """One greedy request per route (and per way to ask it); ``model`` None: the body
    names none."""
    named = {} if model is None else {"model": model}
    greedy = {"temperature": 0, "max_tokens": _TOKENS}
    chat = [{"role": "user", "content": "hi there"}]
    native = {
        "text": "hello world",
        "sampling_params": {"max_new_tokens": _TOKENS, "temperature": 0},
    }
    responses = {"input": "hello world", "max_output_tokens": _TOKENS, "temperature": 0}
    score = {"query": "hello", "items": [" world", " there"], "label_token_ids": [1, 2, 3]}
    out = [
        Probe("/v1/completions", {"prompt": "hello world", **greedy}),
        Probe("/v1/completions", {"prompt": "hello world", **greedy, "stream": True}, stream=True),
        Probe("/v1/chat/completions", {"messages": chat, **greedy}),
        Probe("/v1/chat/completions", {"messages": chat, **greedy, "stream": True}, stream=True),
        Probe("/v1/messages", {"messages": chat, **greedy}),
        Probe("/v1/messages", {"messages": chat, **greedy, "stream": True}, stream=True),
        Probe("/v1/messages/count_tokens", {"messages": chat}),
        Probe("/v1/responses", responses),
        Probe("/v1/responses", {**responses, "stream": True}, stream=True),
        Probe("/generate", native),
        Probe("/generate", native, method="PUT"),
        Probe("/v1/embeddings", {"input": "hello world"}),
        Probe("/v1/score", score),
        Probe("/v1/score", score, method="PUT"),
        Probe("/tokenize", {"prompt": "hello world"}),
        Probe("/v1/tokenize", {"prompt": ["hello", "world"]}),
        Probe("/detokenize", {"tokens": [104, 101, 108]}),
        Probe("/v1/detokenize", {"tokens": [[104, 101], [108]]}),
    ]  # fmt: skip
    return [Probe(p.route, {**named, **p.body}, p.method, p.stream) for p in out]


def _answer(probe: Probe, body: dict[str, Any]) -> Any:
    """What the route answered of the model (not the names it was asked by)."""
    route = probe.route
    if route == "/v1/completions":
        return body["choices"][0]["text"]
    if route == "/v1/chat/completions":
        return body["choices"][0]["message"]["content"]
    if route == "/v1/messages":
        return "".join(b.get("text", "") for b in body["content"])
    if route == "/v1/responses":
        return "".join(c["text"] for o in body["output"] for c in o.get("content", []))
    if route == "/generate":
        return body["text"], body["output_ids"]
    if route == "/v1/embeddings":
        return [d["embedding"] for d in body["data"]]
    if route == "/v1/score":
        return body["scores"]
    return body  # the tokenizer routes: all of it


def _delta(route: str, event: dict[str, Any]) -> str:
    """The text one streamed event adds."""
    if route == "/v1/completions":
        return "".join(c.get("text", "") for c in event.get("choices", []))
    if route == "/v1/chat/completions":
        return "".join(c["delta"].get("content") or "" for c in event.get("choices", []))
    if route == "/v1/messages" and event.get("type") == "content_block_delta":
        return str(event["delta"].get("text", ""))
    if route == "/v1/responses" and event.get("type") == "response.output_text.delta":
        return str(event["delta"])
    return ""


async def _ask(client: httpx.AsyncClient, probe: Probe) -> Any:
    """The probe's answer: the joined text of a stream, else ``_answer``."""
    if not probe.stream:
        r = await client.request(probe.method, probe.route, json=probe.body)
        assert r.status_code == 200, (probe.name, probe.body.get("model"), r.text)
        return _answer(probe, r.json())
    text = []
    async with client.stream(probe.method, probe.route, json=probe.body) as r:
        assert r.status_code == 200, (probe.name, probe.body.get("model"), await r.aread())
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line.removeprefix("data: "))
                assert "error" not in event, (probe.name, event)
                text.append(_delta(probe.route, event))
    return "".join(text)


def _ws_url(base: str, model: str | None) -> str:
    return (
        base.replace("http", "ws", 1) + "/v1/stream" + ("" if model is None else f"?model={model}")
    )


async def _ws(base: str, model: str | None, headers: dict[str, str] | None) -> dict[str, Any]:
    """A ``generate``, a ``completions`` and a ``chat`` message on one socket: each
    one's streamed text and token ids."""
    greedy = {"temperature": 0, "max_tokens": _TOKENS}
    messages: dict[str, dict[str, Any]] = {
        "generate": {"text": "hello world",
                     "sampling_params": {"max_new_tokens": _TOKENS, "temperature": 0}},
        "completions": {"prompt": "hello world", **greedy},
        "chat": {"messages": [{"role": "user", "content": "hi there"}], **greedy},
    }  # fmt: skip
    named = {} if model is None else {"model": model}
    out: dict[str, Any] = {kind: ("", []) for kind in messages}
    async with websockets.connect(_ws_url(base, model), additional_headers=headers) as ws:
        for kind, body in messages.items():
            await ws.send(json.dumps({"type": kind, "id": kind, "body": {**named, **body}}))
        ended = 0
        while ended < len(messages):
            msg = json.loads(await ws.recv())
            assert msg["type"] in ("delta", "done"), msg
            text, ids = out[msg["id"]]
            if msg["type"] == "delta":
                out[msg["id"]] = (text + msg["text"], ids + msg["output_ids"])
            ended += msg["type"] == "done"
    return {f"WS {kind}": answer for kind, answer in out.items()}


async def _answers(
    base: str, models: list[str | None], headers: dict[str, str] | None = None
) -> Answers:
    """Every probe and a socket for each model, all at once (interleaved at the server)."""
    out: Answers = {}
    async with httpx.AsyncClient(base_url=base, timeout=60, headers=headers) as client:

        async def one(i: int, probe: Probe) -> None:
            out[i, probe.name] = await _ask(client, probe)

        async def socket(i: int, model: str | None) -> None:
            for name, answer in (await _ws(base, model, headers)).items():
                out[i, name] = answer

        async with anyio.create_task_group() as tg:
            for i, model in enumerate(models):
                tg.start_soon(socket, i, model)
            probes = [_probes(model) for model in models]
            for k in range(len(probes[0])):  # mixed: each route's requests side by side
                for i, of_model in enumerate(probes):
                    tg.start_soon(one, i, of_model[k])
    return out


def _card(card: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in card.items() if k not in _CARD_NAMES}


def _alone(path: pathlib.Path) -> dict[str, Any]:
    """The answers of the model served alone (no ``model`` named), and its card."""
    with lifecycle_server("--model", str(path), *_SERVE) as base:
        unnamed: list[str | None] = [None]
        answers = anyio.run(_answers, base, unnamed)
        card = httpx.get(f"{base}/v1/models/{path.stem}", timeout=10).json()
    return {"card": _card(card)} | {name: a for (_, name), a in answers.items()}


@pytest.fixture(scope="module")
def alone(two_files: tuple[pathlib.Path, pathlib.Path]) -> tuple[dict[str, Any], ...]:
    """What each model answers served alone."""
    a, b = two_files
    answers = _alone(a), _alone(b)
    # Two models, two answers: the routing is seen, but for the routes that read only the
    # vocabulary and chat template the two share (misrouted, the first model's strict
    # name check refuses `second` there: a 404, not the answer expected).
    for name in answers[0]:
        if not name.endswith(("detokenize", "count_tokens")):
            assert answers[0][name] != answers[1][name], name
    return answers


@pytest.fixture(scope="module")
def together(two_files: tuple[pathlib.Path, pathlib.Path]) -> Iterator[str]:
    """Both models in one server (beta served as ``second``), behind an API key."""
    a, b = two_files
    args = ("--model", str(a), "--model", f"second={b}", "--api-key", "sk-two", *_SERVE)
    with lifecycle_server(*args) as base:
        yield base


def test_two_models_each_as_served_alone(alone: tuple[dict[str, Any], ...], together: str) -> None:
    alone_a, alone_b = alone
    answers = anyio.run(_answers, together, ["alpha", "second", None], _KEY)
    for i, expected in enumerate((alone_a, alone_b, alone_a)):  # None: the first model's
        got = {name: a for (j, name), a in answers.items() if j == i}
        want = {k: v for k, v in expected.items() if k != "card"}
        for name in _VECTORS:
            close = [pytest.approx(v, rel=1e-5, abs=1e-6) for v in want.pop(name)]
            assert got.pop(name) == close, (i, name)
        assert got == want, i
    with httpx.Client(base_url=together, timeout=10, headers=_KEY) as c:
        listed = c.get("/v1/models").json()["data"]
        assert [m["id"] for m in listed] == ["alpha", "second"]
        for name, expected in (("alpha", alone_a), ("second", alone_b)):
            card = c.get(f"/v1/models/{name}").json()
            assert card["id"] == name and _card(card) == expected["card"], name


def test_an_unknown_model_is_a_404_on_every_route(together: str) -> None:
    """Regression: PUT /generate and /v1/score and the tokenizer routes went to the first
    model whatever the body named (a 200 from it); count_tokens was the first model's
    strict 404 for the second model too."""
    with httpx.Client(base_url=together, timeout=10) as c:
        for probe in _probes("third"):
            r = c.request(probe.method, probe.route, json=probe.body)
            assert r.status_code == 401, probe.name  # no key: nothing learnt
            r = c.request(probe.method, probe.route, json=probe.body, headers=_KEY)
            assert r.status_code == 404, (probe.name, r.text)
            error = r.json()["error"]
            assert error["message"] == "The model `third` does not exist.", probe.name
            if probe.route in _ANTHROPIC:  # Anthropic's envelope
                assert r.json()["type"] == "error" and error["type"] == "not_found_error"
            else:
                assert error["code"] == "model_not_found", (probe.name, error)
        r = c.get("/v1/models/third", headers=_KEY)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_a_socket_for_an_unknown_model_is_a_404(together: str) -> None:
    """Regression: every socket was the first model's (``?model=`` now picks one)."""

    async def upgrade(headers: dict[str, str] | None) -> websockets.Response:
        with pytest.raises(websockets.InvalidStatus) as refused:
            async with websockets.connect(_ws_url(together, "third"), additional_headers=headers):
                pass
        return refused.value.response

    assert anyio.run(upgrade, None).status_code == 401
    response = anyio.run(upgrade, _KEY)
    assert response.status_code == 404
    assert json.loads(response.body)["error"]["code"] == "model_not_found"


def _slots(*models: str, **values: Any) -> list[str]:
    """The model ids ``--model`` given these times serves."""
    cfg = app_config({**{o.name: o.default for o in OPTIONS}, "model": list(models), **values})
    return [model_id(c, c.model or "") for c in slot_configs(cfg)]


def test_model_repeated_names_each_model(two_files: tuple[pathlib.Path, pathlib.Path]) -> None:
    a, b = two_files
    assert _slots(str(a)) == ["alpha"]  # once: one slot, as ever
    assert _slots(str(a), str(b)) == ["alpha", "beta"]
    assert _slots(f"one={a}", f"two={b}") == ["one", "two"]
    assert _slots(str(a), str(b), served_model_name="first") == ["first", "beta"]
    with pytest.raises(ValueError, match="two models named alpha"):
        _slots(str(a), str(a))
    with pytest.raises(ValueError, match="--frontends N serves one model"):
        _slots(str(a), str(b), frontends=2)


def test_two_models_under_one_name_refused_before_listening(
    two_files: tuple[pathlib.Path, pathlib.Path],
) -> None:
    a, _ = two_files
    argv = [sys.executable, "-m", "lifecycle", "serve", "--model", str(a), "--model", str(a),
            "--port", "0"]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "error: two models named alpha: name one with --model NAME=SPEC"
    ]


def test_the_engine_serves_one_model(two_files: tuple[pathlib.Path, pathlib.Path]) -> None:
    from lifecycle.engine import Engine

    a, b = two_files
    with pytest.raises(ValueError, match="Engine\\(\\) serves one model"):
        Engine(model=[str(a), str(b)])  # type: ignore[arg-type]


def test_a_message_for_another_model_than_its_sockets_is_a_404(together: str) -> None:
    """A socket serves the model its ``?model=`` names: a message naming another one is
    the 404 the same request gets over HTTP, never the socket's model's tokens."""

    async def ask(kind: str, body: dict[str, Any]) -> dict[str, Any]:
        url = _ws_url(together, "alpha")
        async with websockets.connect(url, additional_headers=_KEY) as ws:
            await ws.send(json.dumps({"type": kind, "id": 1, "body": body}))
            return dict(json.loads(await ws.recv()))

    generate = {"model": "second", "text": "hi", "sampling_params": {"max_new_tokens": 2}}
    chat = {"model": "second", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for kind, body in (("generate", generate), ("chat", chat)):
        msg = anyio.run(ask, kind, body)
        assert msg["type"] == "error", (kind, msg)
        assert msg["error"]["code"] == 404, (kind, msg)
        assert msg["error"]["message"] == "The model `second` does not exist.", (kind, msg)
