"""Models loaded on demand and unloaded when idle (issue 55, point 3; lifecycle/link/model_set.py):
``--models-max``, ``--sleep-idle-seconds``, ``POST /models/load`` and ``/models/unload``,
on real servers with two tiny GGUF models (different random weights) and real workers.

A model's worker processes are found as the server's children running ``gpu.worker``
with its file: unloading must end them (their memory given back), loading start one."""

from __future__ import annotations

import json
import pathlib
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import anyio
import httpx
import psutil
import pytest

from tests.scripted import server_process
from tests.tiny_gguf import TinySpec, write_tiny_gguf

_SERVE = ("--device", "cpu", "--max-running", "4", "--kv-cache-tokens", "1024")
_LONG = 240  # tokens of the streams that hold a model while another one waits


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """alpha.gguf and beta.gguf: two tiny models with different greedy tokens."""
    folder = tmp_path_factory.mktemp("models")
    write_tiny_gguf(folder / "alpha.gguf", TinySpec(seed=0))
    write_tiny_gguf(folder / "beta.gguf", TinySpec(seed=1))
    return folder


@contextmanager
def server(*args: str) -> Iterator[tuple[str, psutil.Process]]:
    """``lifecycle serve`` as a real process, once ``/health`` is 200: its URL and process."""
    with server_process(*_SERVE, *args) as (url, proc):
        yield url, psutil.Process(proc.pid)


def workers_of(server: psutil.Process) -> dict[str, int]:
    """The server's live worker processes: model file name -> pid."""
    out = {}
    for child in server.children(recursive=True):
        try:
            argv = child.cmdline()
        except psutil.NoSuchProcess:
            continue
        if "gpu.worker" in argv and "--model" in argv:
            out[pathlib.Path(argv[argv.index("--model") + 1]).stem] = child.pid
    return out


def states(url: str, headers: dict[str, str] | None = None) -> dict[str, str]:
    cards = httpx.get(url + "/v1/models", headers=headers).json()["data"]
    return {c["id"]: c["state"] for c in cards}


def greedy(url: str, model: str, rid: str | None = None) -> list[int]:
    body: dict[str, Any] = {"model": model, "text": "hello world",
                            "sampling_params": {"max_new_tokens": 8, "temperature": 0}}  # fmt: skip
    if rid is not None:
        body["rid"] = rid
    r = httpx.post(url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return list(r.json()["output_ids"])


async def stream(url: str, model: str, tokens: int,
                 started: anyio.Event | None = None) -> tuple[str, int]:  # fmt: skip
    """A streamed /generate of ``tokens`` forced tokens: ("done", n) after [DONE] with no
    error event, else ("error" | "cut", n); ``started`` is set at its first token."""
    body = {"model": model, "input_ids": [11, 12, 13], "stream": True,
            "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}}  # fmt: skip
    seen, error = 0, False
    async with httpx.AsyncClient(timeout=60) as c:
        async with c.stream("POST", url + "/generate", json=body) as r:
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    return ("error" if error else "done"), seen
                if line.startswith("data: "):
                    event = json.loads(line[6:])
                    error = error or "error" in event
                    seen = len(event.get("output_ids", ())) or seen
                    if started is not None and seen:
                        started.set()
    return "cut", seen


def wait_for(check: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_models_max_one_swaps_without_cutting_anything(models_dir: pathlib.Path) -> None:
    """``--models-max 1``: the first model loads at start; a request for the other waits
    while the first one's streams finish whole, then the first is unloaded (its worker
    ends) and the other loaded; each model's greedy tokens are the same before and after
    a switch; the wait is in the request's trace."""
    with server("--models-dir", str(models_dir), "--models-max", "1") as (url, proc):
        assert states(url) == {"alpha": "loaded", "beta": "unloaded"}
        assert list(workers_of(proc)) == ["alpha"]
        alpha = greedy(url, "alpha")

        async def swap_under_load() -> tuple[list[tuple[str, int]], list[int], list[float],
                                             float, float]:  # fmt: skip
            ends: list[float] = []
            results: list[tuple[str, int]] = []
            started = [anyio.Event(), anyio.Event()]

            async def hold(i: int) -> None:
                results.append(await stream(url, "alpha", _LONG, started[i]))
                ends.append(time.monotonic())

            async with anyio.create_task_group() as tg:
                for i in range(2):
                    tg.start_soon(hold, i)
                for event in started:  # the streams run: beta is asked at once
                    await event.wait()
                beta_start = time.monotonic()
                beta = await anyio.to_thread.run_sync(greedy, url, "beta", "beta-1")
                beta_end = time.monotonic()
            return results, beta, ends, beta_start, beta_end

        results, beta, ends, beta_start, beta_end = anyio.run(swap_under_load)
        assert results == [("done", _LONG)] * 2  # nothing of alpha's was cut
        assert beta_start < min(ends)  # beta was asked while they streamed
        assert max(ends) < beta_end  # and waited for them
        assert states(url) == {"alpha": "unloaded", "beta": "loaded"}
        wait_for(lambda: list(workers_of(proc)) == ["beta"])
        assert beta != alpha
        trace = httpx.get(url + "/debug/requests/beta-1").json()
        assert trace["model"] == "beta" and trace["model_wait_ms"] > 0
        assert greedy(url, "alpha") == alpha  # switched back: the same tokens
        assert states(url) == {"alpha": "loaded", "beta": "unloaded"}
        assert greedy(url, "beta") == beta
        assert list(workers_of(proc)) == ["beta"]


def test_an_idle_model_sleeps_and_the_next_request_wakes_it(models_dir: pathlib.Path) -> None:
    """``--sleep-idle-seconds``: idle that long, the model is unloaded (its worker gone,
    /health still 200); the next request loads it and gets the same tokens."""
    alpha = str(models_dir / "alpha.gguf")
    with server("--model", alpha, "--sleep-idle-seconds", "1") as (url, proc):
        first = greedy(url, "alpha")
        pid = workers_of(proc)["alpha"]
        wait_for(lambda: states(url) == {"alpha": "unloaded"}, timeout=10)
        wait_for(lambda: not psutil.pid_exists(pid) or not workers_of(proc))
        assert httpx.get(url + "/health").status_code == 200  # asleep is healthy
        assert greedy(url, "alpha", "woken") == first
        assert httpx.get(url + "/debug/requests/woken").json()["model_wait_ms"] > 0
        assert list(workers_of(proc)) == ["alpha"] and workers_of(proc)["alpha"] != pid


def test_the_admin_routes_load_and_unload_by_name(models_dir: pathlib.Path) -> None:
    admin, user = {"authorization": "Bearer root"}, {"authorization": "Bearer user"}
    args = ("--models-dir", str(models_dir), "--models-max", "1")
    with server(*args, "--admin-api-key", "root", "--api-key", "user") as (url, proc):

        def post(route: str, body: Any, headers: dict[str, str]) -> httpx.Response:
            return httpx.post(url + route, json=body, headers=headers, timeout=60)

        assert post("/models/unload", {"model": "alpha"}, {}).status_code == 401
        assert post("/models/unload", {"model": "alpha"}, user).status_code == 401  # not admin
        r = post("/models/unload", {"model": "alpha"}, admin)
        assert (r.status_code, r.json()) == (200, {"model": "alpha", "state": "unloaded"})
        assert workers_of(proc) == {}
        r = post("/models/load", {"model": "beta"}, admin)
        assert (r.status_code, r.json()) == (200, {"model": "beta", "state": "loaded"})
        assert list(workers_of(proc)) == ["beta"]
        r = post("/models/load", {"model": "alpha"}, admin)  # beta makes room
        assert r.json()["state"] == "loaded" and list(workers_of(proc)) == ["alpha"]
        r = post("/models/load", {"model": "gamma"}, admin)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        for bad in ([], {"model": 3}, {}):
            assert post("/models/load", bad, admin).status_code == 400
        assert states(url, admin) == {"alpha": "loaded", "beta": "unloaded"}


def test_a_model_that_cannot_load_ends_its_requests_naming_it(
    models_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """beta's file is broken after the server started: a request for it is a 503 naming
    the model and why; the server and alpha go on; beta loads once its file is back."""
    shutil.copy(models_dir / "alpha.gguf", tmp_path / "alpha.gguf")
    shutil.copy(models_dir / "beta.gguf", tmp_path / "beta.gguf")
    with server("--models-dir", str(tmp_path), "--models-max", "1") as (url, proc):
        alpha = greedy(url, "alpha")
        good = (tmp_path / "beta.gguf").read_bytes()
        (tmp_path / "beta.gguf").write_bytes(good[: len(good) // 3])  # truncated
        body = {"model": "beta", "prompt": "hi", "max_tokens": 2}
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 503, r.text
        message = r.json()["error"]["message"]
        assert "`beta` could not be loaded" in message and "refused its model" in message
        assert states(url)["beta"] == "unloaded"
        assert greedy(url, "alpha") == alpha  # loaded again
        (tmp_path / "beta.gguf").write_bytes(good)
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        assert states(url) == {"alpha": "unloaded", "beta": "loaded"}


def test_the_least_recently_used_model_makes_room(tmp_path: pathlib.Path) -> None:
    """Three models, two loaded at most (on the scripted worker: no weights to load, so
    only the choice is timed): a third model's load unloads the one used least recently."""
    for i, name in enumerate(("a", "b", "c")):
        write_tiny_gguf(tmp_path / f"{name}.gguf", TinySpec(seed=i))
    args = ("--models-dir", str(tmp_path), "--models-max", "2", "--scripted-worker")
    with server(*args) as (url, _):

        def use(model: str) -> None:
            body = {"model": model, "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
            assert httpx.post(url + "/generate", json=body, timeout=60).status_code == 200

        assert states(url) == {"a": "loaded", "b": "loaded", "c": "unloaded"}
        use("b")
        use("a")  # b is now the least recently used
        use("c")
        assert states(url) == {"a": "loaded", "b": "unloaded", "c": "loaded"}
        use("b")  # a was used before c
        assert states(url) == {"a": "unloaded", "b": "loaded", "c": "loaded"}


def test_models_dir_and_what_is_refused(tmp_path: pathlib.Path) -> None:
    from lifecycle.app import slot_configs
    from lifecycle.models import models_in
    from lifecycle.runtime import AppConfig

    with pytest.raises(ValueError, match="no such folder"):
        models_in(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="no GGUF file or model folder"):
        models_in(str(tmp_path))
    (tmp_path / "b.gguf").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    assert models_in(str(tmp_path)) == [f"b={tmp_path / 'b.gguf'}", f"hf={tmp_path / 'hf'}"]
    for option in ({"models_max": 1}, {"sleep_idle_seconds": 5.0}):
        with pytest.raises(ValueError, match="--frontends N keeps its model loaded"):
            slot_configs(AppConfig(frontends=2, **option))  # type: ignore[arg-type]


def test_without_the_options_models_stay_and_the_routes_say_so(models_dir: pathlib.Path) -> None:
    alpha = str(models_dir / "alpha.gguf")
    with server("--model", alpha, "--scripted-worker") as (url, _):
        r = httpx.post(url + "/models/load", json={"model": "alpha"})
        assert (r.status_code, r.json()) == (200, {"model": "alpha", "state": "loaded"})
        r = httpx.post(url + "/models/unload", json={"model": "alpha"})
        assert r.status_code == 400 and "--models-max" in r.json()["error"]["message"]
        r = httpx.post(url + "/models/load", json={"model": "gamma"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
