"""Tensor parallelism for the worker (``--tp K``): K ranks under ``torch.distributed``.

Every rank loads its shard (``load_model(rank=, world=)``: its slices of the file, the
decoder built with its parallel linears, ``gpu/model/shard.py`` and ``linear.py``). Rank 0
is the worker as ever (socket, ``Engine``, scheduler, sampling); ranks 1..K-1 are
processes it spawns that hold no socket and run rank 0's steps on the same
``ModelRunner`` over their own shard and KV cache. The step is one value
(``StepInput``: its rows, their layout, its KV copies): rank 0's runner broadcasts it
before running it (``Followers``), a follower's runs what it receives (``follow``), and
every rank then joins the same collectives in the same order.

Messages go over a gloo group (the default group on CPU, a second one beside NCCL on
CUDA), as JSON: the runner's ``EngineConfig`` once, then each step, then stop. Followers
run under ``wire.child`` (``PR_SET_PDEATHSIG``), so they die with rank 0, which spawns
them from its main thread (the signal follows the thread that forked) and reaps them on
shutdown; a follower that exits early takes rank 0 down, as does a rank that fails
inside a step: a group out of step cannot recover.

``python -m gpu.parallel.tp`` is a follower's entry point (its rank, the world, the store,
the model and its device in ``LIFECYCLE_TP``; spawned by ``start_leader``, never by hand).
"""

from __future__ import annotations

from gpu.kernels.cpu_runtime import tune_cpu_runtime

_CPU_TUNING = tune_cpu_runtime()  # before torch loads libgomp (a follower's main module)

import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from gpu.cache.kv_cache import PrefillChunk  # noqa: E402
from gpu.model.loader import LoadedModel, load_model, resolve_device  # noqa: E402
from gpu.model.shard import shard_plan  # noqa: E402
from gpu.runtime.engine import Engine  # noqa: E402
from gpu.runtime.engine_config import EngineConfig  # noqa: E402
from gpu.runtime.runner import ModelRunner, StepInput  # noqa: E402
from modelfile.gguf_file import default_model_path  # noqa: E402
from modelfile.layer_spec import refusal, spec_of  # noqa: E402
from modelfile.source import model_parts, open_model  # noqa: E402
from wire.child import SUPERVISED  # noqa: E402

__all__ = [
    "Channel",
    "Followers",
    "decode_step",
    "encode_step",
    "follow",
    "graphs_under_tp",
    "main",
    "start_leader",
    "stop_leader",
]

log = logging.getLogger("gpu.parallel.tp")

HEADER = 4096  # bytes per broadcast header: a decode step's whole message fits in one
_LEN = 8  # the header's first bytes: the message's length
_NO_TIMEOUT = datetime.timedelta(days=365)  # followers wait for rank 0's next step
_JOIN_TIMEOUT = datetime.timedelta(minutes=5)
_ENV = "LIFECYCLE_TP"  # a follower's rank and what it loads, as JSON


def encode_step(step: StepInput) -> list[Any]:
    """What a follower needs of a step (JSON): its rows, their layout, its KV copies.
    Rows an overlapped step fills on the device are read here (the followers' ids)."""
    ids = step.ids
    if step.future is not None:
        rows, src, tokens = step.future
        ids, got = list(ids), tokens.tolist()
        for row, i in zip(rows, src, strict=True):
            ids[row] = got[i]
    prefills = [(list(c.block_table), c.start, c.n) for c in step.prefills]
    return [ids, step.pos, step.decodes, prefills, step.logit_rows, step.want_hidden,
            step.all_sampled_decodes, step.copies]  # fmt: skip


def decode_step(fields: list[Any]) -> StepInput:
    ids, pos, decodes, prefills, logit_rows, want_hidden, all_sampled, copies = fields
    return StepInput(
        ids, pos, [(t, n) for t, n in decodes], [PrefillChunk(*c) for c in prefills],
        logit_rows, want_hidden, all_sampled, None, [(s, d, n) for s, d, n in copies],
    )  # fmt: skip


class Channel:
    """Rank 0 -> followers: JSON messages over the control group. The header carries the
    length and the first bytes; a longer message sends the rest after it."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    def send(self, message: list[Any]) -> None:
        data = json.dumps(message).encode()
        framed = len(data).to_bytes(_LEN, "little") + data
        head = bytearray(framed[:HEADER].ljust(HEADER, b"\0"))
        dist.broadcast(torch.frombuffer(head, dtype=torch.uint8), 0, self.group)
        if len(framed) > HEADER:
            rest = bytearray(framed[HEADER:])
            dist.broadcast(torch.frombuffer(rest, dtype=torch.uint8), 0, self.group)

    def receive(self) -> list[Any]:
        head = torch.empty(HEADER, dtype=torch.uint8)
        dist.broadcast(head, 0, self.group)
        raw = head.numpy().tobytes()
        n = int.from_bytes(raw[:_LEN], "little")
        if _LEN + n > HEADER:
            rest = torch.empty(_LEN + n - HEADER, dtype=torch.uint8)
            dist.broadcast(rest, 0, self.group)
            raw += rest.numpy().tobytes()
        message: list[Any] = json.loads(raw[_LEN : _LEN + n])
        return message


@contextlib.contextmanager
def _in_step() -> Iterator[None]:
    """A rank that fails inside a step has left its group out of step, for good: the
    process exits (rank 0 takes the followers with it; a follower, rank 0)."""
    try:
        yield
    except Exception:
        log.critical("tensor-parallel rank failed inside a step: exiting", exc_info=True)
        logging.shutdown()
        os._exit(1)


class Followers:
    """Rank 0's handle on the other ranks: their processes and the message channel.
    Called with a step (the runner's ``followers``), it broadcasts it and holds the
    context rank 0 runs it in."""

    def __init__(self, procs: list[subprocess.Popen[bytes]], channel: Channel) -> None:
        self.procs = procs
        self.channel = channel
        self.closing = False
        for rank, proc in enumerate(procs, start=1):
            threading.Thread(
                target=self._watch, args=(rank, proc), daemon=True, name=f"tp-rank-{rank}"
            ).start()

    def start(self, config: EngineConfig, max_context: int) -> None:
        """The followers make the runner rank 0's engine made (its cache of the same
        number and size of blocks)."""
        self.channel.send(["runner", dataclasses.asdict(config), max_context])

    @contextlib.contextmanager
    def __call__(self, step: StepInput) -> Iterator[None]:
        with _in_step():
            self.channel.send(["step", encode_step(step)])
            yield

    def _watch(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        if not self.closing:
            log.critical("tensor-parallel rank %d exited (code %s): the worker exits", rank, code)
            logging.shutdown()
            os._exit(1)

    def close(self, timeout: float = 10.0) -> None:
        """Tell the followers to stop and reap them (killed after ``timeout`` seconds)."""
        self.closing = True
        with contextlib.suppress(RuntimeError):  # a follower is gone: the wait reaps the rest
            self.channel.send(["stop"])
        for proc in self.procs:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        dist.destroy_process_group()


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


def _load_shard(path: str, dev: str, dt: str, world: int, rank: int) -> LoadedModel:
    lm = load_model(path, device=dev, dtype=dt, weights="fp32", rank=rank, world=world)
    log.info("tensor parallel: rank %d of %d holds %s", rank, world, lm.model.plan)
    return lm


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
    """Rank 0: spawn ranks 1..world-1, load its shard, join the group. Its engine takes
    the ``Followers`` (``Engine(followers=)``), then ``Followers.start`` tells them its
    runner.

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
    job = {"world": world, "port": store.port, "model": path, "device": device, "dtype": dtype,
           "threads": threads or 1}  # fmt: skip
    cmd = [sys.executable, "-m", "wire.child", SUPERVISED, "gpu.parallel.tp"]
    procs = [
        subprocess.Popen(cmd, env={**os.environ, _ENV: json.dumps({**job, "rank": rank})})
        for rank in range(1, world)
    ]
    followers = Followers(procs, Channel(None))
    loaded = _load_shard(path, dev, dt, world, 0)  # shards are fp32 slices
    followers.channel.group = _join(store, 0, world, dev)
    return loaded, followers


def graphs_under_tp(mode: str) -> str:
    """The decode-graph mode of a tensor-parallel engine: decode graphs
    (``gpu/backends/graphs.py``) capture a step's kernels, not the ranks' collectives:
    ``auto`` turns them off, asking for them is refused."""
    if mode not in ("auto", "off"):
        raise ValueError(f"--tp does not run with --decode-graphs {mode}")
    if mode == "auto":
        log.info("tensor parallel: decode graphs off (every step runs the ranks' collectives)")
    return "off"


def stop_leader(engine: Engine) -> None:
    """Stop and reap the followers of a tensor-parallel engine (nothing otherwise)."""
    if isinstance(engine.runner.followers, Followers):
        engine.runner.followers.close()


@torch.inference_mode()
def follow(lm: LoadedModel, channel: Channel) -> None:
    """A follower's loop: make rank 0's runner, run its steps until it says stop."""
    runner = None
    while True:
        kind, *args = channel.receive()
        if kind == "stop":
            return
        if kind == "runner":
            runner = ModelRunner(lm, EngineConfig(**args[0]), args[1])
            continue
        assert runner is not None, "rank 0 sends its runner first"
        with _in_step():
            runner.run(decode_step(args[0]))


def main() -> int:
    job = json.loads(os.environ[_ENV])
    rank, world = job["rank"], job["world"]
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s worker rank {rank} %(levelname)s %(message)s"
    )
    _set_threads(job["threads"])
    dev, dt = _rank_device(job["device"] or None, job["dtype"] or None, rank)
    store = dist.TCPStore("127.0.0.1", job["port"], world, is_master=False, timeout=_JOIN_TIMEOUT)
    loaded = _load_shard(job["model"], dev, dt, world, rank)
    follow(loaded, Channel(_join(store, rank, world, dev)))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as gpu/worker/process.py: no interpreter teardown under native thread pools
