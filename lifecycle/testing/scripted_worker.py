"""A scripted worker: a real process speaking the real wire protocol, with instant outputs.

It stands in for ``gpu.worker`` where a test or a benchmark needs a peer whose timing and
faults are under control and whose outputs are known in advance. It runs no model: each
sample echoes its prompt ids cyclically, one token per step (sample ``i`` of an n > 1
request starts ``i`` tokens further on), so the expected output of any request is a pure
function of its prompt. An embed request (options ``"embed"``) ends in its first step
with a vector that is a pure function of its prompt ids, its pooling and ``normalize``
(``scripted_embedding``), of the ``hidden_size`` its HELLO advertises. A thinking budget
(options ``"reasoning_budget"``) replaces echoed ids by the forced end as the model's
worker does (``wire.BudgetState``). It keeps worker-like books (waiting and running
queues, KV blocks held per sequence) so the frontend's release guarantees can be checked
through STATS.

Several frontends may connect at once (``serve --frontends N``), as to ``gpu.worker``;
each connection is served by scripted books of its own (the same configuration each),
so what one frontend does or leaves behind never touches another's requests.

With no ``--step-delay`` its steps cost nothing, as an infinitely fast model's would: up to
``--burst`` (16) of them run back to back and their STEP frames go out in one write, one
frame per step as always. ``--burst 1`` writes each step on its own, as a model's steps
come; a step delay implies it.

    python -m lifecycle.testing.scripted_worker --listen unix:/tmp/w.sock [--step-delay 0.01] [--burst 16] ...
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import anyio

import wire
from lifecycle.link.wire_stream import FrameStream, parse_address, serve
from wire.faults import fault_point
from wire.worker_options import DEFAULT_BLOCK_SIZE, DEFAULT_MAX_PENDING, DEFAULT_MAX_RUNNING

__all__ = ["ScriptConfig", "ScriptedWorker", "main", "scripted_embedding"]


@dataclass(frozen=True, slots=True)
class ScriptConfig:
    listen: str = "unix:/tmp/lifecycle-scripted.sock"
    step_delay: float = 0.0  # seconds per scheduler step
    burst: int = 16  # undelayed steps run back to back and sent in one write
    prefill_delay: float = 0.0  # extra seconds in the step that admits a sequence
    # > 0: a prompt is prefilled in chunks of this many tokens, one step each (each
    # costing ``prefill_delay``); a step that only prefills sends an empty STEP, as the
    # model's worker does
    prefill_chunk: int = 0
    max_running: int = DEFAULT_MAX_RUNNING  # the model worker's defaults
    max_pending: int = DEFAULT_MAX_PENDING
    kv_blocks: int = 4096
    block_size: int = DEFAULT_BLOCK_SIZE
    vocab_size: int = 49152
    context_length: int = 8192
    eos_id: int = 2
    hidden_size: int = 576  # the length of an embed request's vector
    die_after_steps: int = 0  # > 0: the process exits abruptly after that many steps
    hang_after_steps: int = 0  # > 0: the step loop stops for good (probes still answered)
    startup_delay: float = 0.0


@dataclass(slots=True)
class _Seq:
    rid: int
    prompt: list[int]
    offset: int  # sample index: where the echo starts
    max_new: int
    stop_ids: frozenset[int]
    options: wire.RequestOptions
    blocks: int = 0
    generated: int = 0
    started: bool = False
    aborted: bool = False
    chunks_left: int = 0  # prefill steps still to run before the first token
    out: list[int] = field(default_factory=list)
    budget: wire.BudgetState | None = None  # a thinking budget: its end forced, as the worker's


class ScriptedWorker:
    def __init__(self, config: ScriptConfig) -> None:
        self.config = config
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.free_blocks = config.kv_blocks
        self.steps = 0
        self.step_stats = wire.StepStats()
        self._wake = anyio.Event()
        self._errors: list[tuple[int, str, str]] = []
        self._unsent: set[int] = set()  # rids ended in a frame not written yet

    # -- books ------------------------------------------------------------------------
    def load(self) -> dict[str, Any]:
        held = sum(s.blocks for s in self.running)
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "kv_blocks_total": self.config.kv_blocks,
            "kv_blocks_free": self.free_blocks,
            "integrity_ok": held + self.free_blocks == self.config.kv_blocks,
            "steps": self.steps,
        }

    def hello(self) -> wire.Hello:
        c = self.config
        model = {
            "name": "scripted",
            "path": "",
            "arch": "scripted",
            "vocab_size": c.vocab_size,
            "context_length": c.context_length,
            "eos_id": c.eos_id,
            "eog_ids": [c.eos_id],
            "device": "cpu",
            "dtype": "none",
            "pid": os.getpid(),
            "hidden_size": c.hidden_size,
        }
        capacity = {
            "max_running": c.max_running,
            "max_pending": c.max_pending,
            "kv_blocks": c.kv_blocks,
            "block_size": c.block_size,
            "max_context": c.context_length,
        }
        return wire.Hello(model, capacity)

    def reset(self) -> None:
        self.waiting.clear()
        self.running.clear()
        self.free_blocks = self.config.kv_blocks
        self._errors.clear()
        self._unsent.clear()

    def submit(self, frame: wire.Submit) -> None:
        c = self.config
        for e in frame.entries:
            prompt = wire.ids_to_list(e.prompt)
            s = e.sampling
            max_new = int(s.get("max_new_tokens", 128))
            n = int(s.get("n", 1))
            if not prompt or any(t < 0 or t >= c.vocab_size for t in prompt):
                self._errors += [
                    (e.rid + i, wire.ErrorCode.INVALID, "prompt ids out of range") for i in range(n)
                ]
                continue
            if len(prompt) + max_new > c.context_length:
                msg = f"{len(prompt) + max_new} tokens exceed the context of {c.context_length}"
                self._errors += [(e.rid + i, wire.ErrorCode.TOO_LONG, msg) for i in range(n)]
                continue
            need = math.ceil((len(prompt) + max_new) / c.block_size)
            if need > c.kv_blocks:  # could never be admitted: refuse now, never wait forever
                msg = f"{len(prompt) + max_new} tokens exceed the KV cache of {c.kv_blocks * c.block_size}"
                self._errors += [(e.rid + i, wire.ErrorCode.TOO_LONG, msg) for i in range(n)]
                continue
            try:  # the worker's own reading and bounds
                opts = wire.RequestOptions.from_wire(e.options, c.vocab_size, len(prompt))
            except ValueError as exc:
                self._errors += [(e.rid + i, wire.ErrorCode.INVALID, str(exc)) for i in range(n)]
                continue
            if opts.embed is not None:
                if n != 1:
                    self._errors += [
                        (e.rid + i, wire.ErrorCode.INVALID, "embed with n > 1") for i in range(n)
                    ]
                    continue
                self.waiting.append(_Seq(e.rid, prompt, 0, 0, frozenset(), opts))
                continue
            stops = set(s.get("stop_token_ids", ()))
            if not s.get("ignore_eos"):
                stops.add(c.eos_id)
            chunks = math.ceil(len(prompt) / c.prefill_chunk) - 1 if c.prefill_chunk else 0
            for i in range(n):
                seq = _Seq(e.rid + i, prompt, i, max_new, frozenset(stops), opts)
                seq.chunks_left = max(0, chunks)
                if opts.reasoning_budget is not None:
                    seq.budget = wire.BudgetState(opts.reasoning_budget)
                self.waiting.append(seq)
        self._wake.set()

    def abort(self, rids: list[int]) -> None:
        wanted = set(rids)
        for seq in (*self.waiting, *self.running):
            if seq.rid in wanted:
                seq.aborted = True
        self._wake.set()

    # -- one scheduler step -------------------------------------------------------------
    def _admit(self) -> bool:
        admitted = False
        bs = self.config.block_size
        while self.waiting and len(self.running) < self.config.max_running:
            seq = self.waiting[0]
            need = math.ceil((len(seq.prompt) + seq.max_new) / bs) if not seq.aborted else 0
            if need > self.free_blocks:
                break
            self.waiting.popleft()
            seq.blocks, self.free_blocks = need, self.free_blocks - need
            self.running.append(seq)
            admitted = True
        return admitted

    def _advance(self, seq: _Seq) -> wire.StepEntry | None:
        if seq.chunks_left and not seq.aborted:  # one more prompt chunk, no output yet
            seq.chunks_left -= 1
            return None
        extra: dict[str, Any] = {}
        if not seq.started:
            seq.started = True
            extra = {"prompt_tokens": len(seq.prompt), "cached_tokens": 0}
            _prompt_logprobs(seq, extra)
        if seq.aborted:
            return self._end(seq, [], [wire.Finish.ABORT, "aborted by request"], extra)
        if seq.options.embed is not None:
            vec = scripted_embedding(seq.prompt, seq.options.embed, self.config.hidden_size)
            extra["embedding"] = wire.pack_f32s(vec)
            return self._end(seq, [], [wire.Finish.EMBED, len(vec)], extra)
        if seq.max_new == 0:
            return self._end(seq, [], [wire.Finish.LENGTH, 0], extra)
        tok = seq.prompt[(seq.generated + seq.offset) % len(seq.prompt)]
        if seq.budget is not None:
            tok = seq.budget.next(tok)
        seq.generated += 1
        _token_logprobs(seq, tok, extra)
        if (f := fault_point("worker.sample", seq.rid)) is not None:
            _sample_fault(f.apply(), extra)
        if tok in seq.stop_ids:
            return self._end(seq, [tok], [wire.Finish.STOP, tok], extra)
        if seq.generated >= seq.max_new:
            return self._end(seq, [tok], [wire.Finish.LENGTH, seq.max_new], extra)
        return wire.StepEntry(seq.rid, wire.pack_ids([tok]), None, extra or None)

    def _end(
        self, seq: _Seq, ids: list[int], finish: list[Any], extra: dict[str, Any]
    ) -> wire.StepEntry:
        self.free_blocks += seq.blocks
        seq.blocks = 0
        extra["num_retractions"] = 0
        return wire.StepEntry(seq.rid, wire.pack_ids(ids), finish, extra)

    def step(self) -> wire.Step | None:
        t0 = time.perf_counter()
        # Aborted waiting sequences end without ever running.
        gone = [s for s in self.waiting if s.aborted]
        for s in gone:
            self.waiting.remove(s)
        entries = [self._end(s, [], [wire.Finish.ABORT, "aborted while waiting"], {}) for s in gone]
        self._admit()
        advanced = [(seq, self._advance(seq)) for seq in self.running]
        entries += [e for _, e in advanced if e is not None]
        self.running = [s for s, e in advanced if e is None or e.finish is None]
        if not entries and not advanced:
            return None
        self.steps += 1
        # As the model's worker counts its steps (the step delay is a sleep outside).
        self.step_stats.record(time.perf_counter() - t0, len(advanced), len(advanced))
        return wire.Step(self.steps, entries)

    def holds(self, rid: int) -> bool:
        """Whether ``rid`` is live here or its end is not written yet (AUDIT)."""
        if rid in self._unsent or any(e[0] == rid for e in self._errors):
            return True
        return any(s.rid == rid for s in (*self.waiting, *self.running))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._errors)

    async def step_loop(self, out: FrameStream) -> None:
        c = self.config
        while True:
            if not self.has_work():
                await self._wake.wait()
                self._wake = anyio.Event()
                continue
            if self._errors:
                errors, self._errors = self._errors, []
                ended = {e[0] for e in errors}
                self._unsent |= ended
                await out.send(wire.ReqError(errors))
                self._unsent -= ended
            if c.hang_after_steps and self.steps >= c.hang_after_steps:
                await anyio.sleep_forever()
            prefilling = self.waiting or any(s.chunks_left for s in self.running)
            delay = c.step_delay + (c.prefill_delay if prefilling else 0.0)
            await anyio.sleep(delay)  # with no delay, still a checkpoint: SUBMITs and ABORTs get in
            # Undelayed steps cost nothing, so up to `burst` of them run back to back and
            # go out in one write, as an instant model's would; a delayed step goes alone.
            frames: list[wire.Frame] = []
            for _ in range(max(1, c.burst) if delay == 0 else 1):
                if (f := fault_point("worker.forward")) is not None:
                    await f.apply_async()
                frame = self.step()
                if frame is None:
                    break
                frames.append(frame)
                self._unsent.update(e.rid for e in frame.entries if e.finish is not None)
                if c.die_after_steps and self.steps >= c.die_after_steps:
                    await out.send_many(frames)
                    os._exit(3)
                if c.hang_after_steps and self.steps >= c.hang_after_steps:
                    break
            if frames:
                await out.send_many(frames)
            self._unsent.clear()

    # -- one frontend connection --------------------------------------------------------
    async def serve_connection(self, out: FrameStream) -> None:
        await out.send(self.hello())
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.step_loop, out)
            try:
                while True:
                    frame = await out.receive()
                    if not await self._handle(frame, out):
                        break
            except anyio.EndOfStream:
                pass
            except (wire.WireError, ValueError) as exc:
                await out.send(wire.Fatal(str(exc)))
            tg.cancel_scope.cancel()
        self.reset()

    async def _handle(self, frame: Any, out: FrameStream) -> bool:
        match frame:
            case wire.Submit():
                self.submit(frame)
            case wire.Abort(rids):
                self.abort(rids)
            case wire.Probe(nonce):
                await out.send(wire.ProbeReply(nonce, self.load()))
            case wire.StatsReq(nonce):
                await out.send(wire.Stats(nonce, {**self.load(), **self.step_stats.to_wire()}))
            case wire.Audit(nonce, rids):
                await out.send(wire.AuditReply(nonce, [r for r in rids if not self.holds(r)]))
            case wire.Flush(nonce):
                await out.send(wire.FlushReply(nonce, True, "Cache flushed."))
            case wire.Shutdown():
                os._exit(0)
            case _:
                raise wire.WireError(f"unexpected frame {type(frame).__name__}")
        return True


def scripted_embedding(prompt: list[int], embed: wire.EmbedOptions, size: int) -> list[float]:
    """The scripted worker's embedding: position ``p`` of token ``t`` contributes
    ``sin(0.1 (j + 1)(t + 1) + 0.7 p)`` to component ``j``; last pooling takes the last
    position's, mean pooling the mean over every position."""

    def row(t: int, p: int) -> list[float]:
        return [math.sin(0.1 * (j + 1) * (t + 1) + 0.7 * p) for j in range(size)]

    if embed.pooling == "last":
        vec = row(prompt[-1], len(prompt) - 1)
    else:
        rows = [row(t, p) for p, t in enumerate(prompt)]
        vec = [sum(col) / len(prompt) for col in zip(*rows, strict=True)]
    if embed.normalize:
        norm = math.sqrt(sum(v * v for v in vec)) or 1.0
        vec = [v / norm for v in vec]
    return vec


def _token_logprobs(seq: _Seq, tok: int, extra: dict[str, Any]) -> None:
    o = seq.options
    if not o.return_logprob:
        return
    lp = -0.1 * (1 + seq.generated % 7)
    extra["logprobs"] = wire.pack_f32s([lp])
    k = o.top_logprobs_num
    if k:
        extra["top_ids"] = [wire.pack_ids([tok + i for i in range(k)])]
        extra["top_logprobs"] = [wire.pack_f32s([lp - i for i in range(k)])]
    if o.token_ids_logprob:
        extra["ids_logprobs"] = [wire.pack_f32s([-1.0] * len(o.token_ids_logprob))]


def _sample_fault(fault: Any, extra: dict[str, Any]) -> None:
    """corrupt: a logprob field of the wrong length; nan: a NaN logprob (what NaN logits give)."""
    if fault is None:
        return
    extra["logprobs"] = b"\x01\x02\x03" if fault.action == "corrupt" else wire.pack_f32s([math.nan])


def _prompt_logprobs(seq: _Seq, extra: dict[str, Any]) -> None:
    o = seq.options
    start = o.logprob_start_len
    if not o.return_logprob or start < 0 or start >= len(seq.prompt):
        return
    values = [-0.5] * (len(seq.prompt) - start)
    if start == 0:
        values[0] = math.nan
    extra["prompt_logprobs"] = wire.pack_f32s(values)


async def _serve(config: ScriptConfig) -> None:
    if (f := fault_point("worker.start")) is not None:
        await f.apply_async()
    address = parse_address(config.listen)
    if address.kind == "unix" and os.path.exists(address.path):
        os.unlink(address.path)
    # As gpu.worker: it listens first, then "loads" (--startup-delay) before its HELLO.
    loaded = anyio.Event()

    async def load() -> None:
        await anyio.sleep(config.startup_delay)
        loaded.set()

    async def handle(out: FrameStream) -> None:
        await loaded.wait()
        try:
            await ScriptedWorker(config).serve_connection(out)
        except* (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            # That frontend is gone (a write to it failed): its books go with it, and the
            # other frontends' connections go on (it used to end the whole process).
            pass
        finally:
            await out.aclose()

    async with anyio.create_task_group() as tg:
        tg.start_soon(load)
        await serve(address, handle, side="worker")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lifecycle.testing.scripted_worker", description=__doc__)
    p.add_argument("--listen", required=True)
    for name in ScriptConfig.__dataclass_fields__:
        if name == "listen":
            continue
        default = getattr(ScriptConfig(), name)
        p.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    args = p.parse_args(argv)
    config = ScriptConfig(**vars(args))
    try:
        anyio.run(_serve, config)
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
