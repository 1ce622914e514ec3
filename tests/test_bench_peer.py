"""llama-server as the benchmark peer: its command line, where its binary is looked for,
the note when it is absent, the peer choice, and the lines printed beside the table.
None of it needs the binary; ``make bench-peer`` builds that."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bench import llama_server
from bench.compare import print_table
from bench.contenders import resolve_peer
from bench.server_figures import _fresh_prefix_prompts, print_extras

ROOT = Path(__file__).resolve().parent.parent


def _fake_binary(tmp_path: Path) -> Path:
    binary = tmp_path / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    return binary


def test_server_argv_is_the_measured_peer_setup() -> None:
    argv = llama_server.server_argv(Path("/c/bin/llama-server"), "/m/model.gguf", 8282)
    assert argv == [
        "/c/bin/llama-server",
        "--parallel",
        "32",
        "--cont-batching",
        "--ctx-size",
        "32768",
        "--threads",
        "2",
        "--threads-batch",
        "2",
        "--host",
        "127.0.0.1",
        "--port",
        "8282",
        "-m",
        "/m/model.gguf",
    ]


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"LIFECYCLE_PEER_CACHE": "/p", "XDG_CACHE_HOME": "/x", "HOME": "/h"}, "/p"),
        ({"XDG_CACHE_HOME": "/x", "HOME": "/h"}, "/x/lifecycle/llama-server"),
        ({"LIFECYCLE_PEER_CACHE": "", "HOME": "/h"}, "/h/.cache/lifecycle/llama-server"),
    ],
)
def test_cache_dir_follows_the_build_script(env: dict[str, str], expected: str) -> None:
    assert llama_server.cache_dir(env) == Path(expected)
    assert llama_server.binary_path(None, env) == Path(expected) / "bin" / "llama-server"
    assert llama_server.binary_path("/elsewhere/ls", env) == Path("/elsewhere/ls")


def test_skip_note_names_the_make_target(tmp_path: Path) -> None:
    absent = tmp_path / "bin" / "llama-server"
    note = llama_server.skip_note(absent)
    assert note is not None and "make bench-peer" in note and str(absent) in note
    binary = _fake_binary(tmp_path)
    assert llama_server.skip_note(binary) is None
    binary.chmod(0o644)  # there but not executable: as good as absent
    assert llama_server.skip_note(binary) is not None


def test_resolve_peer(tmp_path: Path) -> None:
    absent = tmp_path / "nothing"
    assert resolve_peer("auto", absent) == ("llama-cpp-python", None)
    assert resolve_peer("llama-cpp-python", absent) == ("llama-cpp-python", None)
    peer, note = resolve_peer("llama-server", absent)
    assert peer is None and note is not None and "make bench-peer" in note
    binary = _fake_binary(tmp_path)
    assert resolve_peer("auto", binary) == ("llama-server", None)
    assert resolve_peer("llama-server", binary) == ("llama-server", None)


def test_fresh_prefix_prompts_never_share_a_first_token() -> None:
    prompts = _fresh_prefix_prompts(8, 500, seed=3)
    heads = {str(p.prompt).split(" ", 1)[0] for p in prompts}
    assert len(heads) == 8 and all(h.startswith("[") and h.endswith("]") for h in heads)
    assert all(p.output_len == 1 and p.prompt_len == 500 for p in prompts)
    again = _fresh_prefix_prompts(8, 500, seed=3)
    assert not {str(p.prompt) for p in prompts} & {str(p.prompt) for p in again}


def test_steal_above_the_limit_is_flagged(capsys: pytest.CaptureFixture[str]) -> None:
    row = {"completed": 4, "failed": 0, "foreign_cpu_pct": 1.0, "output_tok_s": 100.0}
    summary = {1: {"ours": {**row, "rep_steal_pct": [0.5, 12.0]}, "llama-server": row}}
    print_table(summary, ["ours", "llama-server"], frontend=False)
    out = capsys.readouterr().out
    assert "c=1: ours 0.5/12.0" in out
    assert "NOT COMPARABLE: c=1 ours rep 2 ran with 12.0 % steal" in out
    assert "llama-server rep" not in out


def test_extras_print_ttft_ratio_and_rss(capsys: pytest.CaptureFixture[str]) -> None:
    ttft = {
        "ours": {"median_ms": 1000.0, "samples_ms": [1000.0], "rep_steal_pct": [0.0]},
        "llama-server": {"median_ms": 2000.0, "samples_ms": [2000.0], "rep_steal_pct": [11.0]},
    }
    rss = {"ours": {"worker": 512.4, "frontend": None}, "llama-server": {"process": 1024.0}}
    print_extras(ttft, rss, 500)
    out = capsys.readouterr().out
    assert "500-token prompt with a fresh prefix" in out
    assert "ours 1000, llama-server 2000; ours/llama-server 0.50" in out
    assert "NOT COMPARABLE: the TTFT of llama-server" in out
    assert "ours worker 512 (frontend -), llama-server 1024" in out


def test_build_script_does_nothing_when_the_binary_is_there(tmp_path: Path) -> None:
    binary = _fake_binary(tmp_path)
    run = subprocess.run(
        [str(ROOT / "tools" / "build_llama_server.sh")],
        env={"LIFECYCLE_PEER_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"llama-server is already built: {binary}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin"]  # nothing downloaded


def test_a_baseline_commit_gets_its_own_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    """--baseline-rev adds ``base`` (ours at an older commit) beside the peer: the table
    prints ours over each of them."""
    row = {"completed": 4, "failed": 0, "foreign_cpu_pct": 1.0, "rep_steal_pct": [0.0]}
    summary = {
        1: {
            "ours": {**row, "output_tok_s": 150.0},
            "llama-server": {**row, "output_tok_s": 100.0},
            "base": {**row, "output_tok_s": 120.0},
        }
    }
    print_table(summary, ["ours", "llama-server", "base"], frontend=False)
    out = capsys.readouterr().out
    assert "ours/llama-server" in out and "ours/base" in out
    assert "1.50" in out and "1.25" in out


def test_the_baseline_tree_is_the_commit_unpacked() -> None:
    from bench.contenders import baseline_tree

    tree = baseline_tree("HEAD")
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    assert tree.name == f"lifecycle-baseline-{head.stdout.strip()[:12]}"
    shown = subprocess.run(
        ["git", "show", "HEAD:bench/compare.py"], capture_output=True, text=True, check=True
    ).stdout
    assert (tree / "bench" / "compare.py").read_text() == shown
