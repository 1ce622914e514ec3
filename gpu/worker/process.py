"""The worker process: ``python -m gpu.worker --listen unix:/path | tcp:HOST:PORT``.

A thin driver around ``Engine``. It serves every frontend that connects, at once (one
engine, one batch: ``serve --frontends N`` runs several frontends on one worker); HELLO
first on each (after TLS and the token's CHALLENGE/AUTH when the worker has them:
``gpu/worker/link.py``). Each connection's thread authenticates, then does blocking reads,
answers PROBE itself (no slot, under the send lock) and queues everything else; the
step loop blocks on the queue when it has no work (idle is ~0% CPU, and a frame
arriving wakes it at once) and drains it between steps otherwise.

Rids are each frontend's own (``specs/wire.cddl``: unique per connection, below 2**40).
In the engine a connection's rids carry its slot above bit 40; slot 0, the first
frontend's, is the rid itself, so one frontend costs no translation. A lost connection
aborts and frees everything it held, and only that; a malformed frame gets FATAL and a
close of that connection; the worker stays up until a frontend sends SHUTDOWN. With
``--tp K`` this process is rank 0 of K tensor-parallel ranks (``gpu/parallel/tp.py``), the others
its children.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import socket
import ssl
import sys
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from gpu.kernels.cpu_runtime import tune_cpu_runtime

# Before torch loads libgomp: bounded OpenMP spin, and no page faults on big temporaries.
_CPU_TUNING = tune_cpu_runtime()

# torch loads with these, after the tuning above.
import torch  # noqa: E402

import wire  # noqa: E402
from gpu.runtime.engine import Engine, ProtocolError  # noqa: E402
from gpu.worker.config import (  # noqa: E402
    WorkerConfig,
    build_engine,
    kv_blocks_for,
    parse_config,
    refused_at_start,
)
from gpu.worker.info import hello, stats  # noqa: E402
from gpu.worker.link import AUTH_TIMEOUT, Link, TlsLink, authenticate, server_tls_context  # noqa: E402
from gpu.worker.threads import ThreadGovernor, apply_threads, resolve_threads, worker_governor  # noqa: E402
from modelfile.gguf_meta import ModelFileError  # noqa: E402
from modelfile.hub import resolve_model  # noqa: E402
from wire.address import listen_unix, parse_address  # noqa: E402
from wire.faults import fault_point  # noqa: E402

__all__ = ["WorkerConfig", "build_engine", "kv_blocks_for", "main", "serve"]

log = logging.getLogger("gpu.worker")

_JOIN = object()  # a connection's first word: authenticated, wants its HELLO
_EOF = object()  # the receiver's last word: the connection is gone
_LOOPBACK = ("127.0.0.1", "::1", "localhost")
# what a connection's thread queues for the step loop (PROBE it answers itself)
_QUEUED = (wire.Submit, wire.Abort, wire.Audit, wire.StatsReq, wire.Flush, wire.Shutdown)
RID_BITS = 40  # a frontend's rids are below 2**40; above: its connection's slot
_RID_MASK = (1 << RID_BITS) - 1


class _Connection:
    """Sends whole frames under a lock (the receiver thread answers PROBE directly)."""

    def __init__(self, sock: Link | TlsLink) -> None:
        self.sock = sock
        self.lock = threading.Lock()
        self.alive = True
        self.slot = -1  # set by ``_Hub.join``; in the engine its rids carry it above RID_BITS

    def send(self, frame: wire.Frame) -> None:
        data = wire.frame_bytes(wire.encode_frame(frame))
        if (f := fault_point("worker.frame_send")) is not None and f.apply() is not None:
            if f.action == "drop":
                self.close()
                return
            data = data[:4] + b"\xff" * (len(data) - 4)  # corrupt: the frontend must refuse it
        with self.lock:
            if not self.alive:
                return
            try:
                self.sock.sendall(data)
            except OSError:
                self.alive = False

    def fatal(self, message: str) -> None:
        """Send FATAL; nothing more is sent on this connection."""
        self.send(wire.Fatal(message))
        with self.lock:
            self.alive = False

    def close(self) -> None:
        with self.lock:
            self.alive = False
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


class _Hub:
    """The connected frontends by slot (the lowest free one each time), and the routing
    of rids between their wire numbering and the engine's. Touched by the step loop only."""

    def __init__(self) -> None:
        self.conns: dict[int, _Connection] = {}

    def join(self, conn: _Connection) -> None:
        slot = next(k for k in range(len(self.conns) + 1) if k not in self.conns)
        conn.slot = slot
        self.conns[slot] = conn

    def leave(self, engine: Engine, conn: _Connection, why: str) -> None:
        """``conn`` is gone: what its frontend held ends and is freed; the others go on."""
        held = [r for r in (*engine.seqs, *engine.reserved) if r >> RID_BITS == conn.slot]
        engine.abort(held, why)
        if self.conns.get(conn.slot) is conn:
            del self.conns[conn.slot]
        conn.close()

    def send_entries(self, step_no: int, entries: list[wire.StepEntry]) -> None:
        """One STEP to each frontend with entries in it, each entry under its own rid.
        An entry whose frontend has left is dropped (its abort was its end)."""
        if len(self.conns) == 1 and 0 in self.conns:  # one frontend: rids as they are
            self.conns[0].send(wire.Step(step_no, entries))
            return
        out: dict[int, list[wire.StepEntry]] = {}
        for e in entries:
            out.setdefault(e.rid >> RID_BITS, []).append(e._replace(rid=e.rid & _RID_MASK))
        for slot, part in out.items():
            conn = self.conns.get(slot)
            if conn is not None:
                conn.send(wire.Step(step_no, part))

    def send_errors(self, errors: list[tuple[int, str, str]]) -> None:
        out: dict[int, list[tuple[int, str, str]]] = {}
        for rid, code, message in errors:
            out.setdefault(rid >> RID_BITS, []).append((rid & _RID_MASK, code, message))
        for slot, part in out.items():
            conn = self.conns.get(slot)
            if conn is not None:
                conn.send(wire.ReqError(part))


def _inward(conn: _Connection, rids: list[int]) -> list[int]:
    """A frontend's rids as the engine knows them; ProtocolError past ``RID_BITS``."""
    if rids and max(rids) > _RID_MASK:
        raise ProtocolError(f"rid {max(rids)} is not below 2**{RID_BITS}")
    return [r + (conn.slot << RID_BITS) for r in rids] if conn.slot else rids


def _receive(conn: _Connection, inbox: queue.Queue[Any], engine: Engine) -> None:
    buf = wire.FrameBuffer()
    try:
        while True:
            data = conn.sock.recv(1 << 20)
            if not data:
                return
            for payload in buf.feed(data):
                if (f := fault_point("worker.frame_recv")) is not None and f.apply() is not None:
                    if f.action == "drop":
                        return
                    payload = b"\xff" * len(payload)
                frame = wire.decode_frame(payload)
                if isinstance(frame, wire.Probe):
                    conn.send(wire.ProbeReply(frame.nonce, engine.load()))
                elif isinstance(frame, _QUEUED):
                    inbox.put((conn, frame))
                else:
                    raise wire.WireError(f"a frontend may not send {type(frame).__name__}")
    except (wire.WireError, ValueError) as exc:
        conn.fatal(f"protocol error: {exc}")
    except OSError:
        pass
    finally:
        inbox.put((conn, _EOF))


def _handle(engine: Engine, hub: _Hub, conn: _Connection, frame: Any) -> bool:
    """Apply one queued frame of ``conn``'s; True when it asks the worker to shut down."""
    if frame is _JOIN:
        hub.join(conn)
        conn.send(hello(engine))
    elif frame is _EOF:
        hub.leave(engine, conn, "connection lost")
    elif not conn.alive or conn.slot < 0:
        pass  # what a dead connection queued before its end
    elif isinstance(frame, wire.Shutdown):
        return True
    else:
        try:
            _apply(engine, hub, conn, frame)
        except ProtocolError as exc:
            conn.fatal(f"protocol error: {exc}")
            hub.leave(engine, conn, "protocol error")
    return False


def _apply(engine: Engine, hub: _Hub, conn: _Connection, frame: Any) -> None:
    if isinstance(frame, wire.Submit):
        entries = frame.entries
        if conn.slot or any(e.rid > _RID_MASK for e in entries):
            rids = _inward(conn, [e.rid for e in entries])
            entries = [replace(e, rid=r) for e, r in zip(entries, rids, strict=True)]
        errors, done = engine.submit(entries)
        hub.send_errors(errors)  # nothing is sent for none
        if done:
            hub.send_entries(engine.step_no, done)
    elif isinstance(frame, wire.Abort):
        ended = engine.abort(_inward(conn, list(frame.rids)))
        if ended:
            hub.send_entries(engine.step_no, ended)
    elif isinstance(frame, wire.Audit):  # in order with SUBMIT: what never arrived
        rids = list(frame.rids)
        missing = [r for r, e in zip(rids, _inward(conn, rids), strict=True) if not engine.holds(e)]
        conn.send(wire.AuditReply(frame.nonce, missing))
    elif isinstance(frame, wire.StatsReq):
        conn.send(wire.Stats(frame.nonce, stats(engine)))
    elif isinstance(frame, wire.Flush):
        ok, message = engine.flush()
        conn.send(wire.FlushReply(frame.nonce, ok, message))


def _step(engine: Engine, hub: _Hub) -> None:
    before = engine.step_no
    try:
        entries = engine.step()
    except Exception:
        # Ours, not the frontend's: fail what is live, keep serving.
        log.exception("step %d failed; failing every live request", engine.step_no)
        message = "the worker failed while running this request"
        aborted = engine.abort_all("internal error")
        hub.send_errors([(e.rid, wire.ErrorCode.INTERNAL, message) for e in aborted])
        return
    failed = engine.take_failed()  # requests a step failed alone (non-finite logits)
    hub.send_errors([(rid, wire.ErrorCode.INTERNAL, why) for rid, why in failed])
    if not entries:
        if engine.step_no != before:  # a prompt chunk: progress the frontends can see
            for conn in list(hub.conns.values()):
                conn.send(wire.Step(engine.step_no, []))
        return
    try:
        hub.send_entries(engine.step_no, entries)
    except ValueError as exc:  # over the frame size limit: those requests cannot be served
        log.error("step %d: %s", engine.step_no, exc)
        engine.abort([e.rid for e in entries if e.finish is None], "internal error")
        hub.send_errors(
            [(e.rid, wire.ErrorCode.INTERNAL, "output too large for one frame") for e in entries]
        )


@torch.inference_mode()  # for good: entered by every step, it cost ~0.05 ms of each
def _run(engine: Engine, inbox: queue.Queue[Any], governor: ThreadGovernor) -> None:
    """The step loop over every frontend's frames, until one sends SHUTDOWN."""
    hub = _Hub()
    shutdown = False
    while not shutdown:
        if not engine.has_work:
            if problems := engine.check():
                log.error("integrity check failed: %s", problems[:8])
            governor.idle()
            shutdown = _handle(engine, hub, *inbox.get())
        while not shutdown:
            try:
                shutdown = _handle(engine, hub, *inbox.get_nowait())
            except queue.Empty:
                break
        if not shutdown and engine.has_work:
            _step(engine, hub)
            governor.after_step()
    entries = engine.abort_all("worker shutting down")
    if entries:
        hub.send_entries(engine.step_no, entries)
    if engine.disk is not None:  # the prefix cache outlives the worker
        engine.disk.spill(engine.blocks)
    for conn in list(hub.conns.values()):
        conn.close()


def _accept(listener: socket.socket, frontend: Callable[[socket.socket, str], None]) -> None:
    """Accept frontends for as long as the listener is open, a thread each."""
    while True:
        try:
            sock, peer = listener.accept()
        except OSError:
            return  # the listener closed: the worker is ending
        who = str(peer) if peer else "a unix socket"
        threading.Thread(target=frontend, args=(sock, who), daemon=True, name="frontend").start()


def _listen(text: str, tls: bool = False) -> socket.socket:
    address = parse_address(text)
    if address.tls and not tls:
        raise SystemExit(f"--listen {text} needs --tls-cert")
    if tls and address.kind == "unix":
        raise SystemExit("TLS is for a TCP link: --listen tls:HOST:PORT or tcp:HOST:PORT")
    if address.kind == "unix":
        return listen_unix(address.path, backlog=16)
    return socket.create_server((address.host, address.port), backlog=16)


def serve(
    engine: Engine,
    listener: socket.socket,
    token: str | None = None,
    tls: ssl.SSLContext | None = None,
    governor: ThreadGovernor | None = None,
) -> int:
    """Serve every frontend that connects until one sends SHUTDOWN. A connection that
    fails TLS or the token check is logged and closed; the others go on."""
    inbox: queue.Queue[Any] = queue.Queue()

    def frontend(sock: socket.socket, who: str) -> None:
        """One frontend's thread: TLS and the token check, then its frames into ``inbox``."""
        link: Link | TlsLink = sock
        try:
            if sock.family != socket.AF_UNIX:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if tls is not None:
                link = TlsLink(sock, tls, AUTH_TIMEOUT)
            if token is not None and not authenticate(link, token, who):
                link.close()
                return
        except (OSError, ssl.SSLError) as exc:
            log.warning("refused a frontend from %s: %s", who, exc)
            sock.close()
            return
        conn = _Connection(link)
        inbox.put((conn, _JOIN))
        _receive(conn, inbox, engine)

    threading.Thread(target=_accept, args=(listener, frontend), daemon=True, name="accept").start()
    _run(engine, inbox, governor or ThreadGovernor(1, enabled=False))
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker %(levelname)s %(message)s")
    config = parse_config(argv)
    try:  # --model ORG/NAME[:QUANT] (a standalone worker; serve passes the path it resolved)
        config = replace(config, model_path=resolve_model(config.model_path).path)
    except ModelFileError as exc:
        return _refuse(exc)
    if (f := fault_point("worker.start")) is not None:
        f.apply()
    address = parse_address(config.listen)
    tls = server_tls_context(config.tls_cert, config.tls_key) if config.tls_cert else None
    if (refused := refused_at_start(config)) is not None:
        return _refuse(refused)
    # Listening before the model loads tells a frontend that spawned this worker that it
    # took its options and its device: it binds its own port only then (a refusal above
    # is one line and exit 2, and the frontend never listens).
    listener = _listen(config.listen, tls is not None)
    try:
        return _load_and_serve(config, listener, tls)
    finally:
        listener.close()
        if address.kind == "unix" and os.path.exists(address.path):
            os.unlink(address.path)  # nobody connects to a worker that has ended


def _refuse(why: object) -> int:
    """A worker that cannot start says why in one line, as `lifecycle serve` says it."""
    print(f"error: {why}", file=sys.stderr)
    return 2


def _load_and_serve(
    config: WorkerConfig, listener: socket.socket, tls: ssl.SSLContext | None
) -> int:
    address = parse_address(config.listen)
    # A Unix-socket worker shares its host with the frontend that connects to it.
    threads, why = resolve_threads(config.threads, address.kind == "unix")
    if config.tp == 1:  # --tp > 1: one thread per rank unless --threads (gpu/parallel/tp.py)
        apply_threads(threads)
    try:
        engine = build_engine(config)
    except ModelFileError as exc:
        return _refuse(exc)
    except SystemExit as exc:  # options refused together (build_engine)
        if not isinstance(exc.code, str):
            raise
        return _refuse(exc.code)
    if address.kind == "tcp" and config.token is None and address.host not in _LOOPBACK:
        log.warning("no worker token: anyone who reaches %s can use this worker", config.listen)
    kv_tokens = engine.config.kv_blocks * config.block_size
    context = engine.mc.context_length
    log.info(
        "listening on %s: %s, context %d tokens, KV cache %d tokens (%d blocks of %d, %s)",
        config.listen, engine.mc.name, context, kv_tokens, engine.config.kv_blocks,
        config.block_size, engine.cache.element,
    )  # fmt: skip
    governor = worker_governor(threads, engine.loaded.device.type, config.tp)
    log.info(
        "threads %d (%s)%s", threads, why,
        ", fewer while other processes want the CPUs" if governor.enabled else "",
    )  # fmt: skip
    log.debug("cpu runtime: %s", _CPU_TUNING or "as the environment set it")
    if kv_tokens < context:
        log.warning(
            "the KV cache holds %d tokens, fewer than one full context of %d: a request "
            "spans at most %d (--kv-cache-tokens / --kv-memory-mib, or --context-length)",
            kv_tokens, context, engine.max_context,
        )  # fmt: skip
    log.info("%s", engine.footprint().line())
    try:
        return serve(engine, listener, config.token, tls, governor)
    finally:
        if config.tp > 1:
            from gpu.parallel.tp import stop_leader

            stop_leader(engine)
