"""Random bodies and sampling dicts: only RequestError comes out, never another exception,
and whatever the frontend accepts the worker reads back; the fields read are the
specified ones (specs/openapi.yaml)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lifecycle.core import params
from lifecycle.core.params import (
    RequestError,
    SamplingRequest,
    check_lengths,
    parse_sampling_params,
)
from lifecycle.core.sampling import FIELDS as SAMPLING_FIELDS
from wire import SamplingParams, Submit, SubmitEntry, encode_frame, pack_ids

from .params_helpers import V, gen
from .wire_schema import validate_frame

# -- random bodies: only RequestError, never another exception ----------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.integers(-(10**400), 10**400)
    | st.floats()
    | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
SPEC = Path(__file__).resolve().parent.parent / "specs" / "openapi.yaml"
# What the spec says a /generate body holds; native.py takes incremental_streaming_output
# out before the body reaches parse_generate.
SPEC_FIELDS = set(
    yaml.safe_load(SPEC.read_text())["components"]["schemas"]["GenerateRequest"]["properties"]
)
FIELDS = sorted(SPEC_FIELDS - {"incremental_streaming_output"}) + ["image_data", "log_metrics"]


def test_the_fields_read_are_the_specified_ones() -> None:
    assert params._FIELDS | {"incremental_streaming_output"} == SPEC_FIELDS


SAMPLING_KEYS = list(SAMPLING_FIELDS) + [
    "sampling_seed",
    "regex",
    "json_schema",
    "x",
]
sampling_dicts = st.dictionaries(st.sampled_from(SAMPLING_KEYS), json_values, max_size=5)
bodies = st.one_of(
    json_values,
    st.fixed_dictionaries(
        {},
        optional={
            **{f: json_values for f in FIELDS},
            "text": st.text(max_size=5) | st.lists(st.text(max_size=3), max_size=3) | json_values,
            "input_ids": st.lists(st.integers(-2, V + 2), max_size=4)
            | st.lists(st.lists(st.integers(-2, V + 2), max_size=3), max_size=3)
            | json_values,
            "sampling_params": sampling_dicts | st.lists(sampling_dicts, max_size=3) | json_values,
            "rid": st.text(max_size=3) | st.lists(st.sampled_from(["a", "b", "c"]), max_size=3),
        },
    ),
)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bodies)
def test_random_bodies_raise_only_request_error(body: Any) -> None:
    try:
        req = gen(body)
    except RequestError as err:
        assert err.status == 400 and err.message
        return
    assert req.items and all(isinstance(i.sampling, SamplingRequest) for i in req.items)
    for item in req.items:
        item.sampling.to_wire(1)  # whatever validated can be put on the wire


@settings(max_examples=500, deadline=None)
@given(sampling_dicts)
def test_random_sampling_params_raise_only_request_error(obj: dict[str, Any]) -> None:
    try:
        p = parse_sampling_params(obj, vocab_size=V)
    except RequestError:
        return
    assert p.params.top_k == -1 or p.params.top_k >= 1
    assert 0.0 < p.params.top_p <= 1.0 and p.n >= 1


valid_sampling = st.fixed_dictionaries(
    {},
    optional={
        "max_new_tokens": st.none() | st.integers(0, 5000),
        "min_new_tokens": st.integers(0, 6000),
        "temperature": st.floats(0, 1e6) | st.integers(0, 3) | st.sampled_from([0.0, 1e-7]),
        "top_p": st.floats(1e-9, 1.0),
        "top_k": st.sampled_from([-1, 1]) | st.integers(1, 2 * V) | st.just(10**30),
        "min_p": st.floats(0, 1),
        "frequency_penalty": st.floats(-2, 2),
        "presence_penalty": st.floats(-2, 2),
        "repetition_penalty": st.floats(1e-9, 2),
        "stop": st.text(min_size=1, max_size=4) | st.lists(st.text(min_size=1), max_size=3),
        "stop_token_ids": st.lists(st.none() | st.integers(0, V - 1), max_size=4),
        "ignore_eos": st.booleans(),
        "no_stop_trim": st.booleans(),
        "skip_special_tokens": st.booleans(),
        "seed": st.integers(-(2**63), 2**63 - 1),
        "logit_bias": st.dictionaries(
            st.integers(0, V - 1).map(str), st.floats(-1e9, 1e9) | st.integers(-100, 100)
        ),
        "n": st.integers(1, 64),
    },
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_sampling | sampling_dicts, st.integers(1, 4000))
def test_whatever_the_frontend_accepts_the_worker_reads_back(
    obj: dict[str, Any], prompt_len: int
) -> None:
    """The two halves of one contract agree: the frontend's 400s cover every limit the
    worker's ``from_wire`` has, and what it sends is on spec (``specs/wire.cddl``)."""
    try:
        p = parse_sampling_params(obj, vocab_size=V)
        max_new = check_lengths(prompt_len, p.max_new_tokens, context_length=8192)
    except RequestError:
        return
    sent = p.to_wire(max_new)
    validate_frame(encode_frame(Submit([SubmitEntry(1, pack_ids([1] * prompt_len), sent, {})])))
    assert SamplingParams.from_wire(sent, vocab_size=V) == p.for_prompt(max_new)
