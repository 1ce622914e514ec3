"""Violations the simulation finds in the product as it is, each with its reason.

A failing seed whose every violation is explained here counts as *known* (reported,
not failed): ``make test`` stays green on them only because they are listed, and each
entry says what would have to change for it to go. Remove an entry once the product
handles it; the test then holds the fix.
"""

from __future__ import annotations

__all__ = ["KNOWN_LINK", "known_reason"]

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


def known_reason(link_fired: list[str]) -> str | None:
    """Why a failing seed is a known finding (a listed worker-link fault fired in it), or
    None when it is a real failure."""
    for event in link_fired:
        action, kind, _direction = event.split()
        reason = KNOWN_LINK.get(f"{action} {kind}")
        if reason is not None:
            return f"known (worker link, {action} {kind}): {reason}"
    return None
