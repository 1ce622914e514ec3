"""Workers placed, restarted and owned by Ray (issue 58; lifecycle/link/ray_replicas.py),
on a real local Ray cluster of three nodes (``ray.cluster_utils.Cluster``), each with
one ``replica`` resource, every node on the loopback address and no dashboard.

A replica asks for ``{"replica": 1}``, so at most one runs on a node: Ray's own state
(the actors' node ids) says where each is."""

from __future__ import annotations

import json
import os
import pathlib
import time
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import pytest

from tests.scripted import server_process
from tests.tiny_gguf import TinySpec, write_tiny_gguf

# Ray finds a node's address from the route to the internet unless told this, on Linux
# too: with it every node, the GCS and the drivers stay on 127.0.0.1. Ray reads it once,
# when imported: set before the import, for this process (the test's own driver) and
# passed to the servers'.
LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
os.environ.update(LOOPBACK)
ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

_SERVE = ("--device", "cpu", "--max-running", "4", "--kv-cache-tokens", "1024")
_REPLICA = '{"replica": 1}'


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("ray") / "tiny.gguf"
    write_tiny_gguf(path, TinySpec(seed=0))
    return path


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Cluster, list[Any]]]:
    loopback = {"node_ip_address": "127.0.0.1", "num_cpus": 2, "resources": {"replica": 1}}
    c = Cluster(initialize_head=True, head_node_args={**loopback, "include_dashboard": False})
    nodes = [c.add_node(**loopback) for _ in range(2)]
    c.wait_for_nodes()
    try:
        yield c, nodes
    finally:
        c.shutdown()


def _serve(*args: str) -> Any:
    """A server on the tiny model, its Ray processes on loopback, once every replica is
    ready: ``(url, process)``."""
    env = LOOPBACK
    return server_process(*_SERVE, *args, env=env, ready=_all_ready, timeout=180)


def _all_ready(url: str) -> bool:
    """/health is 200 once one worker is: every replica ready (or every --dp worker)."""
    info = httpx.get(url + "/server_info", timeout=5).json()
    return all(w.get("ready") for w in info["internal_states"])


def _replicas(url: str) -> list[dict[str, Any]]:
    return list(httpx.get(url + "/server_info").json()["ray_replicas"])


def _actors() -> dict[str, tuple[str, str]]:
    """Ray's own record of the replica actors: actor id -> (node id, state), from the
    GCS's actor table (the ``ray.util.state`` API needs the dashboard, which is off)."""
    table = ray._private.state.actors()
    return {
        a: (v["Address"]["NodeID"], v["State"])
        for a, v in table.items()
        if v.get("ActorClassName", "").endswith("_Replica")
    }


def _greedy(url: str, prompt: str) -> list[int]:
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    r = httpx.post(url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return list(r.json()["output_ids"])


def test_replicas_on_two_nodes_give_the_local_tokens(
    cluster: tuple[Cluster, list[Any]], model: pathlib.Path
) -> None:
    c, _ = cluster
    prompts = [f"hello {i}" for i in range(6)]
    with _serve("--model", str(model), "--dp", "2") as (url, _):
        local = [_greedy(url, p) for p in prompts]
    args = ("--ray", c.address, "--ray-replica-resources", _REPLICA)
    with _serve("--model", str(model), "--dp", "2", *args) as (url, _):
        assert [_greedy(url, p) for p in prompts] == local
        replicas = _replicas(url)
        nodes = {r["node_id"] for r in replicas}
        assert len(nodes) == 2 and all(r["state"] == "ready" for r in replicas)
        ray.init(address=c.address, log_to_driver=False)
        try:  # Ray says the same of where they run
            actors = _actors()
            alive = {node for node, state in actors.values() if state == "ALIVE"}
            assert alive == nodes and {r["actor_id"] for r in replicas} <= set(actors)
        finally:
            ray.shutdown()


async def _stream(url: str, i: int, tokens: int, seen: list[int]) -> dict[str, Any]:
    """A streamed /generate of ``tokens`` forced tokens: which replica ran it
    (``meta_info.dp_rank``), the tokens seen, its error event if any, and whether
    ``[DONE]`` ended it."""
    body = {"input_ids": [20 + i, 30 + i, 40], "stream": True,
            "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}}  # fmt: skip
    out: dict[str, Any] = {"rank": None, "error": None, "done": False}
    async with httpx.AsyncClient(timeout=120) as client:
        async with client.stream("POST", url + "/generate", json=body) as r:
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    out["done"] = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        out["error"] = event["error"]
                        continue
                    out["rank"] = event["meta_info"].get("dp_rank", out["rank"])
                    seen[i] = len(event["output_ids"])
    out["tokens"] = seen[i]
    return out


def test_a_node_removed_mid_stream_loses_only_its_replicas_requests(
    cluster: tuple[Cluster, list[Any]], model: pathlib.Path
) -> None:
    """The node of one replica is removed while six streams run on the two: that
    replica's streams end with an error event then [DONE], the other's complete whole;
    Ray recreates the replica on the third node and the server routes to it again,
    within RECOVERY_S."""
    recovery_s = 90.0  # Ray notices a dead node (seconds), the worker loads a tiny model
    c, nodes = cluster
    args = ("--ray", c.address, "--ray-replica-resources", _REPLICA,
            "--router-policy", "round_robin")  # fmt: skip
    try:
        with _serve("--model", str(model), "--dp", "2", *args) as (url, _):
            before = _replicas(url)
            workers = {n.node_id: n for n in nodes}  # the head node is not removed
            victim = next(r for r in before if r["node_id"] in workers)
            other = next(r for r in before if r is not victim)
            n, tokens = 6, 240
            seen = [0] * n

            async def run() -> list[dict[str, Any]]:
                results: list[dict[str, Any]] = []

                async def one(i: int) -> None:
                    results.append(await _stream(url, i, tokens, seen))

                async with anyio.create_task_group() as tg:
                    for i in range(n):
                        tg.start_soon(one, i)
                    while min(seen) < 5:  # every stream is under way
                        await anyio.sleep(0.02)
                    await anyio.to_thread.run_sync(c.remove_node, workers[victim["node_id"]])
                return results

            removed_at = time.monotonic()
            results = anyio.run(run)
            lost = [r for r in results if r["rank"] == victim["index"]]
            kept = [r for r in results if r["rank"] == other["index"]]
            assert lost and kept and len(lost) + len(kept) == n, results
            for r in kept:
                assert r["done"] and r["error"] is None and r["tokens"] == tokens, r
            for r in lost:  # an error event, then [DONE]
                assert r["done"] and r["error"] is not None and r["tokens"] < tokens, r
                assert r["error"]["code"] == 503, r
            deadline = removed_at + recovery_s
            while True:
                assert time.monotonic() < deadline, _replicas(url)
                now = _replicas(url)
                back = now[victim["index"]]
                if back["state"] == "ready" and back["node_id"] not in (
                    victim["node_id"],
                    other["node_id"],
                ):
                    break
                time.sleep(0.5)
            print(f"replica recreated and ready {time.monotonic() - removed_at:.1f} s after")
            assert now[other["index"]]["node_id"] == other["node_id"]  # left alone
            for i in range(4):  # both replicas serve again
                assert len(_greedy(url, f"after {i}")) == 8
            picks = httpx.get(url + "/server_info").json()["router"]["picks"]
            assert all(p > 0 for p in picks), picks
    finally:
        c.add_node(node_ip_address="127.0.0.1", num_cpus=2, resources={"replica": 1})


def test_the_frontend_owns_its_replicas(
    cluster: tuple[Cluster, list[Any]], model: pathlib.Path
) -> None:
    """Stopped (SIGTERM: drained, then its replicas killed) or killed outright (Ray ends
    an owner's actors, and each worker dies with its actor): no replica outlives its
    frontend by more than OWNED_S."""
    owned_s = 30.0
    c, _ = cluster
    args = ("--ray", c.address, "--ray-replica-resources", _REPLICA)
    ray.init(address=c.address, log_to_driver=False)
    try:
        for how in ("terminate", "kill"):
            with _serve("--model", str(model), "--dp", "2", *args) as (url, proc):
                ids = {r["actor_id"] for r in _replicas(url)}
                pids = [r["pid"] for r in _replicas(url)]
                assert {a for a, (_, s) in _actors().items() if s == "ALIVE"} >= ids
                getattr(proc, how)()
                proc.wait(60)
            deadline = time.monotonic() + owned_s
            while any(_actors().get(a, ("", "DEAD"))[1] != "DEAD" for a in ids) or any(
                _alive(p) for p in pids
            ):
                assert time.monotonic() < deadline, (how, _actors(), pids)
                time.sleep(0.2)
    finally:
        ray.shutdown()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not pathlib.Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
