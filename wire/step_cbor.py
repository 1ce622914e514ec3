"""A STEP frame's CBOR (``specs/wire.cddl``, ``step``) with its decode rows written in bulk.

``cbor2.dumps`` spends about 0.45 us on every array it meets (its check for recursive
containers), so a 256-row STEP frame, whose every entry is a 4-array, took ~0.1 ms: a
tenth of the host's budget for a whole step (issue 57). A plain entry (``[rid, one
token id's 4 bytes, null, null]``, what a decode row that goes on sends) is written here
with numpy, every other entry by ``cbor2.dumps``: the frame is cbor2's to the byte (each
head in its shortest form, RFC 8949 section 4.2.1, as cbor2 writes them).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress
from typing import Any

import cbor2
import numpy as np

__all__ = ["encode_step", "head"]

_U1 = np.uint8
# A plain entry as 17 bytes: 0x84 (a 4-array), the rid's initial byte and 8 bytes for its
# argument (big-endian: the leading ones it does not use are cut), 0x44 (a 4-byte string)
# and the id's bytes, two nulls (0xf6).
_ENTRY = np.dtype([("array", _U1), ("initial", _U1), ("arg", ">u8"), ("bytes", _U1),
                   ("id", "V4"), ("nulls", ">u2")])  # fmt: skip
_BOUNDS = np.array([24, 1 << 8, 1 << 16, 1 << 32], dtype=np.uint64)  # the rid's width
_ARG_BYTES = np.array([0, 1, 2, 4, 8])  # argument bytes of each width
# Each width's bytes of the 17 that are kept.
_KEEP = np.ones((5, 17), dtype=bool)
_KEEP[:, 2:10] = np.arange(8) >= 8 - _ARG_BYTES[:, None]


def head(major: int, value: int) -> bytes:
    """A data item's initial byte and argument (RFC 8949 section 3), the shortest form."""
    if value < 24:
        return bytes((major << 5 | value,))
    for extra, width in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if value < 1 << (8 * width):
            return bytes((major << 5 | extra,)) + value.to_bytes(width, "big")
    raise OverflowError(f"{value} does not fit a CBOR head")


def encode_step(kind: int, step_no: int, entries: Sequence[Sequence[Any]]) -> bytes:
    """``cbor2.dumps([kind, step_no, entries])``, each entry a 4-array."""
    try:
        rids, new_ids, finishes, extras = zip(*entries, strict=True)
    except ValueError:  # no entries, or not 4 fields each
        return cbor2.dumps([kind, step_no, entries])
    n = len(entries)
    plain = None  # every entry plain: a decode step's usual case, with no test per entry
    if finishes.count(None) != n or extras.count(None) != n:
        plain = [f is None and x is None for f, x in zip(finishes, extras, strict=True)]
        rids, new_ids = tuple(compress(rids, plain)), tuple(compress(new_ids, plain))
    rows = _plain_rows(step_no, rids, new_ids)
    if rows is None:
        return cbor2.dumps([kind, step_no, entries])
    blob, width = rows
    parts = [head(4, 3), head(0, kind), head(0, step_no), head(4, n), blob]
    if plain is None:
        return b"".join(parts)
    parts.pop()
    first = np.zeros(len(width) + 1, dtype=np.int64)  # each plain entry's first byte, the end
    np.cumsum(_ARG_BYTES[width] + 9, out=first[1:])
    at = first.tolist()
    written = 0  # the plain entries' bytes are blob[at[k]:at[k + 1]], the others between
    for k, i in enumerate([i for i, p in enumerate(plain) if not p]):
        before = i - k  # the plain entries before entry i
        parts += [blob[at[written] : at[before]], cbor2.dumps(entries[i])]
        written = before
    parts.append(blob[at[written] :])
    return b"".join(parts)


def _plain_rows(
    step_no: Any, rids: Sequence[Any], new_ids: Sequence[Any]
) -> tuple[bytes, np.ndarray] | None:
    """The plain entries ``[rid, new_ids, null, null]`` one after another, and each rid's
    width (an index of ``_ARG_BYTES``); None unless cbor2 would write the same: each rid
    an int (not a bool) in uint64, each ``new_ids`` one 4-byte ``bytes``."""
    if not (
        type(step_no) is int
        and 0 <= step_no < 1 << 64
        and set(map(type, rids)) <= {int}
        and set(map(type, new_ids)) <= {bytes}
        and set(map(len, new_ids)) <= {4}
        and (not rids or min(rids) >= 0)
    ):
        return None
    try:
        r = np.array(rids, dtype=np.uint64)
    except OverflowError:  # past uint64
        return None
    width = np.searchsorted(_BOUNDS, r, side="right")  # 0: the rid is its initial byte
    rows = np.empty(len(r), dtype=_ENTRY)
    rows["array"], rows["bytes"], rows["nulls"] = 0x84, 0x44, 0xF6F6
    # a rid under 24 is its initial byte, width 0; a wider one's is 0x17 + its width
    rows["initial"] = np.minimum(r, 0x17).astype(np.intp) + width
    rows["arg"] = r
    rows["id"] = np.frombuffer(b"".join(new_ids), dtype="V4")
    return rows.view(_U1).reshape(-1, 17)[_KEEP[width]].tobytes(), width
