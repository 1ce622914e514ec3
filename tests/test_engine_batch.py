"""``lifecycle batch``: a JSONL file through an Engine (a real CLI process on the scripted
worker); cut with SIGKILL half-way and rerun, every line is answered exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from lifecycle.engine.batch import done_lines

ROOT = Path(__file__).resolve().parent.parent


def _batch(
    inp: Path, out: Path, *extra: str, stderr: object = subprocess.PIPE
) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "lifecycle", "batch", str(inp), str(out), "--no-progress",
            "--scripted-worker", *extra]  # fmt: skip
    return subprocess.Popen(argv, cwd=ROOT, stderr=stderr, text=True,  # type: ignore[call-overload]
                            start_new_session=True)  # fmt: skip


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_cut_half_way_and_rerun_answers_each_line_once(tmp_path: Path) -> None:
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    with open(inp, "w") as f:
        for i in range(200):
            if i % 4 == 0:
                body = {"model": "default", "max_tokens": 8,
                        "messages": [{"role": "user", "content": f"question {i}"}]}  # fmt: skip
                line = {"custom_id": f"req-{i}", "method": "POST",
                        "url": "/v1/chat/completions", "body": body}  # fmt: skip
            else:
                line = {"custom_id": f"req-{i}", "text": f"prompt {i}",
                        "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}  # fmt: skip
            f.write(json.dumps(line) + "\n")
    # 8 tokens at 25 ms a step, 4 running: about 10 s for the whole file
    slow = ("--worker-args", "--step-delay 0.025", "--max-running", "4", "--max-pending", "4")
    log = open(tmp_path / "first.log", "w")  # noqa: SIM115
    first = _batch(inp, out, *slow, stderr=log)
    deadline = time.monotonic() + 60
    while not out.exists() or len(out.read_bytes().splitlines()) < 80:
        assert first.poll() is None, (tmp_path / "first.log").read_text()
        assert time.monotonic() < deadline, "the first run wrote too little"
        time.sleep(0.02)
    os.killpg(first.pid, signal.SIGKILL)  # the CLI and its worker, mid-run
    first.wait()
    log.close()
    cut = _lines(out) if out.read_bytes().endswith(b"\n") else None
    written = len(done_lines(out))  # drops a torn last line, as the rerun does
    assert 80 <= written < 200, written
    if cut is not None:
        assert len(cut) == written

    second = _batch(inp, out)
    _, err = second.communicate(timeout=120)
    assert second.returncode == 0, err
    assert "200 lines" not in err and f"{written} skipped" in err, err
    records = _lines(out)
    counts = Counter(r["line"] for r in records)
    assert sorted(counts) == list(range(1, 201)) and set(counts.values()) == {1}
    for r in records:
        assert r["custom_id"] == f"req-{r['line'] - 1}"  # lines count from 1
        if (r["line"] - 1) % 4 == 0:
            assert r["response"]["status_code"] == 200, r
            body = r["response"]["body"]
            assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] > 0
        else:
            assert r["result"]["meta_info"]["completion_tokens"] == 8, r


def test_bad_lines_get_an_error_line_and_the_rest_run(tmp_path: Path) -> None:
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(
        "\n".join(
            [
                json.dumps({"text": "ok", "sampling_params": {"max_new_tokens": 2}}),
                json.dumps({"text": "bad", "sampling_params": {"temperature": -1}}),
                "{not json",
                json.dumps({"url": "/v1/chat/completions", "body": {"messages": "nope"}}),
                json.dumps({"url": "/v1/embeddingz", "body": {}}),
                "",
                json.dumps({"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3}}),
                json.dumps(
                    {
                        "custom_id": "e",
                        "method": "POST",
                        "url": "/v1/embeddings",
                        "body": {"model": "default", "input": ["one", "two"]},
                    }
                ),
            ]
        )
        + "\n"
    )
    run = _batch(inp, out)
    _, err = run.communicate(timeout=60)
    assert run.returncode == 1, err  # some lines failed
    by_line = {r["line"]: r for r in _lines(out)}
    # numbered from 1 as an editor shows them (issue 40: line 5 was reported as 4)
    assert sorted(by_line) == [1, 2, 3, 4, 5, 7, 8]  # the blank line 6 is no request
    assert by_line[1]["result"]["meta_info"]["completion_tokens"] == 2
    assert by_line[2]["error"]["cause"] == "invalid" and by_line[2]["error"]["status"] == 400
    assert "temperature" in by_line[2]["error"]["message"]
    assert "line 3 is not JSON" in by_line[3]["error"]["message"]
    assert by_line[4]["response"]["status_code"] == 400
    assert "error" in by_line[4]["response"]["body"]
    assert by_line[5]["response"]["status_code"] == 400
    assert by_line[7]["result"]["meta_info"]["prompt_tokens"] == 3
    # OpenAI's Batch API takes /v1/embeddings lines: the route's reply, in input order
    emb = by_line[8]["response"]
    assert emb["status_code"] == 200 and by_line[8]["custom_id"] == "e", emb
    assert emb["body"]["object"] == "list" and [d["index"] for d in emb["body"]["data"]] == [0, 1]
    assert len(emb["body"]["data"][0]["embedding"]) == 576
    assert "4 failed" in err, err
