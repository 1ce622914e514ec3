"""The request state table: everything that affects the request state machine lives here.

Like h11's ``_state.py``, this file is data, not behaviour: the states, the events, the
edges (with the name of the guard an edge needs), and the closed set of error causes
with the one HTTP status and error body each maps to. ``specs/lifecycle.json`` carries
the same table and ``tests/test_fsm.py`` asserts they are equal; ``lifecycle/core/fsm.py``
builds the ``transitions`` machine from it and compiles the hot-path lookup table.

::

    received -validate-> validated -admit-> queued -dispatch-> running -first_token-> streaming
                                                                 |                       |
                                                                 +-------finish----------+--> done
    every live state -fail-> error(cause)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CAUSE_TABLE",
    "DRAIN",
    "EDGES",
    "GUARDS",
    "HOLD_EDGES",
    "INITIAL",
    "LIVE",
    "TERMINAL",
    "Cause",
    "CauseInfo",
    "DrainPolicy",
    "Edge",
    "Event",
    "HoldEdge",
    "State",
    "WorkerHold",
]


class _Fast(enum.Enum):
    """An Enum whose members hash by identity: ``Enum.__hash__`` is Python code (it hashes
    the member's name), and the request path looks members up in the state table, its
    sets and the books on every edge and chunk. Members are singletons compared by
    identity, so the identity hash agrees with equality."""

    __hash__ = object.__hash__


class State(_Fast):
    RECEIVED = "received"
    VALIDATED = "validated"
    QUEUED = "queued"
    RUNNING = "running"
    STREAMING = "streaming"
    DONE = "done"
    ERROR = "error"


class Event(_Fast):
    VALIDATE = "validate"
    ADMIT = "admit"
    DISPATCH = "dispatch"
    FIRST_TOKEN = "first_token"
    FINISH = "finish"
    FAIL = "fail"


INITIAL = State.RECEIVED
TERMINAL: frozenset[State] = frozenset({State.DONE, State.ERROR})
LIVE: tuple[State, ...] = tuple(s for s in State if s not in TERMINAL)


@dataclass(frozen=True, slots=True)
class Edge:
    src: State
    event: Event
    dst: State
    guard: str | None = None


# Guards by name; the callables live in fsm.py (this file stays data).
# admission_has_room: the admission queue took a slot for the request; when it has no
# room the caller ends the request with error(overloaded) instead.
GUARDS: dict[str, str] = {
    "admission_has_room": "the admission queue has room for one more request",
}

EDGES: tuple[Edge, ...] = (
    Edge(State.RECEIVED, Event.VALIDATE, State.VALIDATED),
    Edge(State.VALIDATED, Event.ADMIT, State.QUEUED, "admission_has_room"),
    # Dispatch = the submit frame was handed to the worker: from here on the worker
    # may hold KV blocks for the request, so cleanup needs an abort (RequestRecord).
    Edge(State.QUEUED, Event.DISPATCH, State.RUNNING),
    Edge(State.RUNNING, Event.FIRST_TOKEN, State.STREAMING),
    # A request can finish before any token reached the client (max_new_tokens=0, or
    # the first step's output was also its last).
    Edge(State.RUNNING, Event.FINISH, State.DONE),
    Edge(State.STREAMING, Event.FINISH, State.DONE),
    *(Edge(s, Event.FAIL, State.ERROR) for s in LIVE),
)

# What the worker holds for a request, because cleanup differs: a request the worker never
# saw is dropped locally; one it holds is aborted and its tombstone kept until the worker
# confirms release. The hold is a machine of its own, recorded in one place (the worker
# client's ``Submission``, one per prompt with all its samples) that the dispatcher, the
# abort lane and the egress all move and read; a record only asks it. The worker's
# terminal step entry for a sample (the one that finishes it, after an abort too) is its
# confirmation of release (specs/wire.cddl); a failure releases nothing by itself.


class WorkerHold(_Fast):
    NONE = "none"  # not submitted yet
    QUEUED = "queued"  # in the frontend's dispatch queue: ends locally, no abort needed
    RUNNING = "running"  # handed to the worker: it may hold KV blocks until it says not
    RELEASED = "released"  # the worker confirmed every sample ended, or never had it


@dataclass(frozen=True, slots=True)
class HoldEdge:
    src: WorkerHold
    event: str
    dst: WorkerHold


HOLD_EDGES: tuple[HoldEdge, ...] = (
    HoldEdge(WorkerHold.NONE, "submit", WorkerHold.QUEUED),
    # Refused before queueing: the worker connection is closed, or n exceeds its capacity.
    HoldEdge(WorkerHold.NONE, "refuse", WorkerHold.RELEASED),
    HoldEdge(WorkerHold.QUEUED, "dispatch", WorkerHold.RUNNING),
    # Aborted or failed while still queued here: the worker never saw it.
    HoldEdge(WorkerHold.QUEUED, "drop", WorkerHold.RELEASED),
    # The worker's terminal entry for the last open sample, or the connection lost.
    HoldEdge(WorkerHold.RUNNING, "release", WorkerHold.RELEASED),
)


@dataclass(frozen=True, slots=True)
class CauseInfo:
    status: int
    err_type: str
    retry_after: int | None
    retryable: bool


class Cause(_Fast):
    """Why a request ended in ``error``: a closed set, one HTTP status and body each."""

    INVALID = "invalid"
    TOO_LONG = "too_long"
    # Refused by the API-key check (401, or 403 for a user key on an admin route).
    UNAUTHORIZED = "unauthorized"
    OVERLOADED = "overloaded"
    NOT_READY = "not_ready"
    CLIENT_GONE = "client_gone"
    CLIENT_STALLED = "client_stalled"
    ABORTED = "aborted"
    WORKER_LOST = "worker_lost"
    SHUTTING_DOWN = "shutting_down"
    DEADLINE = "deadline"
    INTERNAL = "internal"

    @property
    def status(self) -> int:
        return CAUSE_TABLE[self].status

    @property
    def err_type(self) -> str:
        return CAUSE_TABLE[self].err_type

    @property
    def retry_after(self) -> int | None:
        """Seconds for a ``Retry-After`` header, or None when retrying will not help."""
        return CAUSE_TABLE[self].retry_after

    @property
    def retryable(self) -> bool:
        return CAUSE_TABLE[self].retryable

    def body(self, message: str) -> dict[str, Any]:
        """The error body for this cause (SGLang's streaming error frame shape, §5.4)."""
        return {
            "error": {
                "message": message,
                "type": self.err_type,
                "code": self.status,
                "retryable": self.retryable,
            }
        }


# 499 is nginx's "client closed request": nothing is sent, the status only shows in logs
# and metrics. ABORTED answers 200 because the reply is the partial output with
# finish_reason {"type": "abort"} (SGLang §4.1).
CAUSE_TABLE: dict[Cause, CauseInfo] = {
    Cause.INVALID: CauseInfo(400, "invalid_request_error", None, False),
    Cause.TOO_LONG: CauseInfo(400, "invalid_request_error", None, False),
    Cause.UNAUTHORIZED: CauseInfo(401, "authentication_error", None, False),
    Cause.OVERLOADED: CauseInfo(503, "overloaded_error", 1, True),
    Cause.NOT_READY: CauseInfo(503, "unavailable_error", 5, True),
    Cause.CLIENT_GONE: CauseInfo(499, "client_closed_request", None, False),
    Cause.CLIENT_STALLED: CauseInfo(408, "timeout_error", None, False),
    Cause.ABORTED: CauseInfo(200, "aborted", None, False),
    Cause.WORKER_LOST: CauseInfo(503, "server_error", 2, True),
    # The server is draining (SIGTERM/SIGINT): refused at once, or cut at the drain timeout.
    Cause.SHUTTING_DOWN: CauseInfo(503, "unavailable_error", 5, True),
    Cause.DEADLINE: CauseInfo(504, "timeout_error", None, True),
    Cause.INTERNAL: CauseInfo(500, "server_error", None, False),
}


@dataclass(frozen=True, slots=True)
class DrainPolicy:
    """What SIGTERM or SIGINT does (docs/lifecycle.md "Graceful drain")."""

    signals: tuple[str, ...]
    health_status: int  # /health from the first signal on
    refused: Cause  # a request that arrives while draining
    timeout_s: float  # default --drain-timeout: in-flight requests may finish until then
    cut: Cause  # a request still open at the timeout ends with this explicit error
    exit_code: int


DRAIN = DrainPolicy(
    signals=("SIGTERM", "SIGINT"),
    health_status=503,
    refused=Cause.SHUTTING_DOWN,
    timeout_s=30.0,
    cut=Cause.SHUTTING_DOWN,
    exit_code=0,
)
