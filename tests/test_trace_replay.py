"""Replay from the trace (docs/replay.md): ``serve --trace-prompts`` records what reruns a
finished request, ``lifecycle trace replay`` and ``POST /debug/requests/{key}/replay``
rerun it and say whether the tokens are the same or where they part.

Real servers with real workers on the default model: one started here with the default
(quantized) weights and ``--trace-prompts``, and the session's fp32 server
(``model_server``, no ``--trace-prompts``) for the flag off and for a weights mode that
differs. Bitwise equality is the claim for the default weights: a request recorded
alone, or while other streams ran beside it, replays identical alone.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from lifecycle.cli import main
from lifecycle.core.sampling import parse_sampling_params
from lifecycle.tracing.replay import sampling_json
from lifecycle.tracing.store import read_log
from tests.native_mode import cpu_default_weights, needs_native
from tests.scripted import free_port, lifecycle_server

pytestmark = pytest.mark.model

ROOT = Path(__file__).resolve().parent.parent
VALIDATOR = jsonschema.Draft202012Validator(
    json.loads((ROOT / "specs" / "trace.schema.json").read_text())
)
# Parts from the fp32 weights early (at token 5 on the CPUs measured) when run greedy.
PROMPT = "The capital of France is"
GREEDY = {"max_new_tokens": 16, "temperature": 0}


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A server on the default weights that records prompts: (URL, its trace log)."""
    log = tmp_path_factory.mktemp("replay") / "traces.jsonl"
    args = ("--device", "cpu", "--trace-prompts", "--trace-log", str(log))
    with lifecycle_server(*args) as url:
        yield url, log


def _generate(url: str, body: dict[str, Any]) -> Any:
    r = httpx.post(f"{url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _logged(log: Path, rid: str) -> dict[str, Any]:
    """``rid``'s line of the trace log, once the tracer's tick has flushed it."""
    deadline = time.monotonic() + 10
    while True:
        found = [t for t in read_log(log) if t["rid"] == rid] if log.exists() else []
        if found:
            return found[-1]
        assert time.monotonic() < deadline, f"{rid} never reached {log}"
        time.sleep(0.05)


def _replay_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(["trace", "replay", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture(scope="module")
def greedy(recording: tuple[str, Path]) -> tuple[dict[str, Any], dict[str, Any]]:
    """One greedy request on the recording server, alone: (its reply, its trace)."""
    url, _ = recording
    reply = _generate(url, {"text": PROMPT, "rid": "greedy-1", "sampling_params": GREEDY})
    trace = httpx.get(f"{url}/debug/requests/greedy-1", timeout=10).json()
    return reply, trace


def test_the_flag_off_records_no_ids_and_replay_says_so(
    model_server: str, capsys: pytest.CaptureFixture[str]
) -> None:
    reply = _generate(model_server, {"text": PROMPT, "rid": "off-1", "sampling_params": GREEDY})
    trace = httpx.get(f"{model_server}/debug/requests/off-1", timeout=10).json()
    assert trace["state"] == "done" and "replay" not in trace
    text = json.dumps(trace)
    assert json.dumps(reply["output_ids"])[1:-1] not in text  # no output ids anywhere
    assert "prompt_ids" not in text and "output_ids" not in text

    rc, out, err = _replay_cli(capsys, "off-1", "--url", model_server)
    assert rc == 2 and out == ""
    assert "has no recorded prompt" in err and "--trace-prompts" in err

    r = httpx.post(f"{model_server}/debug/requests/off-1/replay", timeout=30)
    assert r.status_code == 409 and "--trace-prompts" in r.json()["error"]["message"]


def test_what_the_trace_records(
    recording: tuple[str, Path], greedy: tuple[dict[str, Any], dict[str, Any]]
) -> None:
    url, log = recording
    reply, trace = greedy
    record = trace["replay"]
    assert record["output_ids"] == [reply["output_ids"]] and len(reply["output_ids"]) == 16
    assert len(record["prompt_ids"]) == reply["meta_info"]["prompt_tokens"]
    sp = record["sampling_params"]
    assert (sp["max_new_tokens"], sp["temperature"], sp["top_k"], sp["seed"], sp["n"]) == (
        16, 1.0, 1, None, 1,
    )  # fmt: skip
    info = httpx.get(f"{url}/server_info", timeout=10).json()
    model = record["model"]
    assert model["weights"] == cpu_default_weights() and model["path"] == info["model_path"]
    assert model["file_bytes"] == Path(info["model_path"]).stat().st_size
    assert model["id"] == httpx.get(f"{url}/model_info", timeout=10).json()["served_model_name"]
    line = _logged(log, "greedy-1")
    VALIDATOR.validate(line)
    assert line["replay"] == record


def test_a_greedy_request_replays_identical(
    recording: tuple[str, Path],
    greedy: tuple[dict[str, Any], dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    url, _ = recording
    rc, out, err = _replay_cli(capsys, "greedy-1", "--url", url)
    assert (rc, err) == (0, "") and "warning" not in out
    assert out.strip() == f"request {greedy[1]['id']} (rid greedy-1): identical (16 tokens)"

    r = httpx.post(f"{url}/debug/requests/greedy-1/replay", timeout=120)
    assert r.status_code == 200, r.text
    report = r.json()
    assert report["identical"] is True and report["parted_at"] is None
    assert report["replayed_ids"] == report["recorded_ids"] == [greedy[0]["output_ids"]]
    assert report["warnings"] == [] and report["model"]["now"] == report["model"]["recorded"]


def test_a_request_that_ran_under_load_replays_identical(
    recording: tuple[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """Recorded while six sampled streams shared its steps (other batches, prompt chunks
    beside its decodes), replayed alone: the same tokens."""
    url, _ = recording
    others = [
        {"text": f"Story number {i}: once upon a time", "sampling_params":
         {"max_new_tokens": 40, "temperature": 0.9, "ignore_eos": True}}
        for i in range(6)
    ]  # fmt: skip
    body = {"text": "Write three facts about the moon.", "rid": "loaded-1",
            "sampling_params": {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}}  # fmt: skip
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(_generate, url, b) for b in others[:3]]
        time.sleep(0.2)  # the others are decoding when it arrives
        mine = pool.submit(_generate, url, body)
        futures += [pool.submit(_generate, url, b) for b in others[3:]]
        for f in futures:
            f.result()
        reply = mine.result()
    assert len(reply["output_ids"]) == 32
    rc, out, err = _replay_cli(capsys, "loaded-1", "--url", url)
    assert (rc, err) == (0, ""), out
    assert out.strip().endswith("identical (32 tokens)")


def test_a_seeded_sampled_request_with_n_replays_identical(
    recording: tuple[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    url, _ = recording
    sampling = {"max_new_tokens": 12, "temperature": 0.8, "seed": 7, "n": 2}
    replies = _generate(
        url, {"text": "Once upon a time", "rid": "seeded", "sampling_params": sampling}
    )
    assert replies[0]["output_ids"] != replies[1]["output_ids"]  # seed, seed + 1
    # One prompt with n > 1 is a batch of one: its rid is "seeded_0" (SGLang's rule).
    rc, out, err = _replay_cli(capsys, "seeded_0", "--url", url, "--json")
    assert err == ""
    report = json.loads(out)
    assert rc == 0 and report["identical"] is True
    assert report["replayed_ids"] == [r["output_ids"] for r in replies]


def test_a_different_continuation_reports_where_it_parts(
    recording: tuple[str, Path],
    greedy: tuple[dict[str, Any], dict[str, Any]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The recorded ids edited at token 3: the replay must part there, with the new run's
    logprobs of both candidates (its own, the argmax, at least the recorded one's)."""
    url, log = recording
    line = _logged(log, "greedy-1")
    real = list(line["replay"]["output_ids"][0])
    forced = (real[3] + 1) % 1000
    line["replay"]["output_ids"][0][3] = forced
    edited = tmp_path / "edited.jsonl"
    edited.write_text(json.dumps(line) + "\n")

    rc, out, err = _replay_cli(capsys, "greedy-1", "--log", str(edited), "--url", url, "--json")
    assert (rc, err) == (1, "")
    report = json.loads(out)
    assert (report["parted_at"], report["sample"]) == (3, 0)
    assert (report["recorded"], report["replayed"]) == (forced, real[3])
    lp = report["logprobs"]
    assert isinstance(lp["recorded"], float) and isinstance(lp["replayed"], float)
    assert lp["replayed"] >= lp["recorded"] and lp["top"][0][1] == real[3]
    assert report["warnings"] == []

    rc, out, _ = _replay_cli(capsys, "greedy-1", "--log", str(edited), "--url", url)
    assert rc == 1 and "parted at token 3" in out
    assert f"recorded {forced} " in out and f"replayed {real[3]} " in out


@needs_native("without the native kernels both servers run dense fp32: nothing parts")
def test_another_weights_mode_parts_and_warns(
    recording: tuple[str, Path],
    greedy: tuple[dict[str, Any], dict[str, Any]],
    model_server: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Recorded on the quantized weights, replayed on the fp32 server: the weights-mode
    warning, and the parting point with both candidates' logprobs."""
    _, log = recording
    _logged(log, "greedy-1")
    rc, out, err = _replay_cli(capsys, "greedy-1", "--log", str(log), "--url", model_server)
    assert (rc, err) == (1, ""), out
    assert "warning: weights mode differs: recorded 'quantized', the server now has 'dense'" in out
    rc, out, _ = _replay_cli(capsys, "greedy-1", "--log", str(log), "--url", model_server, "--json")
    report = json.loads(out)
    i = report["parted_at"]
    recorded, replayed = report["recorded_ids"][0], report["replayed_ids"][0]
    assert recorded[:i] == replayed[:i] and recorded[i] != replayed[i]
    assert (report["recorded"], report["replayed"]) == (recorded[i], replayed[i])
    lp = report["logprobs"]
    assert isinstance(lp["recorded"], float) and lp["replayed"] >= lp["recorded"]
    assert report["model"]["now"]["weights"] == "dense"


def test_what_cannot_be_replayed_is_an_error(
    recording: tuple[str, Path], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    url, _ = recording
    rc, out, err = _replay_cli(capsys, "no-such-rid", "--url", url)
    assert (rc, out) == (2, "") and "no request 'no-such-rid'" in err
    r = httpx.post(f"{url}/debug/requests/no-such-rid/replay", timeout=10)
    assert r.status_code == 404
    rc, _, err = _replay_cli(capsys, "1", "--url", f"http://127.0.0.1:{free_port()}")
    assert rc == 2 and "refused" in err.lower()
    missing = tmp_path / "none.jsonl"
    missing.write_text("")
    rc, _, err = _replay_cli(capsys, "greedy-1", "--log", str(missing), "--url", url)
    assert rc == 2 and f"no request 'greedy-1' in {missing}" in err


@pytest.mark.parametrize(
    "params",
    [
        {},
        {"temperature": 0, "max_new_tokens": 8},
        {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 3, "n": 3},
        {"max_new_tokens": None, "stop": ["\n", "."], "stop_token_ids": [2, 7], "ignore_eos": True},
        {"logit_bias": {"5": -2.5}, "min_new_tokens": 2, "repetition_penalty": 1.1,
         "regex": "[a-z]+", "skip_special_tokens": False, "no_stop_trim": True},
    ],
)  # fmt: skip
def test_recorded_sampling_params_validate_to_the_same(params: dict[str, Any]) -> None:
    sr = parse_sampling_params(params, vocab_size=1000)
    assert parse_sampling_params(sampling_json(sr), vocab_size=1000) == sr
