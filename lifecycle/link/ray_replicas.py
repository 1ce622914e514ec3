"""Worker replicas placed and kept alive by Ray (``lifecycle serve --ray``; issue 58).

Each of ``--dp N`` replicas is a Ray actor (``_Replica``) that asks for the resources a
replica needs (``--ray-replica-resources``; by default one GPU where the cluster has
GPUs, else one CPU), spread across the nodes. On its node the actor runs today's worker
process (``python -m wire.child gpu.worker --listen tcp:NODE_IP:PORT``: the worker dies
with its actor) with a fresh per-deployment token, and reports where it listens. The
frontend keeps one ``Supervisor`` per replica as for a remote worker (``--worker``),
except that the address is asked of the actor before each connection
(``SupervisorConfig.locate``): when a replica's process or node dies, Ray recreates the
actor (``max_restarts=-1``; on another node when its node is gone), the connection's
loss ends only the requests that replica held (``worker_lost``), and the supervisor
reconnects to the new address and routes to it once it is ready again.

The count changes at run time (``scale``: ``POST /replicas``; ``--ray-autoscale``, from
the queue, ``lifecycle.link.autoscale``): a new replica is placed and its supervisor
joins the pool, routed to once ready; one fewer is drained first (the router no longer
picks it, the requests it holds finish whole), then its supervisor stopped and its
actor killed. With ``--tp N`` a replica's N ranks are one placement group of N bundles
on one node, removed with the replica.

The frontend owns its replicas: they are not detached, so a frontend that dies takes
them with it (Ray ends an owner's actors), and on its stop they are killed after the
drain. ``RayWorkers`` is the ``WorkerPool`` of those supervisors that also starts and
ends the replicas. ``ray`` is imported only here, and only when ``--ray`` is given.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import anyio
import anyio.abc

from lifecycle.link.autoscale import TICK_S, AutoscaleConfig, Autoscaler
from lifecycle.link.pool import REMOVED, Router, WorkerPool, held
from lifecycle.link.supervisor import Supervisor, SupervisorConfig

__all__ = ["REPLICAS_LIMIT", "RayConfig", "RayWorkers", "replica_resources"]

log = logging.getLogger("lifecycle.link.ray_replicas")

LOCATE_TIMEOUT = 5.0  # seconds one ask of an actor's address may take (then asked again)
REPLICAS_LIMIT = 64  # the most replicas ``/replicas`` asks for without --ray-autoscale
PLACE_RETRY_S = 2.0  # after Ray refused to create a replica's actor


@dataclass(frozen=True, slots=True)
class RayConfig:
    """``--ray ADDRESS`` (``local``: a cluster of this machine alone, started here;
    ``auto``: ``RAY_ADDRESS`` or the cluster running here), the replicas at start, the
    resources each asks for (None: one GPU where the cluster has GPUs, else one CPU),
    the worker's command-line options, its ``--tp`` (each rank one bundle of those
    resources, on one node), and ``--ray-autoscale``'s policy (None: the count changes
    only by ``/replicas``)."""

    address: str
    replicas: int
    resources: dict[str, float] | None = None
    worker_module: str = "gpu.worker"
    worker_args: tuple[str, ...] = ()
    tp: int = 1
    autoscale: AutoscaleConfig | None = None
    token: str = field(default_factory=lambda: secrets.token_hex(16))


def replica_resources(text: str | None) -> dict[str, float] | None:
    """``--ray-replica-resources``: a JSON object of Ray resources (``{"GPU": 1}``,
    ``{"CPU": 4, "replica": 1}``); ValueError for anything else."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--ray-replica-resources: not JSON: {exc}") from None
    if (
        not isinstance(value, dict)
        or not value
        or not all(
            isinstance(k, str) and isinstance(v, int | float) and v > 0 for k, v in value.items()
        )
    ):
        raise ValueError(
            '--ray-replica-resources must be a JSON object of positive amounts, e.g. {"GPU": 1}'
        )
    return {k: float(v) for k, v in value.items()}


class _Replica:
    """The Ray actor of one replica: its worker process on this node (module docstring).
    Recreated by Ray with the same arguments when it dies, and it dies with its worker:
    a worker that exits unasked (a crash, the OOM killer) takes its actor with it, so
    Ray starts both again instead of keeping an actor whose worker is gone."""

    def __init__(self, module: str, args: Sequence[str], token: str) -> None:
        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket() as s:  # a free port on the node's address
            s.bind((host, 0))
            port = s.getsockname()[1]
        self.address = f"tcp:{host}:{port}"
        env = {**os.environ, "LIFECYCLE_WORKER_TOKEN": token}
        argv = [sys.executable, "-m", "wire.child", module, "--listen", self.address, *args]
        self.proc = subprocess.Popen(argv, env=env)  # noqa: S603 - our own worker
        ctx = ray.get_runtime_context()
        self.node_id, self.actor_id = ctx.get_node_id(), ctx.get_actor_id()
        self._stopping = False
        threading.Thread(target=self._watch, name="worker-watch", daemon=True).start()

    def _watch(self) -> None:
        status = self.proc.wait()
        if not self._stopping:
            print(f"replica worker exited with {status}: ending its actor", file=sys.stderr)
            os._exit(1)  # a crash to Ray, which recreates the actor (max_restarts=-1)

    def where(self) -> dict[str, Any]:
        """Where its worker listens, on which node, and whether the process runs."""
        return {
            "address": self.address,
            "node_id": self.node_id,
            "actor_id": self.actor_id,
            "pid": self.proc.pid,
            "running": self.proc.poll() is None,
        }

    def stop(self) -> None:
        self._stopping = True
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class RayWorkers(WorkerPool):
    """The replicas' supervisors, routed as any ``--dp`` pool; ``run`` first connects to
    the cluster and places the replicas, then keeps their count at the one wanted
    (``scale``, ``--ray-autoscale``); ``stop`` ends them after the supervisors."""

    def __init__(self, ray_config: RayConfig, sup_config: SupervisorConfig, router: Router) -> None:
        self.ray_config = ray_config
        self._sup_config = sup_config
        n = ray_config.replicas
        self._actors: list[Any] = []  # by index; None once removed
        self._groups: list[Any] = []  # each replica's placement group (--tp > 1), else None
        self._where: list[dict[str, Any]] = [{} for _ in range(n)]
        self._resources: dict[str, float] = {}  # what each replica (each bundle) asks for
        self._target = n  # the replicas wanted
        self._placed = anyio.Event()
        self._wake = anyio.Event()  # the count wanted changed
        auto = ray_config.autoscale
        self._autoscaler = Autoscaler(auto) if auto is not None else None
        super().__init__([self._member(i) for i in range(n)], router)

    def _member(self, i: int) -> Supervisor:
        token, locate = self.ray_config.token, self._locator(i)
        return Supervisor(replace(self._sup_config, worker=f"ray:{i}", token=token, locate=locate))

    def _locator(self, i: int) -> Any:
        async def locate() -> str:
            await self._placed.wait()
            while True:  # a replica Ray recreates answers once its actor runs again
                try:
                    where = await anyio.to_thread.run_sync(self._ask, i)
                except Exception as exc:  # the actor is restarting, or its node is gone
                    log.info("replica %d: waiting for Ray to place it (%s)", i, _short(exc))
                    await anyio.sleep(0.5)
                    continue
                self._where[i] = where
                if where["running"]:
                    return str(where["address"])
                await anyio.sleep(0.5)  # its worker ended: Ray is about to recreate it

        return locate

    def _ask(self, i: int) -> dict[str, Any]:
        import ray

        return dict(ray.get(self._actors[i].where.remote(), timeout=LOCATE_TIMEOUT))

    # -- scaling -----------------------------------------------------------------------------
    def scale(self, count: int) -> None:
        """Ask for ``count`` replicas (``POST /replicas``): new ones are placed and routed
        to once ready, surplus ones drained then removed (``_keep_count``). ValueError
        for a count outside 1..REPLICAS_LIMIT, or outside ``--ray-autoscale``'s bounds."""
        auto = self.ray_config.autoscale
        low, high = (auto.low, auto.high) if auto is not None else (1, REPLICAS_LIMIT)
        if not low <= count <= high:
            bounds = f" (--ray-autoscale {low}:{high})" if auto is not None else ""
            raise ValueError(f"count must be an integer from {low} to {high}{bounds}, got {count}")
        log.info("ray: %d replicas wanted (were %d)", count, self._target)
        self._target = count
        self._wake.set()

    def scaling(self) -> dict[str, Any]:
        """``/replicas``: the count wanted, the autoscale bounds, and each replica not
        removed (``replicas``: draining ones too)."""
        auto = self.ray_config.autoscale
        return {
            "count": self._target,
            "autoscale": {"min": auto.low, "max": auto.high} if auto is not None else None,
            "replicas": [r for r in self.replicas() if r["state"] != REMOVED],
        }

    async def _keep_count(self, tg: anyio.abc.TaskGroup) -> None:
        """The live replicas brought to the count wanted, one at a time: one placed and
        joined, or one drained and removed in the background (``_retire``)."""
        while True:
            self._wake = anyio.Event()
            live = self.live
            if len(live) < self._target:
                if not await self._grow():
                    return
            elif len(live) > self._target:
                # not ready first (it holds nothing), then the least held, the newest
                i = min(live, key=lambda m: (m[1].ready, _held(m[1]), -m[0]))[0]
                self.drain(i)
                tg.start_soon(self._retire, i)
            else:
                await self._wake.wait()

    async def _grow(self) -> bool:
        """One more replica placed and its supervisor joined; False once the pool stops."""
        try:
            actor, group = await anyio.to_thread.run_sync(self._new_actor)
        except Exception as exc:  # the cluster refused it (lost, resources malformed)
            log.error("ray: placing a replica failed, trying again: %s", _short(exc))
            await anyio.sleep(PLACE_RETRY_S)
            return True
        i = len(self.members)
        self._actors.append(actor)
        self._groups.append(group)
        self._where.append({})
        try:
            self.add(self._member(i))
        except RuntimeError:  # stopping: ``_end`` removes what was placed
            return False
        log.info("ray: replica %d placed (%d wanted)", i, self._target)
        return True

    async def _retire(self, i: int) -> None:
        t0 = anyio.current_time()
        await self.remove(i)  # drained: what it held finished whole
        drained = anyio.current_time() - t0
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self._end_one, i)
        log.info(
            "ray: replica %d drained in %.1fs and removed (%d wanted)", i, drained, self._target
        )

    async def _autoscale(self, autoscaler: Autoscaler) -> None:
        while True:
            await anyio.sleep(TICK_S)
            ready = [s.client for _, s in self.live if s.ready and s.client is not None]
            loads = [held(c) for c in ready]
            running = min((int(c.capacity.get("max_running", 1)) for c in ready), default=1)
            want = autoscaler.target(anyio.current_time(), self._target, loads, running)
            if want != self._target:
                log.info("ray autoscale: %d -> %d replicas (held: %s)", self._target, want, loads)
                self._target = want
                self._wake.set()

    # -- lifecycle ---------------------------------------------------------------------------
    async def run(self) -> None:
        try:
            await anyio.to_thread.run_sync(self._place)
            self._placed.set()
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._run_pool, tg.cancel_scope)
                tg.start_soon(self._keep_count, tg)
                if self._autoscaler is not None:
                    tg.start_soon(self._autoscale, self._autoscaler)
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._end)

    async def _run_pool(self, scope: anyio.CancelScope) -> None:
        await WorkerPool.run(self)
        scope.cancel()  # the pool stopped: no more scaling

    def _place(self) -> None:
        import ray

        cfg = self.ray_config
        if not ray.is_initialized():
            if cfg.address == "local":  # this machine alone, on loopback, no dashboard
                ray.init(
                    _node_ip_address="127.0.0.1", include_dashboard=False,
                    log_to_driver=False, configure_logging=False,
                )  # fmt: skip
            else:
                ray.init(address=cfg.address, log_to_driver=False, configure_logging=False)
        resources = cfg.resources
        if resources is None:
            has_gpus = ray.cluster_resources().get("GPU", 0) > 0
            resources = {"GPU": 1.0} if has_gpus else {"CPU": 1.0}
        self._resources = resources
        for _ in range(cfg.replicas):
            actor, group = self._new_actor()
            self._actors.append(actor)
            self._groups.append(group)
        per = f"{cfg.tp} bundles of {resources} on one node" if cfg.tp > 1 else resources
        log.info("ray: %d replicas asking for %s each", cfg.replicas, per)

    def _new_actor(self) -> tuple[Any, Any]:
        """One replica's actor, SPREAD across the nodes; with ``--tp N`` (N > 1) in a
        placement group of N bundles on one node (STRICT_PACK), the actor in the first:
        its worker's ranks run beside it on that node. Returns (actor, group or None)."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cfg, resources = self.ray_config, self._resources
        group, strategy = None, "SPREAD"  # type: tuple[Any, Any]
        if cfg.tp > 1:
            group = placement_group([dict(resources)] * cfg.tp, strategy="STRICT_PACK")
            strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)
        custom = {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}
        actor = ray.remote(_Replica).options(
            num_cpus=resources.get("CPU", 0), num_gpus=resources.get("GPU", 0),
            resources=custom, max_restarts=-1, max_task_retries=0,
            scheduling_strategy=strategy,
        )  # fmt: skip
        return actor.remote(cfg.worker_module, list(cfg.worker_args), cfg.token), group

    def _end(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        for i in range(len(self._actors)):
            self._end_one(i)

    def _end_one(self, i: int) -> None:
        """Replica ``i``'s worker stopped, its actor killed, its placement group removed."""
        import ray

        actor, group = self._actors[i], self._groups[i]
        self._actors[i] = self._groups[i] = None
        if actor is not None:
            try:
                ray.get(actor.stop.remote(), timeout=15)
            except Exception as exc:  # gone already: Ray ends it below either way
                log.debug("ray: replica %d did not stop: %s", i, _short(exc))
            ray.kill(actor)
        if group is not None:
            try:
                ray.util.remove_placement_group(group)
            except Exception as exc:  # removed with its job already
                log.debug("ray: replica %d's placement group: %s", i, _short(exc))

    def member_name(self, index: int) -> str:
        """The replica's address and its Ray node (what a trace records)."""
        node = self._where[index].get("node_id")
        name = super().member_name(index)
        return f"{name} on ray node {node}" if node else name

    def replicas(self) -> list[dict[str, Any]]:
        """Each replica as ``/server_info`` shows it, by index (a removed one too, its
        state ``removed``): where its worker listens, its Ray node and actor (as its
        actor last said), its placement group (``--tp`` > 1), and its state."""
        out = []
        for i, (w, m) in enumerate(zip(self._where, self.members, strict=True)):
            one = {"index": i, **w, "state": self.state(i), "restarts": m.restarts}
            group = self._groups[i] if i < len(self._groups) else None
            if group is not None:
                one["placement_group"] = group.id.hex()
            out.append(one)
        return out


def _held(s: Supervisor) -> int:
    return held(s.client) if s.client is not None else 0


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:160]
