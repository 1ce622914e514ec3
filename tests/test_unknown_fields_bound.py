"""Unknown body fields cannot grow memory, /metrics or the log (issue 54, point 11).

The field names are the client's choice: 200,000 invented names once made 200,000
series (30.8 MB of /metrics), 200,000 warning lines and +53 MiB in the frontend. Now
only the first ``NAMES_KEPT`` names are counted and logged by name; the rest are counted
under ``<where>.(other)`` and summed in one log line at most every ``SUMMARY_EVERY_S``."""

from __future__ import annotations

import logging
import re

import httpx
import pytest

from lifecycle.core import fields
from lifecycle.core.fields import NAME_CHARS, NAMES_KEPT, OTHER, UnknownFields
from lifecycle.testing.pytest_plugin import start_server

# 50,000 distinct names; each body stays under 64 KiB (500 names of 100 characters are
# 53 KB), as bodies past it sometimes stall the frontend today (reported separately).
REQUESTS, PER_REQUEST = 100, 500
METRICS_GROWTH_BOUND = 100_000  # bytes /metrics may grow by, whatever the names


def _names(request: int) -> list[str]:
    """``PER_REQUEST`` names nobody else sends: short ones (within ``NAME_CHARS``, which fill the
    cap) on even requests, 100-character ones on odd requests."""
    if request % 2 == 0:
        return [f"f{request:03d}_{i:04d}" for i in range(PER_REQUEST)]
    return [f"f{request:03d}_{i:04d}_".ljust(100, "x") for i in range(PER_REQUEST)]


def _body(request: int) -> tuple[str, dict[str, object]]:
    """The route and body of request ``request``: mostly /generate, some on completions
    and some on chat, so every ``where`` is bounded alike (an unknown key inside
    ``sampling_params`` is a 400, never counted: issue 56, point 5)."""
    unknown = {name: 1 for name in _names(request)}
    if request % 5 == 3:
        return "/v1/completions", {"prompt": "hi", "max_tokens": 1, **unknown}
    if request % 5 == 4:
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        return "/v1/chat/completions", {**chat, **unknown}
    return "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1}, **unknown}


def _unknown_series(text: str) -> dict[str, float]:
    found = re.findall(r'^lifecycle_unknown_fields_total\{field="([^"]+)"\} (\S+)$', text, re.M)
    return {name: float(v) for name, v in found}


def _rss(text: str) -> float:
    (rss,) = re.findall(r"^lifecycle_process_resident_memory_bytes (\S+)$", text, re.M)
    return float(rss)


def test_50000_unknown_names_leave_metrics_and_log_bounded(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """A real server: /metrics grows by less than ``METRICS_GROWTH_BOUND`` with at most
    ``NAMES_KEPT`` named series plus one ``(other)`` per route, every field still
    counted; the server's log has at most ``NAMES_KEPT`` + 2 unknown-field lines."""
    with start_server("--scripted-worker") as srv, httpx.Client(timeout=60) as client:
        before = client.get(srv.url + "/metrics").text
        for request in range(REQUESTS):
            route, body = _body(request)
            r = client.post(srv.url + route, json=body)
            assert r.status_code == 200, (route, r.text[:300])
        after = client.get(srv.url + "/metrics").text
    log = capfd.readouterr().err.splitlines()
    series = _unknown_series(after)
    named = {k: v for k, v in series.items() if not k.endswith(f".{OTHER}")}
    others = {k: v for k, v in series.items() if k.endswith(f".{OTHER}")}
    print(
        f"/metrics {len(before)} -> {len(after)} bytes; frontend RSS "
        f"{_rss(before) / 2**20:.1f} -> {_rss(after) / 2**20:.1f} MiB; {len(series)} series; "
        f"{len(log)} log lines"
    )
    assert len(after) - len(before) < METRICS_GROWTH_BOUND, len(after) - len(before)
    assert len(named) == NAMES_KEPT, len(named)
    assert set(others) <= {"/generate.(other)", "/v1/completions.(other)",
                           "/v1/chat/completions.(other)"}  # fmt: skip
    assert sum(series.values()) == REQUESTS * PER_REQUEST  # every field is still counted
    unknown_lines = [line for line in log if "unknown field" in line]
    assert len(unknown_lines) <= NAMES_KEPT + 2, len(unknown_lines)
    assert len(log) <= NAMES_KEPT + 10, log[-5:]


def test_the_policy_keeps_no_state_per_name_beyond_the_cap(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """In memory, with a clock: 50,000 names keep ``NAMES_KEPT`` + one key per ``where``;
    the log says each kept name once and the rest in one line per ``SUMMARY_EVERY_S``."""
    now = [0.0]
    policy = UnknownFields(clock=lambda: now[0])
    wheres = ("/generate", "/v1/completions", "/v1/chat/completions")
    with caplog.at_level(logging.WARNING, logger="lifecycle.fields"):
        for i in range(REQUESTS * PER_REQUEST):
            assert policy.accept(wheres[i % 3], f"name{i}")
        assert len(policy.counts) == NAMES_KEPT + len(wheres)
        assert len(caplog.records) == NAMES_KEPT + 1  # the kept names and one summary
        assert "ignored 1 more unknown fields" in caplog.records[-1].getMessage()
        now[0] = fields.SUMMARY_EVERY_S  # a minute on, the next field says the rest
        policy.accept("/generate", "yet-another")
        assert len(caplog.records) == NAMES_KEPT + 2
        said = caplog.records[-1].getMessage()
        assert f"ignored {REQUESTS * PER_REQUEST - NAMES_KEPT} more" in said, said
    assert sum(policy.snapshot().values()) == REQUESTS * PER_REQUEST + 1
    # A kept name is still counted by name, and said once.
    assert policy.counts["/generate.name0"] == 1
    policy.accept("/generate", "name0")
    assert policy.counts["/generate.name0"] == 2


def test_a_long_name_is_never_a_label_nor_a_line_of_its_own(
    caplog: pytest.LogCaptureFixture,
) -> None:
    policy = UnknownFields()
    with caplog.at_level(logging.WARNING, logger="lifecycle.fields"):
        policy.accept("/generate", "x" * (NAME_CHARS + 1))
        policy.accept("/generate", "y" * 1_000_000)
    assert policy.counts == {f"/generate.{OTHER}": 2}
    assert len(caplog.records) == 1 and "x" * (NAME_CHARS + 1) not in caplog.text


def test_strict_fields_still_refuses_and_counts_nothing() -> None:
    policy = UnknownFields(strict=True)
    assert not any(policy.accept("/generate", f"n{i}") for i in range(1_000))
    assert policy.counts == {}
