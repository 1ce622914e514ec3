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
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import anyio

from lifecycle.link.pool import Router, WorkerPool
from lifecycle.link.supervisor import Supervisor, SupervisorConfig

__all__ = ["RayConfig", "RayWorkers", "replica_resources"]

log = logging.getLogger("lifecycle.link.ray_replicas")

LOCATE_TIMEOUT = 5.0  # seconds one ask of an actor's address may take (then asked again)


@dataclass(frozen=True, slots=True)
class RayConfig:
    """``--ray ADDRESS`` (``local``: a cluster of this machine alone, started here;
    ``auto``: ``RAY_ADDRESS`` or the cluster running here), the replicas, the resources
    each asks for (None: one GPU where the cluster has GPUs, else one CPU), and the
    worker's command-line options."""

    address: str
    replicas: int
    resources: dict[str, float] | None = None
    worker_module: str = "gpu.worker"
    worker_args: tuple[str, ...] = ()
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
    Recreated by Ray with the same arguments when it dies."""

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
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class RayWorkers(WorkerPool):
    """The replicas' supervisors, routed as any ``--dp`` pool; ``run`` first connects to
    the cluster and places the replicas, ``stop`` ends them after the supervisors."""

    def __init__(self, ray_config: RayConfig, sup_config: SupervisorConfig, router: Router) -> None:
        self.ray_config = ray_config
        self._actors: list[Any] = []
        self._where: list[dict[str, Any]] = [{} for _ in range(ray_config.replicas)]
        self._placed = anyio.Event()
        members = [
            Supervisor(
                replace(
                    sup_config, worker=f"ray:{i}", token=ray_config.token, locate=self._locator(i)
                )
            )  # fmt: skip
            for i in range(ray_config.replicas)
        ]
        super().__init__(members, router)

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
                return str(where["address"])

        return locate

    def _ask(self, i: int) -> dict[str, Any]:
        import ray

        return dict(ray.get(self._actors[i].where.remote(), timeout=LOCATE_TIMEOUT))

    # -- lifecycle ---------------------------------------------------------------------------
    async def run(self) -> None:
        try:
            await anyio.to_thread.run_sync(self._place)
            self._placed.set()
            await super().run()
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._end)

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
        custom = {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}
        actor = ray.remote(_Replica).options(
            num_cpus=resources.get("CPU", 0), num_gpus=resources.get("GPU", 0),
            resources=custom, max_restarts=-1, max_task_retries=0,
            scheduling_strategy="SPREAD",
        )  # fmt: skip
        args = (cfg.worker_module, list(cfg.worker_args), cfg.token)
        self._actors = [actor.remote(*args) for _ in range(cfg.replicas)]
        log.info("ray: %d replicas asking for %s each", cfg.replicas, resources)

    def _end(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        for actor in self._actors:
            try:
                ray.get(actor.stop.remote(), timeout=15)
            except Exception as exc:  # gone already: Ray ends it below either way
                log.debug("ray: a replica did not stop: %s", _short(exc))
            ray.kill(actor)
        self._actors = []

    def member_name(self, index: int) -> str:
        """The replica's address and its Ray node (what a trace records)."""
        node = self._where[index].get("node_id")
        name = super().member_name(index)
        return f"{name} on ray node {node}" if node else name

    def replicas(self) -> list[dict[str, Any]]:
        """Each replica as ``/server_info`` shows it: where its worker listens, its Ray
        node and actor (as its actor last said), and its supervisor's state."""
        return [
            {"index": i, **w, "state": m.status, "restarts": m.restarts}
            for i, (w, m) in enumerate(zip(self._where, self.members, strict=True))
        ]


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:160]
