"""What the request-parsing tests share: the vocabulary and short parse calls."""

from __future__ import annotations

from typing import Any

import pytest

from lifecycle.core.params import (
    GenerateRequest,
    RequestError,
    SamplingRequest,
    parse_generate,
    parse_sampling_params,
)
from lifecycle.core.states import Cause

V = 49152  # SmolLM2's vocabulary size


def sp(**kw: Any) -> SamplingRequest:
    return parse_sampling_params(kw, vocab_size=V)


def gen(body: Any) -> GenerateRequest:
    return parse_generate(body, vocab_size=V)


def message_of(fn: Any, *args: Any, cause: Cause = Cause.INVALID) -> str:
    with pytest.raises(RequestError) as err:
        fn(*args)
    assert err.value.status == 400 and err.value.cause is cause
    return err.value.message
