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

from wire import SamplingParams

SPEC = Path(__file__).resolve().parent.parent / "specs" / "wire.cddl"

RULE_BY_KIND = {
    1: "hello",
    2: "submit",
    3: "abort",
    4: "step",
    5: "req-error",
    6: "probe",
    7: "probe-reply",
    8: "stats-req",
    9: "stats",
    10: "flush",
    11: "flush-reply",
    12: "shutdown",
    13: "fatal",
    14: "challenge",
    15: "auth",
    16: "audit",
    17: "audit-reply",
}


@cache
def _schema(rule: str) -> pycddl.Schema:
    return pycddl.Schema(f"root = {rule}\n" + SPEC.read_text())


def validate_frame(data: bytes) -> None:
    """Raise if ``data`` (one frame's CBOR, no length prefix) is not valid per the spec."""
    value = cbor2.loads(data)
    assert isinstance(value, list) and value and value[0] in RULE_BY_KIND, (
        f"unknown frame {value!r}"
    )
    _schema(RULE_BY_KIND[value[0]]).validate_cbor(data)


# One value of every sampling field, none at its default (the wire and worker tests).
EVERY_SAMPLING_FIELD = SamplingParams(
    max_new_tokens=9,
    min_new_tokens=2,
    temperature=0.5,
    top_p=0.9,
    top_k=7,
    min_p=0.1,
    frequency_penalty=0.5,
    presence_penalty=-0.5,
    repetition_penalty=1.5,
    stop=("a", "bc"),
    stop_regex=(r"\d+\.", "end$"),
    stop_token_ids=(3, 4),
    ignore_eos=True,
    seed=-(2**63),
    logit_bias=((1, -2.0), (5, 1.5)),
    n=64,
    grammar=("json_schema", '{"type": "object"}'),
)
