"""Workers placed, restarted, scaled and owned by Ray (issue 58;
lifecycle/link/ray_replicas.py), on a real local Ray cluster of three nodes
(``ray.cluster_utils.Cluster``), each with one ``replica`` resource and two CPUs, every
node on the loopback address and no dashboard.

A replica asks for ``{"replica": 1}``, so at most one runs on a node: Ray's own state
(the actors' node ids) says where each is."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import time
from collections.abc import AsyncIterator, Iterator
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
        for r in (httpx.get(url + "/replicas"), httpx.post(url + "/replicas", json={"count": 3})):
            assert r.status_code == 400 and "--ray" in r.json()["error"]["message"], r.text
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
        # A replica's worker killed alone: its actor ends with it, Ray recreates both,
        # and the replica serves again (a new worker process), within 60 s.
        os.kill(replicas[0]["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not (
            (now := _replicas(url)[0])["state"] == "ready" and now["pid"] != replicas[0]["pid"]
        ):
            assert time.monotonic() < deadline, now
            time.sleep(0.2)
        assert [_greedy(url, p) for p in prompts] == local


async def _stream(url: str, i: int, tokens: int, seen: list[int]) -> dict[str, Any]:
    """A streamed /generate of ``tokens`` forced tokens: which replica ran it
    (``meta_info.dp_rank``), the tokens seen, its error event if any, and whether
    ``[DONE]`` ended it."""
    body = {"input_ids": [20 + i, 30 + i, 40], "stream": True,
            "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}}  # fmt: skip
    out: dict[str, Any] = {"rank": None, "error": None, "done": False}
    async with httpx.AsyncClient(timeout=120) as client:
        async with client.stream("POST", url + "/generate", json=body) as r:
            async for line in _sse_lines(r):
                if line == b"data: [DONE]":
                    out["done"] = True
                elif line.startswith(b"data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        out["error"] = event["error"]
                        continue
                    out["rank"] = event["meta_info"].get("dp_rank", out["rank"])
                    seen[i] = len(event["output_ids"])
    out["tokens"] = seen[i]
    return out


async def _sse_lines(r: httpx.Response) -> AsyncIterator[bytes]:
    """The stream's lines split at b"\\n" only: a token's text may hold U+2028 or
    U+0085, which JSON leaves as they are and ``aiter_lines`` would split at."""
    buf = b""
    async for chunk in r.aiter_bytes():
        *lines, buf = (buf + chunk).split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r")


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


# -- scaled at run time (POST /replicas, --ray-autoscale) and --tp inside a replica ------


def _scaling(url: str) -> dict[str, Any]:
    r = httpx.get(url + "/replicas", timeout=10)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _scale(url: str, count: int) -> dict[str, Any]:
    r = httpx.post(url + "/replicas", json={"count": count}, timeout=10)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _settled(s: dict[str, Any], n: int) -> bool:
    """``n`` replicas listed (none draining), every one ready."""
    return len(s["replicas"]) == n and all(r["state"] == "ready" for r in s["replicas"])


class _Traffic:
    """``lanes`` streams at a time, each of ``tokens`` forced tokens, one after another
    on every lane until ``stop``; ``results``: each stream's (``_stream``), ``states``:
    every replica state ``/replicas`` showed meanwhile (``watch``)."""

    def __init__(self, url: str, lanes: int, tokens: int) -> None:
        self.url, self.lanes, self.tokens = url, lanes, tokens
        self.results: list[dict[str, Any]] = []
        self.states: set[str] = set()

    async def run(self, scenario: Any) -> None:
        self.stop = anyio.Event()
        seen = [0] * self.lanes

        async def lane(i: int) -> None:
            while not self.stop.is_set():
                self.results.append(await _stream(self.url, i, self.tokens, seen))

        async with anyio.create_task_group() as tg:
            for i in range(self.lanes):
                tg.start_soon(lane, i)
            try:
                await scenario(self)
            finally:
                self.stop.set()

    async def until(self, check: Any, bound_s: float) -> dict[str, Any]:
        """``/replicas`` read until ``check`` holds of it, within ``bound_s``."""
        deadline = time.monotonic() + bound_s
        while True:
            s = await anyio.to_thread.run_sync(_scaling, self.url)
            self.states |= {r["state"] for r in s["replicas"]}
            if check(s):
                return s
            assert time.monotonic() < deadline, s
            await anyio.sleep(0.02)

    def whole(self) -> set[int]:
        """Every stream completed whole; the replicas that served them."""
        assert self.results
        for r in self.results:
            assert r["done"] and r["error"] is None and r["tokens"] == self.tokens, r
        return {r["rank"] for r in self.results}


def _idle_and_free(url: str, bound_s: float) -> dict[str, Any]:
    """/server_info once nothing is live and every replica left holds all its KV
    blocks free, within ``bound_s``."""
    deadline = time.monotonic() + bound_s
    while True:
        info = httpx.get(url + "/server_info", timeout=10).json()
        left = [r["index"] for r in info["ray_replicas"] if r["state"] != "removed"]
        states = [info["internal_states"][i] for i in left]
        if info["live_requests"] == 0 and all(
            s.get("kv_blocks_free") == s.get("kv_blocks_total") is not None for s in states
        ):
            return dict(info)
        assert time.monotonic() < deadline, info
        time.sleep(0.05)


def test_scaled_2_3_1_through_the_admin_route_under_traffic(
    cluster: tuple[Cluster, list[Any]], model: pathlib.Path
) -> None:
    """Streams run throughout: scaled up, the third replica is placed on the free node
    and served once ready; scaled down to one, two replicas are drained (what they hold
    finishes whole) and removed. No stream is cut, every KV block of the replica left is
    free, Ray lists the removed replicas' actors dead, within BOUND_S of each change."""
    bound_s = 60.0
    c, _ = cluster
    args = ("--ray", c.address, "--ray-replica-resources", _REPLICA,
            "--router-policy", "round_robin")  # fmt: skip
    with _serve("--model", str(model), "--dp", "2", *args) as (url, _):
        for bad in (0, 65, "2"):  # a count outside 1..64, or not an integer
            r = httpx.post(url + "/replicas", json={"count": bad})
            assert r.status_code == 400 and "count" in r.json()["error"]["message"], r.text
        traffic = _Traffic(url, lanes=6, tokens=48)  # two a replica: each holds some
        seen: dict[str, Any] = {}

        async def scenario(t: _Traffic) -> None:
            assert (await anyio.to_thread.run_sync(_scale, url, 3))["count"] == 3
            seen["three"] = await t.until(lambda s: _settled(s, 3), bound_s)
            while not any(r["rank"] == 2 for r in t.results):  # routed to once ready
                await anyio.sleep(0.05)
            assert (await anyio.to_thread.run_sync(_scale, url, 1))["count"] == 1
            seen["one"] = await t.until(lambda s: _settled(s, 1), bound_s)

        anyio.run(traffic.run, scenario)
        # Nothing cut while two replicas that held streams (six lanes, round robin) left:
        # they were drained first. (Seeing "draining" in a poll of /replicas is a race
        # with how fast the drain ends: not asserted.)
        assert traffic.whole() == {0, 1, 2}
        three = seen["three"]["replicas"]
        assert len({r["node_id"] for r in three}) == 3  # one per node (one "replica" each)
        (kept,) = seen["one"]["replicas"]
        info = _idle_and_free(url, bound_s)
        states = [r["state"] for r in info["ray_replicas"]]
        assert states.count("removed") == 2 and states[kept["index"]] == "ready", states
        assert all(p > 0 for p in info["router"]["picks"]), info["router"]
        gone = {r["actor_id"] for r in three} - {kept["actor_id"]}
        ray.init(address=c.address, log_to_driver=False)
        try:
            deadline = time.monotonic() + bound_s
            while any(_actors().get(a, ("", "DEAD"))[1] != "DEAD" for a in gone):
                assert time.monotonic() < deadline, _actors()
                time.sleep(0.2)
        finally:
            ray.shutdown()


def test_autoscaled_on_the_queue(cluster: tuple[Cluster, list[Any]], model: pathlib.Path) -> None:
    """--ray-autoscale 1:2 with short waits: more streams than a replica runs at once
    add the second replica; idle again, it is drained and removed. No stream is cut."""
    bound_s = 60.0
    c, _ = cluster
    args = ("--ray", c.address, "--ray-replica-resources", _REPLICA,
            "--ray-autoscale", "1:2", "--ray-autoscale-after", "0.5:2")  # fmt: skip
    with _serve("--model", str(model), *args) as (url, _):
        start = _scaling(url)
        assert start["count"] == 1 and start["autoscale"] == {"min": 1, "max": 2}, start
        r = httpx.post(url + "/replicas", json={"count": 3})  # outside the bounds
        assert r.status_code == 400 and "--ray-autoscale 1:2" in r.json()["error"]["message"]
        traffic = _Traffic(url, lanes=10, tokens=64)  # 4 run at once: 6 queued

        async def scenario(t: _Traffic) -> None:
            await t.until(lambda s: s["count"] == 2 and _settled(s, 2), bound_s)
            t.stop.set()
            await t.until(lambda s: s["count"] == 1 and _settled(s, 1), bound_s)

        anyio.run(traffic.run, scenario)
        traffic.whole()
        _idle_and_free(url, bound_s)


def test_a_tp2_replica_is_one_placement_group_on_one_node(
    cluster: tuple[Cluster, list[Any]], model: pathlib.Path
) -> None:
    """--tp 2: the replica's two ranks are one STRICT_PACK placement group of two
    bundles of its resources, both on its node (Ray's placement group table says so);
    it gives the tokens of a local --tp 2, and its group is removed with the server."""
    c, _ = cluster
    prompts = [f"split {i}" for i in range(3)]
    with _serve("--model", str(model), "--tp", "2") as (url, _):
        local = [_greedy(url, p) for p in prompts]
    args = ("--ray", c.address, "--ray-replica-resources", '{"CPU": 1}')
    ray.init(address=c.address, log_to_driver=False)
    try:
        with _serve("--model", str(model), "--tp", "2", *args) as (url, _):
            assert [_greedy(url, p) for p in prompts] == local
            (replica,) = _replicas(url)
            group = ray.util.placement_group_table()[replica["placement_group"]]
            assert group["strategy"] == "STRICT_PACK" and group["state"] == "CREATED", group
            assert list(group["bundles"].values()) == [{"CPU": 1.0}] * 2, group
            assert set(group["bundles_to_node_id"].values()) == {replica["node_id"]}, group
        deadline = time.monotonic() + 30
        while ray.util.placement_group_table()[replica["placement_group"]]["state"] != "REMOVED":
            assert time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        ray.shutdown()
