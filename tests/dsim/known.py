"""Violations the simulation finds in the product as it is, each with its reason.

A failing seed whose every violation is explained here counts as *known* (reported,
not failed): ``make test`` stays green on them only because they are listed, and each
entry says what would have to change for it to go. Remove an entry once the product
handles it; the test then holds the fix.
"""

from __future__ import annotations

__all__ = ["KNOWN_DRAIN_LAGGING", "KNOWN_LINK", "known_reason"]

# Frame faults on the worker link the protocol cannot survive without sequence numbers:
# it relies on the stream under it (a socket) delivering each frame exactly once, in order.
KNOWN_LINK = {
    "dup Submit": "a duplicated SUBMIT runs the request twice in the worker: the frontend "
    "drops the second copy's output as 'unknown rid', the worker spends a slot and its "
    "KV blocks on it (no de-duplication of rids in the worker)",
    "dup Step": "a duplicated STEP delivers its tokens twice (STEP's step number is not checked)",
    "lose Step": "a lost STEP loses its tokens silently (no sequence numbers, no retransmission)",
    "lose Abort": "a lost ABORT lets an aborted request run to its end after /abort_request "
    "answered 200 (the AUDIT covers lost SUBMITs, not lost ABORTs)",
}


# Issue 37 item 7, being fixed: a drain whose timeout passes while a reader lags behind
# its stream closes the connection under it (a WebSocket without a close frame, an SSE
# stream without an error event or [DONE]).
KNOWN_DRAIN_LAGGING = (
    "issue 37 item 7: the drain's deadline cuts a lagging reader's connection with no "
    "error event, no [DONE] and no WebSocket close frame"
)


def known_reason(
    link_fired: list[str], violations: list[tuple[str, str]], drained: bool, lagging: set[str]
) -> str | None:
    """Why a failing seed is a known finding, or None when it is a real failure.
    ``lagging``: the labels of the requests on slow connections."""
    if (
        drained
        and violations
        and all(name == "answered" and what.split()[0] in lagging for name, what in violations)
    ):
        return f"known ({KNOWN_DRAIN_LAGGING})"
    for event in link_fired:
        action, kind, _direction = event.split()
        reason = KNOWN_LINK.get(f"{action} {kind}")
        if reason is not None:
            return f"known (worker link, {action} {kind}): {reason}"
    return None
