"""Typed frames of the wire protocol and their CBOR encoding (``specs/wire.cddl``).

Frames are small positional CBOR arrays; token ids and per-token floats travel as raw
little-endian byte strings (measured ~30x cheaper than CBOR integer lists).
"""

from __future__ import annotations

import enum
import struct as _struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import cbor2
import numpy as np

from wire.step_cbor import encode_step

__all__ = [
    "PROTOCOL_VERSION",
    "Abort",
    "Audit",
    "AuditReply",
    "Auth",
    "Challenge",
    "ErrorCode",
    "Fatal",
    "Finish",
    "Flush",
    "FlushReply",
    "Frame",
    "Hello",
    "Probe",
    "ProbeReply",
    "ReqError",
    "Shutdown",
    "Stats",
    "StatsReq",
    "Step",
    "StepEntry",
    "Submit",
    "SubmitEntry",
    "WireError",
    "decode_frame",
    "encode_frame",
    "submit_entry_bytes",
    "f32s_to_list",
    "ids_to_list",
    "pack_f32s",
    "pack_id",
    "pack_ids",
]

PROTOCOL_VERSION = 1

K_HELLO, K_SUBMIT, K_ABORT, K_STEP, K_REQ_ERROR = 1, 2, 3, 4, 5
K_PROBE, K_PROBE_REPLY, K_STATS_REQ, K_STATS = 6, 7, 8, 9
K_FLUSH, K_FLUSH_REPLY, K_SHUTDOWN, K_FATAL = 10, 11, 12, 13
K_CHALLENGE, K_AUTH = 14, 15
K_AUDIT, K_AUDIT_REPLY = 16, 17

_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")


class WireError(ValueError):
    """A frame that does not match the schema."""


def pack_ids(ids: Any) -> bytes:
    """Token ids (list, tuple, numpy array or tensor .tolist()) -> int32 LE bytes."""
    return np.asarray(ids, dtype=_I32).tobytes()


# One token id -> int32 LE bytes: ``pack_ids([token])`` in one C call, with no Python
# frame (the worker packs one per row of every decode step: 0.1 us against 0.25).
pack_id: Callable[[int], bytes] = _struct.Struct("<i").pack


def ids_to_list(data: bytes) -> list[int]:
    n = len(data)
    if n % 4:
        raise WireError("ids byte string length is not a multiple of 4")
    if n <= 64:  # a step's few new tokens: struct beats numpy's set-up cost
        return list(_struct.unpack(f"<{n >> 2}i", data))
    return np.frombuffer(data, dtype=_I32).tolist()


def pack_f32s(values: Any) -> bytes:
    return np.asarray(values, dtype=_F32).tobytes()


def f32s_to_list(data: bytes) -> list[float]:
    if len(data) % 4:
        raise WireError("f32s byte string length is not a multiple of 4")
    return np.frombuffer(data, dtype=_F32).tolist()


@dataclass(frozen=True, slots=True)
class Hello:
    model: dict[str, Any]
    capacity: dict[str, Any]
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True, slots=True)
class SubmitEntry:
    rid: int
    prompt: bytes  # pack_ids(...)
    sampling: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Submit:
    entries: list[SubmitEntry]


@dataclass(frozen=True, slots=True)
class Abort:
    rids: list[int]


class Finish(enum.StrEnum):
    """A STEP entry's finish kind (``finish[0]``; wire.cddl ``finish``), which is also the
    ``type`` of SGLang's ``meta_info.finish_reason``."""

    STOP = "stop"  # ["stop", token id | stop string] / ["stop", matched text, regex index]
    LENGTH = "length"  # ["length", max_new_tokens]
    ABORT = "abort"  # ["abort", message]
    EMBED = "embed"  # ["embed", dimensions]: an embed request's one entry


class ErrorCode(enum.StrEnum):
    """A REQ-ERROR's code (wire.cddl ``req-error``)."""

    INVALID = "invalid"  # a field the worker refuses
    TOO_LONG = "too_long"  # can never fit the context or the KV cache
    INTERNAL = "internal"


# STEP frames are the hot path (one per scheduler step, one entry per running sequence):
# named tuples cost a fifth of a frozen dataclass to build, and read the same.
class StepEntry(NamedTuple):
    rid: int
    new_ids: bytes  # pack_ids(...)
    # ["stop", id|str] / ["stop", matched text, stop_regex index] / ["length", n] / ["abort", msg]
    finish: list[Any] | None = None
    extra: dict[str, Any] | None = None


class Step(NamedTuple):
    step_no: int
    entries: list[StepEntry]


@dataclass(frozen=True, slots=True)
class ReqError:
    errors: list[tuple[int, str, str]]  # (rid, code: an ErrorCode, message)


@dataclass(frozen=True, slots=True)
class Probe:
    nonce: int


@dataclass(frozen=True, slots=True)
class ProbeReply:
    nonce: int
    load: dict[str, Any]


@dataclass(frozen=True, slots=True)
class StatsReq:
    nonce: int


@dataclass(frozen=True, slots=True)
class Stats:
    nonce: int
    load: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Audit:
    """Which of ``rids`` (each sent in an earlier SUBMIT) does the worker not hold?"""

    nonce: int
    rids: list[int]


@dataclass(frozen=True, slots=True)
class AuditReply:
    """The rids of the AUDIT the worker does not hold: lost on the way to it."""

    nonce: int
    missing: list[int]


@dataclass(frozen=True, slots=True)
class Flush:
    nonce: int


@dataclass(frozen=True, slots=True)
class FlushReply:
    nonce: int
    ok: bool
    message: str


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


@dataclass(frozen=True, slots=True)
class Fatal:
    message: str


@dataclass(frozen=True, slots=True)
class Challenge:
    """The first frame of a worker that checks a token (``wire.auth``)."""

    nonce: bytes
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True, slots=True)
class Auth:
    """The frontend's answer to CHALLENGE: ``wire.auth.auth_mac(token, nonce)``."""

    mac: bytes


Frame = (
    Hello
    | Submit
    | Abort
    | Step
    | ReqError
    | Probe
    | ProbeReply
    | StatsReq
    | Stats
    | Audit
    | AuditReply
    | Flush
    | FlushReply
    | Shutdown
    | Fatal
    | Challenge
    | Auth
)


def _to_array(frame: Frame) -> list[Any]:
    match frame:
        case Step(step_no, entries):
            return [K_STEP, step_no, entries]  # a StepEntry is a tuple: CBOR's 4-array
        case Submit(entries):
            return [K_SUBMIT, [[e.rid, e.prompt, e.sampling, e.options] for e in entries]]
        case Abort(rids):
            return [K_ABORT, list(rids)]
        case ReqError(errors):
            return [K_REQ_ERROR, [list(e) for e in errors]]
        case Hello(model, capacity, version):
            return [K_HELLO, version, model, capacity]
        case Probe(nonce):
            return [K_PROBE, nonce]
        case ProbeReply(nonce, load):
            return [K_PROBE_REPLY, nonce, load]
        case StatsReq(nonce):
            return [K_STATS_REQ, nonce]
        case Stats(nonce, load):
            return [K_STATS, nonce, load]
        case Audit(nonce, rids):
            return [K_AUDIT, nonce, list(rids)]
        case AuditReply(nonce, missing):
            return [K_AUDIT_REPLY, nonce, list(missing)]
        case Flush(nonce):
            return [K_FLUSH, nonce]
        case FlushReply(nonce, ok, message):
            return [K_FLUSH_REPLY, nonce, ok, message]
        case Shutdown():
            return [K_SHUTDOWN]
        case Fatal(message):
            return [K_FATAL, message]
        case Challenge(nonce, version):
            return [K_CHALLENGE, version, nonce]
        case Auth(mac):
            return [K_AUTH, mac]
    raise TypeError(f"not a frame: {frame!r}")


def encode_frame(frame: Frame) -> bytes:
    """One frame -> CBOR bytes (without the length prefix; see ``framing``). A STEP
    frame's decode rows are written in bulk (``wire/step_cbor.py``: the same bytes)."""
    if type(frame) is Step:
        return encode_step(K_STEP, frame.step_no, frame.entries)
    return cbor2.dumps(_to_array(frame))


def submit_entry_bytes(entry: SubmitEntry) -> int:
    """The CBOR size of one SUBMIT entry: a SUBMIT frame's size is the sum of its
    entries' plus a few bytes, so a sender can cut its frames under ``MAX_FRAME_BYTES``."""
    return len(cbor2.dumps([entry.rid, entry.prompt, entry.sampling, entry.options]))


def _uint(v: Any, what: str) -> int:
    if type(v) is not int or v < 0:
        raise WireError(f"{what} must be an unsigned integer")
    return v


def _map(v: Any, what: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise WireError(f"{what} must be a map")
    return v


def _bytes(v: Any, what: str) -> bytes:
    if not isinstance(v, bytes) or len(v) % 4:
        raise WireError(f"{what} must be a byte string of 4-byte items")
    return v


def _digest(v: Any) -> bool:
    """A 32-byte string: a challenge nonce or an HMAC-SHA256."""
    if not isinstance(v, bytes) or len(v) != 32:
        raise WireError("a challenge nonce and an auth mac are 32-byte strings")
    return True


def _entries(v: Any, width: int, what: str) -> list[list[Any]]:
    if not isinstance(v, list) or not all(isinstance(e, list) and len(e) == width for e in v):
        raise WireError(f"{what} must be a list of {width}-element arrays")
    return v


def _decode_submit(a: list[Any]) -> Submit:
    out = []
    for rid, prompt, sampling, options in _entries(a[1], 4, "submit entries"):
        out.append(
            SubmitEntry(
                _uint(rid, "rid"),
                _bytes(prompt, "prompt"),
                _map(sampling, "sampling"),
                _map(options, "options"),
            )
        )
    if not out:
        raise WireError("submit carries no entry")
    return Submit(out)


def _decode_step(a: list[Any]) -> Step:
    raw = a[2]
    if type(raw) is not list:
        raise WireError("step entries must be a list of 4-element arrays")
    entries = []
    for e in raw:
        if type(e) is not list or len(e) != 4:
            raise WireError("step entries must be a list of 4-element arrays")
        rid, new_ids, finish, extra = e
        if type(rid) is not int or rid < 0:
            raise WireError("rid must be an unsigned integer")
        if type(new_ids) is not bytes or len(new_ids) % 4:
            raise WireError("new_ids must be a byte string of 4-byte items")
        if finish is not None and not (
            type(finish) is list
            and (len(finish) == 2 or (len(finish) == 3 and finish[0] == Finish.STOP))
        ):
            raise WireError("finish must be null or a 2-element array (3 for a regex stop)")
        if extra is not None and not isinstance(extra, dict):
            raise WireError("extra must be a map")
        entries.append(StepEntry(rid, new_ids, finish, extra))
    return Step(_uint(a[1], "step_no"), entries)


def decode_frame(payload: bytes) -> Frame:
    """CBOR bytes -> a typed frame; ``WireError`` for anything off-schema."""
    try:
        a = cbor2.loads(payload)
    except Exception as exc:  # cbor2 raises several types for corrupt input
        raise WireError(f"undecodable CBOR: {exc}") from None
    if not isinstance(a, list) or not a or type(a[0]) is not int:
        raise WireError("a frame must be a non-empty array starting with its kind")
    kind, n = a[0], len(a)
    try:
        if kind == K_STEP and n == 3:
            return _decode_step(a)
        if kind == K_SUBMIT and n == 2:
            return _decode_submit(a)
        if kind == K_ABORT and n == 2 and isinstance(a[1], list) and a[1]:
            return Abort([_uint(r, "rid") for r in a[1]])
        if kind == K_REQ_ERROR and n == 2:
            errs = _entries(a[1], 3, "errors")
            return ReqError([(_uint(r, "rid"), str(c), str(m)) for r, c, m in errs])
        if kind == K_HELLO and n == 4:
            return Hello(_map(a[2], "model"), _map(a[3], "capacity"), _uint(a[1], "version"))
        if kind in (K_PROBE, K_STATS_REQ, K_FLUSH) and n == 2:
            nonce = _uint(a[1], "nonce")
            return (
                Probe(nonce)
                if kind == K_PROBE
                else StatsReq(nonce)
                if kind == K_STATS_REQ
                else Flush(nonce)
            )
        if kind in (K_PROBE_REPLY, K_STATS) and n == 3:
            cls2 = ProbeReply if kind == K_PROBE_REPLY else Stats
            return cls2(_uint(a[1], "nonce"), _map(a[2], "load"))
        if kind in (K_AUDIT, K_AUDIT_REPLY) and n == 3 and isinstance(a[2], list):
            rids = [_uint(r, "rid") for r in a[2]]
            nonce = _uint(a[1], "nonce")
            return Audit(nonce, rids) if kind == K_AUDIT else AuditReply(nonce, rids)
        if kind == K_FLUSH_REPLY and n == 4:
            return FlushReply(_uint(a[1], "nonce"), bool(a[2]), str(a[3]))
        if kind == K_SHUTDOWN and n == 1:
            return Shutdown()
        if kind == K_FATAL and n == 2 and isinstance(a[1], str):
            return Fatal(a[1])
        if kind == K_CHALLENGE and n == 3 and _digest(a[2]):
            return Challenge(a[2], _uint(a[1], "version"))
        if kind == K_AUTH and n == 2 and _digest(a[1]):
            return Auth(a[1])
    except (TypeError, ValueError) as exc:
        if isinstance(exc, WireError):
            raise
        raise WireError(f"malformed frame of kind {kind}: {exc}") from None
    raise WireError(f"unknown frame kind {kind} with {n} elements")
