"""Two models in one server (``--model`` repeated; issue 55, point 2): requests for each,
interleaved on every route that generates, give the same greedy tokens as that model
served alone; ``/v1/models`` lists both; a third, unknown name is OpenAI's 404."""

from __future__ import annotations

import pathlib
import subprocess
import sys
from typing import Any

import anyio
import httpx
import pytest

from lifecycle.app import slot_configs
from lifecycle.options import OPTIONS
from lifecycle.runtime import app_config, model_id
from tests.scripted import ROOT, lifecycle_server
from tests.tiny_gguf import TinySpec, write_tiny_gguf

_SERVE = ("--device", "cpu", "--max-running", "4", "--kv-cache-tokens", "1024")
_TOKENS = 8


@pytest.fixture(scope="module")
def two_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, pathlib.Path]:
    """Two tiny GGUF models with different random weights: different greedy tokens."""
    folder = tmp_path_factory.mktemp("two")
    a, b = folder / "alpha.gguf", folder / "beta.gguf"
    write_tiny_gguf(a, TinySpec(seed=0))
    write_tiny_gguf(b, TinySpec(seed=1))
    return a, b


def _requests(model: str | None) -> list[tuple[str, dict[str, Any]]]:
    """One greedy request per route; ``model`` None: the body names none."""
    named = {} if model is None else {"model": model}
    greedy = {"temperature": 0, "max_tokens": _TOKENS}
    chat = [{"role": "user", "content": "hi there"}]
    return [
        ("/v1/completions", {**named, "prompt": "hello world", **greedy}),
        ("/v1/chat/completions", {**named, "messages": chat, **greedy}),
        ("/v1/messages", {**named, "messages": chat, "max_tokens": _TOKENS, "temperature": 0}),
        ("/generate", {**named, "text": "hello world",
                       "sampling_params": {"max_new_tokens": _TOKENS, "temperature": 0}}),
    ]  # fmt: skip


def _text(route: str, body: dict[str, Any]) -> str:
    """What the route generated."""
    if route == "/v1/completions":
        return str(body["choices"][0]["text"])
    if route == "/v1/chat/completions":
        return str(body["choices"][0]["message"]["content"])
    if route == "/v1/messages":
        return "".join(b.get("text", "") for b in body["content"])
    return str(body["text"]) + repr(body["meta_info"].get("output_ids", ""))


async def _answers(
    base: str, models: list[str | None], headers: dict[str, str] | None = None
) -> dict[tuple[int, str], str]:
    """Every route's request for each model, all at once (interleaved at the server)."""
    out: dict[tuple[int, str], str] = {}
    async with httpx.AsyncClient(base_url=base, timeout=60, headers=headers) as client:

        async def one(i: int, route: str, body: dict[str, Any]) -> None:
            r = await client.post(route, json=body)
            assert r.status_code == 200, (route, body.get("model"), r.text)
            out[i, route] = _text(route, r.json())

        async with anyio.create_task_group() as tg:
            for route_index in range(4):
                for i, model in enumerate(models):
                    route, body = _requests(model)[route_index]
                    tg.start_soon(one, i, route, body)
    return out


def _alone(path: pathlib.Path) -> dict[str, str]:
    with lifecycle_server("--model", str(path), *_SERVE) as base:
        answers = anyio.run(_answers, base, [None])
    return {route: text for (_, route), text in answers.items()}


def test_two_models_each_as_served_alone(two_files: tuple[pathlib.Path, pathlib.Path]) -> None:
    a, b = two_files
    alone_a, alone_b = _alone(a), _alone(b)
    assert alone_a != alone_b  # two models, two answers: the routing is seen
    key = {"Authorization": "Bearer sk-two"}
    args = ("--model", str(a), "--model", f"second={b}", "--api-key", "sk-two", *_SERVE)
    with lifecycle_server(*args) as base, httpx.Client(base_url=base, timeout=10) as c:
        listed = c.get("/v1/models", headers=key).json()["data"]
        assert [m["id"] for m in listed] == ["alpha", "second"]
        assert c.get("/v1/models/second", headers=key).json()["id"] == "second"
        together = anyio.run(_answers, base, ["alpha", "second", None], key)
        assert {r: t for (i, r), t in together.items() if i == 0} == alone_a
        assert {r: t for (i, r), t in together.items() if i == 1} == alone_b
        assert {r: t for (i, r), t in together.items() if i == 2} == alone_a  # the first's
        for route, body in _requests("third"):
            assert c.post(route, json=body).status_code == 401  # no key: nothing learnt
            r = c.post(route, json=body, headers=key)
            assert r.status_code == 404, (route, r.text)
            error = r.json()["error"]
            assert "`third` does not exist" in error["message"]
            assert error["type" if route == "/v1/messages" else "code"] in (
                "not_found_error",  # Anthropic's envelope
                "model_not_found",
            )
        r = c.get("/v1/models/third", headers=key)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


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
