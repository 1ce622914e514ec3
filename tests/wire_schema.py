"""Validate encoded frames against ``specs/wire.cddl`` with pycddl.

pycddl (cddl-rs) does not backtrack reliably through a choice of array rules (a
frame that matches a later alternative can be reported invalid), so each frame is
validated against the one rule its kind names, with that rule as the schema root.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import cbor2
import pycddl

SPEC = Path(__file__).resolve().parent.parent / "specs" / "wire.cddl"

RULE_BY_KIND = {
    1: "hello", 2: "submit", 3: "abort", 4: "step", 5: "req-error", 6: "probe",
    7: "probe-reply", 8: "stats-req", 9: "stats", 10: "flush", 11: "flush-reply",
    12: "shutdown", 13: "fatal",
}


@cache
def _schema(rule: str) -> pycddl.Schema:
    return pycddl.Schema(f"root = {rule}\n" + SPEC.read_text())


def validate_frame(data: bytes) -> None:
    """Raise if ``data`` (one frame's CBOR, no length prefix) is not valid per the spec."""
    value = cbor2.loads(data)
    assert isinstance(value, list) and value and value[0] in RULE_BY_KIND, f"unknown frame {value!r}"
    _schema(RULE_BY_KIND[value[0]]).validate_cbor(data)
