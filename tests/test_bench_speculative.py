"""bench/speculative.py and its llama-server part, bench/speculative_peer.py: their parts
in memory (the counters it reads, llama-server's flags and its /completion requests and
responses, the same-tokens check), and one tiny run end to end on the bundled model
(slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.apis import RequestSpec
from bench.speculative import (
    PAIRS,
    Acceptance,
    Results,
    SameTokens,
    first_difference,
    main,
    metric_totals,
)
from bench.speculative_peer import LABELS, ngram_flags, probe_body, probe_reading, same_line
from bench.workload import Prompt

METRICS = """\
# HELP lifecycle_spec_draft_tokens_total Tokens speculative decoding proposed.
# TYPE lifecycle_spec_draft_tokens_total counter
lifecycle_spec_draft_tokens_total{model_name="m",worker="0"} 132.0
lifecycle_spec_draft_tokens_total{model_name="m",worker="1"} 8.0
lifecycle_spec_draft_tokens_created{model_name="m",worker="0"} 1.7e9
lifecycle_spec_accepted_tokens_total{model_name="m",worker="0"} 80.0
lifecycle_requests_total 5.0
"""


def test_metric_totals_sum_over_labels_and_skip_other_families() -> None:
    totals = metric_totals(METRICS)
    assert totals["lifecycle_spec_draft_tokens_total"] == 140.0
    assert totals["lifecycle_spec_accepted_tokens_total"] == 80.0
    assert "lifecycle_requests_total" not in totals


def test_acceptance_reads_na_until_reported() -> None:
    acc = Acceptance()
    acc.add(None, None, None)
    assert acc.line() == "n/a"
    acc.add(10, 6, 3)
    acc.add(10.0, 2.0, None)
    assert (acc.proposed, acc.accepted, acc.verify_steps) == (20, 8, 3)
    assert acc.line().startswith("8/20 accepted (40.0 %), 2.67 accepted per verify step")


@pytest.mark.parametrize(
    ("help_text", "flags"),
    [
        (
            "--spec-type [none|ngram-cache|ngram-simple|ngram-map-k]  type\n"
            "--draft-max N  most draft tokens",
            ["--spec-type", "ngram-simple", "--draft-max", "6"],
        ),
        ("--spec-type [none|ngram-map-k]", ["--spec-type", "ngram-map-k"]),
        (  # the llama.cpp of the sdist make bench-peer builds (0.3.36)
            "--spec-type none,draft-simple,ngram-simple,ngram-map-k\n"
            "--spec-ngram-simple-size-n N  ngram size N\n"
            "--spec-ngram-simple-size-m N  ngram size M\n"
            "--draft, --draft-n, --draft-max N  the argument has been removed.",
            [
                "--spec-type",
                "ngram-simple",
                "--spec-ngram-simple-size-n",
                "4",
                "--spec-ngram-simple-size-m",
                "6",
            ],
        ),  # fmt: skip
        ("-md, --model-draft FNAME\n--draft-max N", None),  # a draft model only
    ],
)
def test_llama_server_ngram_flags_from_its_help(help_text: str, flags: list[str] | None) -> None:
    assert ngram_flags(help_text, 6) == flags


def test_llama_server_completion_request_and_its_reading() -> None:
    p = Prompt("hello", 1, 8)
    forced = json.loads(probe_body(p, RequestSpec(api="completions", ignore_eos="flag")))
    assert forced == {"prompt": "hello", "n_predict": 8, "temperature": 0.0, "ignore_eos": True}
    grounded = RequestSpec(api="completions", ignore_eos="off")
    assert "ignore_eos" not in json.loads(probe_body(p, grounded))
    reply = {"content": "hi", "timings": {"draft_n": 10, "draft_n_accepted": 7}}
    assert probe_reading(reply) == ("hi", (10, 7, None))
    assert probe_reading({}) == ("", (None, None, None))


def test_peer_pair_is_checked_and_reported_apart() -> None:
    assert PAIRS[1] == LABELS == ("llama-off", "llama-ngram")
    out = Results()
    out.check("x", {"off": ["a"], "ngram": ["a"], "llama-off": ["b"], "llama-ngram": ["c"]})
    assert (out.same.compared, out.same.mismatches) == (1, [])
    assert out.peer_same.compared == 1 and len(out.peer_same.mismatches) == 1
    assert same_line(out.peer_same) == (
        "llama-server, its own texts without and with its speculation: 1 of 1 differ "
        "(not our promise)"
    )


def test_same_tokens_reports_each_mismatch_where_it_starts() -> None:
    assert first_difference("abc", "abc") == -1
    assert first_difference("abcd", "abXd") == 2
    assert first_difference("ab", "abc") == 2
    same = SameTokens()
    same.check("x", {"off": ["one", "two", None], "ngram": ["one", "twice", "three"]})
    same.check("y", {"off": ["a"], "llama-ngram": ["b"]})  # not its pair: not compared
    assert same.compared == 2
    assert same.mismatches == [{"where": "x", "request": 1, "char": 2, "off": "o", "ngram": "ice"}]


@pytest.mark.slow
@pytest.mark.model
def test_tiny_run_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "spec.json"
    argv = ["--num-requests", "2", "--max-tokens", "32", "--levels", "1", "--reps", "1"]
    assert main([*argv, "--quiet", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "grounded" in printed and "ngram/off" in printed
    assert "greedy texts identical without and with speculation" in printed
    figures = json.loads(out.read_text())
    assert figures["mismatches"] == [] and figures["compared"] >= 4
    assert set(figures["levels"]) == {"grounded", "random"}
