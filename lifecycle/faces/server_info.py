"""``/server_info`` without HTTP: the server's arguments, its books and each worker's
state, as the route (``lifecycle/api/native.py``) and ``Engine.server_info`` answer it.
"""

from __future__ import annotations

import os
from typing import Any

from lifecycle.core.frontend import Frontend
from lifecycle.core.ports import ObservedWorker, RayReplicas

__all__ = ["server_state"]


async def server_state(fe: Frontend, server_args: dict[str, Any]) -> dict[str, Any]:
    """``/server_info``: the server's arguments, its books, each worker's state, and the
    same for its model in ``models`` (a list of one: with several models, the
    ``ModelRouter`` lists every model's there, the first's at top level)."""
    sup = fe.supervisor
    states = [await _worker_state(member) for member in sup.members]
    cap: dict[str, Any] = next((s["capacity"] for s in states if "capacity" in s), {})
    blocks, block = cap.get("kv_blocks"), cap.get("block_size")
    out = {
        **server_args,
        # the keys SGLang clients read (page_size: the KV block's tokens)
        "max_total_num_tokens": blocks * block if blocks and block else None,  # per worker
        "max_running_requests": cap.get("max_running"),
        "page_size": block,
        "context_length": fe.model_config.context_length,
        "version": _version(),
        "status": sup.status,
        "frontend_pid": os.getpid(),  # with --frontends N, which one answered
        "live_requests": len(fe.registry),
        "tombstones": fe.registry.tombstones,
        "requests_by_state": fe.registry.counts_by_state(),
        "admission": {"depth": fe.admission.depth, "capacity": fe.admission.capacity},
        "received_requests": fe.registry.received,
        "finished_requests": fe.registry.finished,
        "failed_requests": dict(fe.registry.failed),
        "internal_states": states,
    }
    out["models"] = [
        {
            "model": server_args.get("served_model_name"),
            "model_path": server_args.get("model_path"),
            # "loaded" once it serves, else its supervisor's status (starting, unloaded...)
            "state": "loaded" if sup.ready else sup.status,
            "context_length": out["context_length"],
            **{k: out[k] for k in _MODEL_BOOKS},
            "workers": states,
        }
    ]
    if isinstance(sup, RayReplicas):  # --ray: each replica's node, actor and state
        out["ray_replicas"] = sup.replicas()
    router = getattr(sup, "router", None)
    if router is not None:  # several workers (--dp)
        out["router"] = {"policy": router.policy, "picks": list(router.picks),
                         "affinity_hits": router.affinity_hits,
                         "indexed_blocks": router.indexed_blocks}  # fmt: skip
    return out


# What /server_info's top level says of its model that each ``models`` entry repeats.
_MODEL_BOOKS = (
    "live_requests", "tombstones", "requests_by_state", "admission", "received_requests",
    "finished_requests", "failed_requests",
)  # fmt: skip


async def _worker_state(sup: ObservedWorker) -> dict[str, Any]:
    state: dict[str, Any] = {"pid": sup.worker_pid, **sup.info()}
    client = sup.client
    if client is not None:
        try:
            load = await client.stats(timeout=2.0)
            state.update(
                {
                    k: load.get(k)
                    for k in ("running", "waiting", "kv_blocks_total", "kv_blocks_free")
                }
            )
            if "memory" in load:  # the worker's RSS split, measured for this STATS
                state["memory"] = load["memory"]
            state["worker_load"] = load
        except (TimeoutError, ConnectionError) as exc:
            state["stats_error"] = str(exc) or type(exc).__name__
        state.update(
            in_flight=client.in_flight,
            dispatch_queue=client.queued,
            capacity=client.capacity,
            model=client.model,  # the HELLO's model card: what `trace replay` compares
        )
    return state


def _version() -> str:
    from lifecycle.core.version import __version__

    return __version__
