"""Scenarios: what a seed draws, and how it is played against a ``World``.

A seed draws a few connections (HTTP/1.1 keep-alive or pipelined, or one WebSocket with
several streams), each request's face, streaming, size and client behaviour, up to two
control actions at random virtual moments (``/abort_request`` by rid or ``abort_all``,
the app's drain, the worker's death) and at most one fault (a ``wire.faults`` rule or a
frame lost or duplicated on the worker link). The same seed also seeds the loop's
schedule, so ``play(seed)`` is one exact run.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import anyio
import orjson

from tests.dsim.clients import Answer, HttpClient, WsClient, request_bytes
from tests.dsim.world import World, WorldConfig
from wire.faults import FaultRule

__all__ = ["Conn", "Req", "Scenario", "draw"]

HTTP_FACES = ("native", "completions", "chat", "responses", "embeddings", "score")
WS_KINDS = ("generate", "completions", "chat")
STREAMING = frozenset({"native", "completions", "chat", "responses"})
BEHAVIOURS = ("read", "read", "read", "slow", "half_close", "leave", "leave_mid", "reset_mid")
CONTROLS = ("abort_rid", "abort_all", "drain", "kill_worker")
FAULTS = (
    "dispatch_drop", "tokenize_delay", "forward_delay", "forward_stall", "fe_send_drop",
    "fe_recv_corrupt", "worker_send_drop", "worker_recv_corrupt", "client_write_drop",
    "lose_frame", "dup_frame",
)  # fmt: skip
# A request whose client leaves before its end is this many times longer (at most 480
# tokens, about 1 virtual second of worker steps, within the worker's 512-token context):
# it runs on after the departure unless the departure aborts it (the ``released`` check).
LONG = 80
WORDS = ("alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "seven")
PATHS = {
    "native": "/generate",
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
    "responses": "/v1/responses",
    "embeddings": "/v1/embeddings",
    "score": "/v1/score",
}


@dataclass(frozen=True, slots=True)
class Req:
    label: str  # its rid (HTTP) or stream id (WebSocket)
    face: str
    stream: bool
    max_new: int
    prompt: tuple[int, ...]
    text: str
    oversized: str  # "" | "body" (over max_body_bytes) | "context" (over the context)
    behaviour: str
    leave_at: float  # leave: virtual seconds after sending; *_mid: body bytes read first
    cancel_at: float | None = None  # WebSocket: a cancel message this long after start

    def body(self) -> dict[str, Any]:
        f, n = self.face, self.max_new
        if f == "native" or f == "generate":
            b: dict[str, Any] = {"rid": self.label, "input_ids": list(self.prompt),
                                 "sampling_params": {"max_new_tokens": n, "temperature": 0}}  # fmt: skip
        elif f == "completions":
            b = {"model": "sim", "prompt": self.text, "max_tokens": n, "rid": self.label}
        elif f == "chat":
            msgs = [{"role": "user", "content": self.text}]
            b = {"model": "sim", "messages": msgs, "max_tokens": n, "rid": self.label}
        elif f == "responses":  # no rid on these two: "user" names the call (World)
            b = {"model": "sim", "input": self.text, "max_output_tokens": n, "user": self.label}
        elif f == "embeddings":
            b = {"model": "sim", "input": self.text, "user": self.label}
        else:
            b = {"model": "sim", "query": self.text, "items": ["alpha", "beta"],
                 "label_token_ids": [1, 2], "rid": self.label}  # fmt: skip
        if self.stream and f in STREAMING:
            b["stream"] = True
            if f in ("completions", "chat"):
                b["stream_options"] = {"include_usage": True}
        if self.oversized == "body":
            b["pad"] = "x" * (20 * 1024)
        elif self.oversized == "context":
            b["input_ids" if f == "native" else "prompt"] = [7] * 600
        return b


@dataclass(frozen=True, slots=True)
class Conn:
    name: str
    ws: bool
    pipelined: bool
    start: float
    slow: bool
    reqs: tuple[Req, ...]


@dataclass(frozen=True, slots=True)
class Scenario:
    seed: int
    conns: tuple[Conn, ...]
    controls: tuple[tuple[float, str, str], ...]  # (virtual time, action, rid)
    fault: str
    rules: tuple[FaultRule, ...]
    world: WorldConfig = field(default_factory=WorldConfig)
    reuse: bool = True  # end with a batch reusing every rid (else the registry is asked)

    @property
    def reqs(self) -> list[Req]:
        return [r for c in self.conns for r in c.reqs]

    def shape(self) -> tuple[Any, ...]:
        """What kind of scenario this is, for the coverage count."""
        kinds = sorted({("ws:" + r.face if c.ws else r.face) + ("+s" if r.stream else "")
                        + ("+" + r.oversized if r.oversized else "") for c in self.conns
                        for r in c.reqs})  # fmt: skip
        behaviours = sorted({r.behaviour for r in self.reqs})
        return (tuple(kinds), tuple(behaviours), tuple(sorted({c[1] for c in self.controls})),
                self.fault, any(c.pipelined for c in self.conns), self.world.prefill_delay)  # fmt: skip


def draw(seed: int) -> Scenario:
    r = random.Random(seed)
    conns = []
    labels = iter(f"r{i}" for i in range(100))
    for ci in range(r.choice((1, 1, 2, 2, 3))):
        ws = r.random() < 0.2
        reqs = []
        for _ in range(r.choice((1, 1, 2, 3) if not ws else (1, 2, 3))):
            face = r.choice(WS_KINDS) if ws else r.choice(HTTP_FACES)
            behaviour = r.choice(BEHAVIOURS)
            over = "" if ws or r.random() > 0.06 else r.choice(("body", "context"))
            plen = r.randint(1, 6)
            label = next(labels)
            stream = ws or (face in STREAMING and r.random() < 0.5)
            max_new = r.randint(1, 6)
            if behaviour == "leave" or (stream and behaviour in ("leave_mid", "reset_mid")):
                max_new *= LONG  # it outlives its client's departure unless it is aborted
            reqs.append(
                Req(
                    label=label,
                    face=face,
                    stream=stream,
                    max_new=max_new,
                    prompt=tuple(r.randint(10, 4000) for _ in range(plen)),
                    text=" ".join(r.choice(WORDS) for _ in range(plen)),
                    oversized=over,
                    behaviour=behaviour,
                    leave_at=r.uniform(0, 0.02) if behaviour == "leave" else r.randint(1, 400),
                    cancel_at=r.uniform(0, 0.02) if ws and r.random() < 0.3 else None,
                )
            )
        slow = r.random() < 0.15
        pipelined = not ws and len(reqs) > 1 and r.random() < 0.5
        conns.append(Conn(f"c{ci}", ws, pipelined, r.uniform(0, 0.01), slow, tuple(reqs)))
    all_reqs = [q for c in conns for q in c.reqs]
    controls = []
    for _ in range(r.choice((0, 0, 1, 1, 2))):
        action = r.choice(CONTROLS)
        rid = r.choice(all_reqs).label if action == "abort_rid" else ""
        controls.append((r.uniform(0, 0.03), action, rid))
    fault, rules, link = "none", [], None
    if r.random() < 0.35:
        fault = r.choice(FAULTS)
        nth = r.randint(1, 6)
        rules, link = _fault(fault, nth, r)
    if r.random() < 0.7 and fault != "tokenize_delay":  # tokenizing costs time, as it does
        rules.append(
            FaultRule("frontend.tokenize", "delay", times=0, delay=r.uniform(0.0005, 0.005))
        )
    # Now and then a prefill longer than the hung-worker timeout (chunks of four tokens,
    # 0.3 s each, against a 0.5 s timeout): progress the watchdog must see, not a hang
    # (issue 37 item 10). Not with slow steps as well: the clients' budget would not do.
    long_prefill = r.random() < 0.04 and fault != "forward_delay"
    world = WorldConfig(
        link=link,
        prefill_chunk=4 if long_prefill else r.choice((0, 0, 2)),
        prefill_delay=0.3 if long_prefill else 0.001,
        hung_timeout=0.5 if long_prefill else 3.0,
        audit_interval=0.25 if long_prefill else 1.0,
        drain_timeout=r.choice((0.02, 0.1, 2.0)),  # short ones cut requests still running
    )
    reuse = r.random() < 0.5  # half the seeds: a whole request costs ~15% of a scenario
    return Scenario(seed, tuple(conns), tuple(sorted(controls)), fault, tuple(rules), world, reuse)


def _fault(fault: str, nth: int, r: random.Random) -> tuple[list[FaultRule], Any]:
    one = {
        "dispatch_drop": ("frontend.dispatch", "drop", 0.0),
        "tokenize_delay": ("frontend.tokenize", "delay", r.uniform(0.001, 0.02)),
        "forward_delay": ("worker.forward", "delay", r.uniform(0.01, 0.2)),
        "forward_stall": ("worker.forward", "stall", 0.0),
        "fe_send_drop": ("frontend.frame_send", "drop", 0.0),
        "fe_recv_corrupt": ("frontend.frame_recv", "corrupt", 0.0),
        "worker_send_drop": ("worker.frame_send", "drop", 0.0),
        "worker_recv_corrupt": ("worker.frame_recv", "corrupt", 0.0),
        "client_write_drop": ("frontend.client_write", "drop", 0.0),
    }.get(fault)
    if one is not None:
        point, action, delay = one
        times = 0 if action == "delay" else 1
        return [FaultRule(point, action, nth=nth, times=times, delay=delay)], None
    direction = r.choice(("to_worker", "to_frontend"))
    return [], (direction, "lose" if fault == "lose_frame" else "dup", nth + 2)


# -- playing a scenario ---------------------------------------------------------------------
@dataclass(slots=True)
class Played:
    answers: dict[str, Answer] = field(default_factory=dict)
    sent: set[str] = field(default_factory=set)  # requests whose bytes all went out
    drained: bool = False
    killed: int = 0
    abort_status: list[int | None] = field(default_factory=list)
    hung: list[str] = field(default_factory=list)
    reuse: Answer | None = None


async def play_conn(world: World, conn: Conn, out: Played) -> None:
    await anyio.sleep(conn.start)
    end = world.connect(conn.name, capacity_out=512 if conn.slow else 1 << 20)
    chunk, pause = (256, 0.01) if conn.slow else (65536, 0.0)
    if conn.ws:
        await _play_ws(end, conn, out, chunk, pause)
    else:
        await _play_http(end, conn, out, chunk, pause)


async def _play_http(end: Any, conn: Conn, out: Played, chunk: int, pause: float) -> None:
    client = HttpClient(end, chunk, pause)
    reqs = list(conn.reqs)
    try:
        if conn.pipelined:
            data = b"".join(
                request_bytes("POST", PATHS[q.face], orjson.dumps(q.body())) for q in reqs
            )
            if await client.send(data):
                out.sent.update(q.label for q in reqs)
        for i, q in enumerate(reqs):
            answer = out.answers[q.label] = Answer(q.label)
            if not conn.pipelined:
                if not await client.send(
                    request_bytes("POST", PATHS[q.face], orjson.dumps(q.body()))
                ):
                    return
                out.sent.add(q.label)
            if q.behaviour == "half_close" and i == len(reqs) - 1:
                answer.left = True  # a FIN is how a client leaves: an answer is optional
                await end.send_eof()
            if q.behaviour == "leave":
                with anyio.move_on_after(q.leave_at):
                    await client.read_response(answer, "POST")
                if not answer.complete:
                    answer.left, answer.left_at = True, anyio.current_time()
                    await end.aclose()
                    return
                continue
            mid = int(q.leave_at) if q.behaviour in ("leave_mid", "reset_mid") else None
            await client.read_response(answer, "POST", leave_after=mid)
            if answer.left:
                if q.behaviour == "reset_mid":
                    end.reset()
                else:
                    await end.aclose()
                return
            if not answer.complete:
                return
    finally:
        await end.aclose()


async def _play_ws(end: Any, conn: Conn, out: Played, chunk: int, pause: float) -> None:
    ws = WsClient(end, chunk, pause)
    try:
        if not await ws.handshake():
            for q in conn.reqs:
                out.answers[q.label] = Answer(q.label, cut="handshake failed")
            return
        for q in conn.reqs:
            out.answers[q.label] = Answer(q.label, status=101)
            if await ws.send({"type": q.face, "id": q.label, "body": q.body()}):
                out.sent.add(q.label)
        kinds = {q.behaviour for q in conn.reqs}
        if "half_close" in kinds:  # a FIN after the messages: the client is leaving
            await end.send_eof()
        leave = min((q.leave_at for q in conn.reqs if q.behaviour == "leave"), default=None)
        # leave_mid / reset_mid: the socket goes after a few server messages
        after = min((int(q.leave_at) % 5 + 1 for q in conn.reqs if q.behaviour.endswith("_mid")),
                    default=None)  # fmt: skip
        cancels = [(q.cancel_at, q.label) for q in conn.reqs if q.cancel_at is not None]
        finished = False
        async with anyio.create_task_group() as tg:
            for at, label in cancels:
                tg.start_soon(_ws_cancel, ws, at, label)
            with anyio.move_on_after(leave if leave is not None else 1e9):
                finished = await _ws_read(ws, conn, out, after)
                tg.cancel_scope.cancel()
            tg.cancel_scope.cancel()
        if finished and "half_close" not in kinds:
            return
        for q in conn.reqs:  # left: what had not ended is the client's doing
            a = out.answers[q.label]
            if not a.complete:
                a.left, a.left_at = True, anyio.current_time()
        if "reset_mid" in kinds:
            end.reset()
    finally:
        await end.aclose()


async def _ws_cancel(ws: WsClient, at: float, label: str) -> None:
    await anyio.sleep(at)
    await ws.send({"type": "cancel", "id": label})


async def _ws_read(ws: WsClient, conn: Conn, out: Played, after: int | None) -> bool:
    """Read until every stream ended (True), the server closed, or ``after`` messages
    came and the client leaves (False)."""
    open_ids = {q.label for q in conn.reqs}
    seen = 0
    async for msg in ws.messages():
        a = out.answers.get(str(msg.get("id")))
        if a is None:
            continue
        a.events.append(msg)
        if msg.get("type") in ("done", "error"):
            a.complete = True
            open_ids.discard(a.label)
            if not open_ids:
                await ws.send_close()
                return True
        seen += 1
        if after is not None and seen >= after:
            return False
    for label in open_ids:
        a = out.answers[label]
        a.close_code = ws.close_code
        a.cut = "closed" if ws.close_code is None else f"close {ws.close_code}"
    return True


async def play_control(world: World, at: float, action: str, rid: str, out: Played) -> None:
    await anyio.sleep(at)
    if action == "kill_worker":
        out.killed += world.supervisor.kill_worker()
    elif action == "drain":
        out.drained = True
        await world.app.drain()
    else:
        body = {"abort_all": True} if action == "abort_all" else {"rid": rid}
        end = world.connect("ctl")
        client = HttpClient(end)
        answer = Answer("abort")
        if await client.send(request_bytes("POST", "/abort_request", orjson.dumps(body))):
            await client.read_response(answer, "POST")
        out.abort_status.append(answer.status)
        await end.aclose()
