"""Wire codec: round trips, framing, schema conformance (pycddl), hostile bytes."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import cbor2
import pycddl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import wire

from .wire_schema import EVERY_SAMPLING_FIELD, RULE_BY_KIND, validate_frame

EXAMPLES = [
    wire.Hello(
        {
            "name": "m",
            "path": "/x.gguf",
            "arch": "llama",
            "vocab_size": 10,
            "context_length": 64,
            "eos_id": 2,
            "eog_ids": [0, 2],
            "device": "cpu",
            "dtype": "float32",
            "pid": 7,
            "hidden_size": 64,
        },
        {"max_running": 4, "max_pending": 16, "kv_blocks": 32, "block_size": 16, "max_context": 64},
    ),
    wire.Submit(
        [
            wire.SubmitEntry(
                1,
                wire.pack_ids([5, 6, 7]),
                {"max_new_tokens": 4, "temperature": 0.5, "stop": ["x"], "logit_bias": {3: -1.5}},
                {"return_logprob": True, "token_ids_logprob": wire.pack_ids([1, 2])},
            ),
            wire.SubmitEntry(2, wire.pack_ids([5]), {}, {}),
        ]
    ),
    wire.Abort([1, 2]),
    wire.Step(
        3,
        [
            wire.StepEntry(
                1,
                wire.pack_ids([9]),
                None,
                {"prompt_tokens": 3, "cached_tokens": 0, "logprobs": wire.pack_f32s([-0.5])},
            ),
            wire.StepEntry(2, wire.pack_ids([]), ["length", 4], {"num_retractions": 0}),
            wire.StepEntry(4, wire.pack_ids([2]), ["stop", 2], None),
            wire.StepEntry(5, wire.pack_ids([]), ["abort", "aborted"], None),
        ],
    ),
    wire.Step(0, []),
    # An embed request: prefill only, one terminal entry with its vector.
    wire.Submit(
        [
            wire.SubmitEntry(
                6,
                wire.pack_ids([5, 6]),
                {"max_new_tokens": 0},
                {"embed": wire.EmbedOptions("mean", False).to_wire()},
            )
        ]
    ),
    wire.Step(
        4,
        [
            wire.StepEntry(
                6,
                b"",
                ["embed", 3],
                {"prompt_tokens": 2, "num_retractions": 0, "embedding": wire.pack_f32s([1, 0, 0])},
            )
        ],
    ),
    wire.ReqError([(9, "too_long", "prompt too long")]),
    wire.Probe(1),
    wire.ProbeReply(1, {"running": 0, "waiting": 0, "kv_blocks_total": 8, "kv_blocks_free": 8}),
    wire.StatsReq(2),
    wire.Stats(2, {"running": 1, "waiting": 0, "kv_blocks_total": 8, "kv_blocks_free": 6}),
    # The model worker's: its memory (on CUDA, the card's too) and its steps' histograms.
    wire.Stats(
        3,
        {
            "running": 1,
            "waiting": 0,
            "kv_blocks_total": 8,
            "kv_blocks_free": 6,
            "memory": {
                "rss_bytes": 9,
                "weights_bytes": 0,
                "kv_bytes": 0,
                "kv_resident_bytes": 0,
                "other_bytes": 9,
                "device_allocated_bytes": 5,
                "device_reserved_bytes": 6,
                "device_total_bytes": 7,
            },
            "step_seconds": {"le": [0.01, 0.1], "counts": [2, 1, 0], "sum": 0.07},
            "step_batch": {"le": [1, 2], "counts": [1, 2, 0], "sum": 5},
        },
    ),  # fmt: skip
    wire.Audit(4, [1, 7]),
    wire.AuditReply(4, [7]),
    wire.Audit(5, []),
    wire.Flush(3),
    wire.FlushReply(3, True, "flushed"),
    wire.Shutdown(),
    wire.Fatal("bad frame"),
    wire.Challenge(bytes(range(32))),
    wire.Auth(wire.auth_mac("secret", bytes(range(32)))),
]


@pytest.mark.parametrize("frame", EXAMPLES, ids=lambda f: type(f).__name__)
def test_round_trip_and_schema(frame) -> None:
    data = wire.encode_frame(frame)
    validate_frame(data)
    assert wire.decode_frame(data) == frame


def test_ids_and_floats_are_raw_little_endian() -> None:
    assert wire.pack_ids([1, 256]) == b"\x01\x00\x00\x00\x00\x01\x00\x00"
    assert wire.ids_to_list(wire.pack_ids([0, 49151, -1])) == [0, 49151, -1]
    assert wire.f32s_to_list(wire.pack_f32s([0.5, -2.0])) == [0.5, -2.0]
    with pytest.raises(wire.WireError):
        wire.ids_to_list(b"\x00\x01\x02")


def test_frame_buffer_splits_and_joins() -> None:
    frames = [wire.encode_frame(f) for f in EXAMPLES]
    stream = b"".join(wire.frame_bytes(f) for f in frames)
    buf = wire.FrameBuffer()
    got: list[bytes] = []
    for i in range(0, len(stream), 7):  # arbitrary cuts across frame boundaries
        got += buf.feed(stream[i : i + 7])
    assert got == frames and buf.pending == 0


def test_frame_buffer_refuses_oversized_length() -> None:
    with pytest.raises(ValueError):
        wire.FrameBuffer().feed(b"\xff\xff\xff\xff")


@pytest.mark.parametrize(
    "value",
    [
        [],
        [99],
        [4, 1],
        [2, []],
        [2, [[1, b"abc", {}, {}]]],
        [4, -1, []],
        [3, []],
        "x",
        5,
        [4, 0, [[1, b"", ["stop"], None]]],
        [1, 1, [], {}],
    ],
)
def test_malformed_frames_raise_wire_error(value) -> None:
    with pytest.raises(wire.WireError):
        wire.decode_frame(cbor2.dumps(value))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_arbitrary_bytes_never_escape_as_other_errors(data: bytes) -> None:
    try:
        wire.decode_frame(data)
    except wire.WireError:
        pass


def test_spec_names_every_frame_kind() -> None:
    from wire import frames

    kinds = {v for k, v in vars(frames).items() if k.startswith("K_")}
    assert kinds == set(RULE_BY_KIND)
    text = (Path(__file__).resolve().parent.parent / "specs" / "wire.cddl").read_text()
    for rule in RULE_BY_KIND.values():
        assert f"\n{rule} = [" in text


SPEC_TEXT = (Path(__file__).resolve().parent.parent / "specs" / "wire.cddl").read_text()


def test_spec_sampling_map_names_exactly_the_contract_fields() -> None:
    """``sampling`` in the spec and ``wire.SamplingParams`` list the same fields: what
    the worker reads, no more (no detokenizer options)."""
    block = re.search(r"\nsampling = \{(.*?)\n\}", SPEC_TEXT, re.S)
    assert block is not None
    keys = set(re.findall(r'"(\w+)":', block.group(1)))
    assert keys == {f.name for f in fields(wire.SamplingParams)}
    assert "no_stop_trim" not in keys


def test_every_sampling_field_is_on_spec_and_reads_back() -> None:
    full = EVERY_SAMPLING_FIELD
    sent = full.to_wire()
    assert set(sent) == {f.name for f in fields(wire.SamplingParams)}  # none at its default
    frame = wire.Submit([wire.SubmitEntry(1, wire.pack_ids([5]), sent, {})])
    validate_frame(wire.encode_frame(frame))
    received = wire.decode_frame(wire.encode_frame(frame))
    assert isinstance(received, wire.Submit)
    assert wire.SamplingParams.from_wire(received.entries[0].sampling, vocab_size=10) == full
    assert wire.SamplingParams().to_wire() == {"max_new_tokens": 128}


def test_schema_rejects_off_spec_frames() -> None:
    with pytest.raises(pycddl.ValidationError):
        validate_frame(cbor2.dumps([4, 0, [[1, [1, 2], None, None]]]))  # ids as an int list
    with pytest.raises(pycddl.ValidationError):  # a pooling the spec does not name
        validate_frame(cbor2.dumps([2, [[1, b"\x01\0\0\0", {}, {"embed": {"pooling": "max"}}]]]))


def test_auth_mac_binds_token_and_nonce() -> None:
    nonce = wire.new_nonce()
    mac = wire.auth_mac("secret", nonce)
    assert wire.check_mac("secret", nonce, mac)
    assert not wire.check_mac("secret2", nonce, mac)
    assert not wire.check_mac("secret", wire.new_nonce(), mac)
    with pytest.raises(wire.WireError, match="32-byte"):
        wire.decode_frame(cbor2.dumps([15, b"short"]))
    with pytest.raises(ValueError, match="empty"):
        wire.resolve_token("  ")


def test_embed_options_defaults_and_refusals() -> None:
    assert wire.EmbedOptions.from_wire({}) == wire.EmbedOptions("last", True)
    assert wire.EmbedOptions.from_wire(wire.EmbedOptions("mean", False).to_wire()).pooling == "mean"
    for bad in ({"pooling": "max"}, {"normalize": 1}, []):
        with pytest.raises(ValueError):
            wire.EmbedOptions.from_wire(bad)


@pytest.mark.parametrize(
    "finish", [["stop", 2], ["stop", "</s>"], ["length", 4], ["embed", 576], ["abort", "gone"]]
)
def test_step_whose_first_entry_is_terminal_validates(finish) -> None:
    # Regression: with `finish` written as one array of group choices, pycddl rejected a
    # terminal entry in first position; the spec now spells finish as a choice of arrays.
    validate_frame(
        wire.encode_frame(wire.Step(1, [wire.StepEntry(1, wire.pack_ids([3]), finish, None)]))
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("unix:/tmp/w.sock", "unix:/tmp/w.sock"),
        ("tcp:127.0.0.1:9000", "tcp:127.0.0.1:9000"),
        ("10.0.0.5:9000", "tcp:10.0.0.5:9000"),  # a bare HOST:PORT is TCP (worker --listen too)
        ("tcp::9000", "tcp:127.0.0.1:9000"),
    ],
)
def test_one_address_spelling_for_worker_and_frontend(text: str, expected: str) -> None:
    from wire.address import parse_address

    assert str(parse_address(text)) == expected


@pytest.mark.parametrize("text", ["nowhere", "tcp:host:port", "udp"])
def test_bad_addresses_are_refused(text: str) -> None:
    from wire.address import parse_address

    with pytest.raises(ValueError, match="bad worker address"):
        parse_address(text)


def test_finish_kinds_and_error_codes_are_the_specs() -> None:
    """``wire.Finish`` and ``wire.ErrorCode`` are the finish kinds and REQ-ERROR codes the
    CDDL names, no more, no fewer; each error code is the frontend's cause of that name
    (``WorkerFailure.of_req_error``), and an unknown code from a peer is internal."""
    import re

    from lifecycle.core.states import Cause
    from lifecycle.core.submission import WorkerFailure

    kinds = set(re.findall(r'^finish-\w+ = \["(\w+)"', SPEC_TEXT, re.M))
    assert kinds == {f.value for f in wire.Finish}
    line = next(x for x in SPEC_TEXT.splitlines() if x.startswith("; codes:"))
    assert set(re.findall(r'"(\w+)"', line)) == {c.value for c in wire.ErrorCode}
    for code in wire.ErrorCode:
        assert WorkerFailure.of_req_error(code, "m").cause is Cause(code.value)
    assert WorkerFailure.of_req_error("bogus", "m").cause is Cause.INTERNAL
