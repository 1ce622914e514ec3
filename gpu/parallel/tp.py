"""Tensor parallelism for the worker (``--tp K``): K ranks under ``torch.distributed``.

Rank 0 is the worker as ever (socket, ``Engine``, scheduler, sampling) with a model
shard (``gpu/parallel/tp_model.py``); ranks 1..K-1 are processes it spawns that hold no socket and
follow its schedule. The seam is what the engine already calls: its model (``trunk``,
``logits``) and its cache (``prepare``, ``copy_block``, ``copy_rows``). On rank 0 the
cache ops are queued; each model call broadcasts the queue plus itself as one message of
ints, then joins the collectives; a follower applies the same ops to its own shard and
KV cache in the same order. Engine and scheduler are unchanged.

Messages go over a gloo group (the default group on CPU, a second one beside NCCL on
CUDA). Followers run under ``wire.child`` (``PR_SET_PDEATHSIG``), so they die
with rank 0, which spawns them from its main thread (the signal follows the thread that
forked) and reaps them on shutdown; a follower that exits early takes rank 0 down, as
a group out of step cannot recover.

``python -m gpu.parallel.tp`` is a follower's entry point (rank, world and store in the
environment; spawned by ``start_leader``, never by hand).
"""

from __future__ import annotations

from gpu.kernels.cpu_runtime import tune_cpu_runtime

_CPU_TUNING = tune_cpu_runtime()  # before torch loads libgomp (a follower's main module)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from functools import partial  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from gpu.cache.kv_cache import PagedKVCache, PrefillChunk  # noqa: E402
from gpu.model.loader import LoadedModel, load_model, resolve_device  # noqa: E402
from gpu.parallel.tp_messages import (  # noqa: E402
    CacheSpec,
    CopyBlock,
    CopyRows,
    Forward,
    Logits,
    Prepare,
    Stop,
    decode_ops,
    encode_cache,
    encode_copy_block,
    encode_copy_rows,
    encode_prepare,
    encode_stop,
)
from gpu.parallel.tp_model import ShardedLlama, ShardLoad, shard_plan  # noqa: E402
from gpu.runtime.engine import Engine  # noqa: E402
from modelfile.gguf_file import default_model_path  # noqa: E402
from modelfile.layer_spec import refusal, spec_of  # noqa: E402
from modelfile.source import model_parts, open_model  # noqa: E402
from wire.child import SUPERVISED  # noqa: E402

__all__ = [
    "Channel",
    "Followers",
    "LeaderCache",
    "follow",
    "graphs_under_tp",
    "leader_cache",
    "main",
    "start_leader",
    "stop_leader",
]

log = logging.getLogger("gpu.parallel.tp")

HEADER = 256  # ints per broadcast header: a decode step's whole message fits in one
_NO_TIMEOUT = datetime.timedelta(days=365)  # followers wait for rank 0's next step
_JOIN_TIMEOUT = datetime.timedelta(minutes=5)
_ENV_RANK, _ENV_WORLD, _ENV_STORE = "LIFECYCLE_TP_RANK", "LIFECYCLE_TP_WORLD", "LIFECYCLE_TP_STORE"


class Channel:
    """Rank 0 -> followers: int64 messages over the control group. The header carries the
    length and the first ``HEADER - 1`` ints; a longer message sends the rest after it."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    def send(self, ints: list[int]) -> None:
        n = len(ints)
        head = ints[: HEADER - 1]
        dist.broadcast(torch.tensor([n, *head, *[0] * (HEADER - 1 - len(head))]), 0, self.group)
        if n > HEADER - 1:
            dist.broadcast(torch.tensor(ints[HEADER - 1 :], dtype=torch.int64), 0, self.group)

    def receive(self) -> list[int]:
        head = torch.empty(HEADER, dtype=torch.int64)
        dist.broadcast(head, 0, self.group)
        n = int(head[0])
        ints = head[1 : 1 + min(n, HEADER - 1)].tolist()
        if n > HEADER - 1:
            rest = torch.empty(n - (HEADER - 1), dtype=torch.int64)
            dist.broadcast(rest, 0, self.group)
            ints += rest.tolist()
        return ints


class Followers:
    """Rank 0's handle on the other ranks: their processes and the message channel.

    Cache ops are queued; ``announce`` sends the queue and a model call in one message,
    just before rank 0 joins that call's collectives.
    """

    def __init__(self, procs: list[subprocess.Popen[bytes]], channel: Channel) -> None:
        self.procs = procs
        self.channel = channel
        self.pending: list[int] = []
        self.closing = False
        for rank, proc in enumerate(procs, start=1):
            threading.Thread(
                target=self._watch, args=(rank, proc), daemon=True, name=f"tp-rank-{rank}"
            ).start()

    def queue(self, ints: list[int]) -> None:
        self.pending += ints

    def announce(self, ints: list[int]) -> None:
        message, self.pending = self.pending + ints, []
        self.channel.send(message)

    def _watch(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        if not self.closing:
            log.critical("tensor-parallel rank %d exited (code %s): the worker exits", rank, code)
            logging.shutdown()
            os._exit(1)

    def close(self, timeout: float = 10.0) -> None:
        """Tell the followers to stop and reap them (killed after ``timeout`` seconds)."""
        self.closing = True
        try:
            self.announce(encode_stop())
        except RuntimeError:  # a follower is already gone: the wait below reaps the rest
            pass
        for proc in self.procs:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        dist.destroy_process_group()


class LeaderCache(PagedKVCache):
    """Rank 0's ``PagedKVCache``: each op is applied here and queued for the followers,
    which make theirs, of the same number and size of blocks, when it is made."""

    def __init__(self, followers: Followers, *args: Any, **kwargs: Any) -> None:
        """``PagedKVCache``'s arguments after ``followers``."""
        super().__init__(*args, **kwargs)
        self.followers = followers
        followers.announce(encode_cache(self.num_blocks, self.block_size))

    def prepare(
        self, decodes: Sequence[tuple[Sequence[int], int]], prefills: Sequence[PrefillChunk]
    ) -> None:
        self.followers.queue(encode_prepare(decodes, prefills))
        super().prepare(decodes, prefills)

    def copy_block(self, src: int, dst: int) -> None:
        self.followers.queue(encode_copy_block(src, dst))
        super().copy_block(src, dst)

    def copy_rows(self, src: int, dst: int, n: int) -> None:
        self.followers.queue(encode_copy_rows(src, dst, n))
        super().copy_rows(src, dst, n)

    def use_layout(self, layout: object) -> None:
        raise RuntimeError("a layout built outside prepare() cannot be told to the followers")


def _rank_device(device: str | None, dtype: str | None, rank: int) -> tuple[str, str]:
    """Each rank's own CUDA device (``cuda:RANK``); the CPU is shared."""
    dev, dt = resolve_device(device, dtype)
    if dev.type == "cuda":
        dev = torch.device("cuda", rank if dev.index is None else dev.index + rank)
        torch.cuda.set_device(dev)
    return str(dev), str(dt).removeprefix("torch.")


def _join(store: dist.Store, rank: int, world: int, device: str) -> dist.ProcessGroup | None:
    """Join the process group; returns the control group (None: the default one)."""
    cuda = device.startswith("cuda")
    dist.init_process_group(
        "nccl" if cuda else "gloo", store=store, rank=rank, world_size=world, timeout=_NO_TIMEOUT
    )
    return dist.new_group(backend="gloo", timeout=_NO_TIMEOUT) if cuda else None


def _load_shard(
    path: str, dev: str, dt: str, world: int, rank: int, followers: Followers | None = None
) -> LoadedModel:
    """Rank ``rank``'s shard, read from the file as its slices (``ShardLoad``); rank 0's
    announces each model call to ``followers``."""
    shard = ShardLoad(world, rank)
    lm = load_model(path, device=dev, dtype=dt, weights="fp32", shard=shard)
    announce = None if followers is None else followers.announce
    with torch.inference_mode():
        model = shard.model(lm.model, None, announce)
    model.eval()
    return dataclasses.replace(lm, config=model.config, model=model)


def _set_threads(threads: int | None) -> None:
    # Several ranks share the CPU: one torch thread each unless told otherwise.
    torch.set_num_threads(threads or 1)
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank is on this host


def start_leader(
    world: int,
    model_path: str | None,
    device: str | None,
    dtype: str | None,
    threads: int | None,
) -> tuple[LoadedModel, Followers]:
    """Rank 0: spawn ranks 1..world-1, load and shard the model, join the group.

    Refuses a ``world`` above the model's KV heads before anything starts. Call from the
    main thread (the followers' death signal follows the thread that spawned them).
    """
    path = str(model_path or default_model_path())
    config = model_parts(open_model(path))[2]
    shard_plan(config, world, 0)
    if (why := refusal("tp", spec_of(config))) is not None:
        raise ValueError(why)
    _set_threads(threads)
    dev, dt = _rank_device(device, dtype, 0)
    store = dist.TCPStore(
        "127.0.0.1", 0, world, is_master=True, timeout=_JOIN_TIMEOUT, wait_for_workers=False
    )
    args = ["--model", path, "--device", device or "", "--dtype", dtype or ""]
    args += ["--threads", str(threads or 1)]
    procs = []
    for rank in range(1, world):
        env = {**os.environ, _ENV_RANK: str(rank), _ENV_WORLD: str(world)}
        env[_ENV_STORE] = f"127.0.0.1:{store.port}"
        cmd = [sys.executable, "-m", "wire.child", SUPERVISED, "gpu.parallel.tp", *args]
        procs.append(subprocess.Popen(cmd, env=env))
    followers = Followers(procs, Channel(None))
    loaded = _load_shard(path, dev, dt, world, 0, followers)  # shards are fp32 slices
    followers.channel.group = _join(store, 0, world, dev)
    assert isinstance(loaded.model, ShardedLlama)
    log.info("tensor parallel: rank 0 of %d holds %s", world, loaded.model.plan)
    return loaded, followers


def leader_cache(followers: Followers) -> Callable[..., PagedKVCache]:
    """What a tensor-parallel engine makes its cache with (``Engine``'s ``cache_type``):
    a ``LeaderCache`` of ``followers``, so that every cache op reaches them, and the
    scheduler's hook on it too."""
    return partial(LeaderCache, followers)


def graphs_under_tp(mode: str) -> str:
    """The decode-graph mode of a tensor-parallel engine: decode graphs
    (``gpu/backends/graphs.py``) replay a step without calling the model, so the followers would
    never hear of it: ``auto`` turns them off, asking for them is refused."""
    if mode not in ("auto", "off"):
        raise ValueError(f"--tp does not run with --decode-graphs {mode}")
    if mode == "auto":
        log.info("tensor parallel: decode graphs off (every step is announced to the followers)")
    return "off"


def stop_leader(engine: Engine) -> None:
    """Stop and reap the followers of a tensor-parallel engine (nothing otherwise)."""
    if isinstance(engine.cache, LeaderCache):
        engine.cache.followers.close()


@torch.inference_mode()
def follow(lm: LoadedModel, channel: Channel) -> None:
    """A follower's loop: apply rank 0's ops to this shard until it says stop."""
    model, cache, x = lm.model, None, None
    dev = lm.device
    while True:
        for op in decode_ops(channel.receive()):
            if isinstance(op, Stop):
                return
            if isinstance(op, CacheSpec):
                cache = PagedKVCache(lm.config, op.kv_blocks, op.block_size, dev, lm.dtype)
                continue
            assert cache is not None, "rank 0 sends the cache's size first"
            if isinstance(op, Prepare):
                cache.prepare(op.decodes, op.prefills)
            elif isinstance(op, CopyBlock):
                cache.copy_block(op.src, op.dst)
            elif isinstance(op, CopyRows):
                cache.copy_rows(op.src, op.dst, op.n)
            elif isinstance(op, Forward):
                ids = torch.tensor(op.ids, dtype=torch.int64, device=dev)
                pos = torch.tensor(op.positions, dtype=torch.int64, device=dev)
                x = model.trunk(ids, pos, cache)
            elif isinstance(op, Logits):
                assert x is not None, "logits before any forward"
                model.logits(x, torch.tensor(op.rows, dtype=torch.int64, device=dev))


def main(argv: list[str] | None = None) -> int:
    rank, world = int(os.environ[_ENV_RANK]), int(os.environ[_ENV_WORLD])
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s worker rank {rank} %(levelname)s %(message)s"
    )
    p = argparse.ArgumentParser(
        prog="python -m gpu.parallel.tp", description=__doc__.splitlines()[0]
    )
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="")
    p.add_argument("--dtype", default="")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    _set_threads(a.threads)
    dev, dt = _rank_device(a.device or None, a.dtype or None, rank)
    host, port = os.environ[_ENV_STORE].rsplit(":", 1)
    store = dist.TCPStore(host, int(port), world, is_master=False, timeout=_JOIN_TIMEOUT)
    loaded = _load_shard(a.model, dev, dt, world, rank)
    control = _join(store, rank, world, dev)
    assert isinstance(loaded.model, ShardedLlama)
    log.info("tensor parallel: rank %d of %d holds %s", rank, world, loaded.model.plan)
    follow(loaded, Channel(control))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as gpu/worker/process.py: no interpreter teardown under native thread pools
