"""Every start-up mistake is one line and exit 2, before listening (issue 53, point 2).

Each case runs ``lifecycle serve`` as a real process: its stderr is one line that names
the option (and, for a choice, the values it takes), its status is 2, it never logged
``listening on`` (the port was never bound) and no worker of it is left running. Then a
worker that refuses at start-up, and one that fails the same way twice, end ``serve``
the same way, the port never bound; and the Engine refuses the same values by name."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest

from tests.scripted import ROOT, free_port

pytestmark = pytest.mark.timeout(120)


_MARK = "LIFECYCLE_TEST_STARTUP_MARK"  # in the environment of every process a case starts


def _serve(*args: str, port: int | None = None) -> subprocess.CompletedProcess[str]:
    """``lifecycle serve`` to its end; then no process it started (its environment
    carries this case's mark) may be left running."""
    mark = uuid.uuid4().hex
    argv = [sys.executable, "-m", "lifecycle", "serve", "--port", str(port or free_port())]
    r = subprocess.run(
        [*argv, *args], cwd=ROOT, capture_output=True, text=True, timeout=90, check=False,
        env={**os.environ, _MARK: mark},
    )  # fmt: skip
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.environ().get(_MARK) == mark:
                pytest.fail(f"left running: {' '.join(p.info['cmdline'] or [])}")
        except psutil.Error:
            continue  # gone, or not ours to read
    return r


def _torch_is_cpu_build() -> bool:
    from importlib.metadata import version

    return "+cpu" in version("torch")


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--weights", "q5"], ["--weights", "q5", "auto, quantized, fp32, q8_0, q4_0"]),
        (["--kv-cache-dtype", "int8"], ["--kv-cache-dtype", "auto, fp16, bf16, fp32"]),
        (["--device", "gpu"], ["--device", "cpu, cuda or cuda:N"]),
        (["--dtype", "fp8"], ["--dtype", "fp8", "fp32, float32, bf16"]),
        (["--max-running", "0"], ["--max-running", "at least 1"]),
        (["--max-pending", "-3"], ["--max-pending", "at least 1"]),
        (["--kv-cache-tokens", "0"], ["--kv-cache-tokens", "at least 1"]),
        (["--threads", "0"], ["--threads", "at least 1"]),
        (["--tp", "0"], ["--tp", "at least 1"]),
        (["--context-length", "0"], ["--context-length", "at least 1"]),
        (["--port", "99999"], ["--port", "at most 65535"]),
        (["--frontends", "0"], ["--frontends", "at least 1"]),
        (["--max-running", "many"], ["--max-running", "expected an integer, got 'many'"]),
        (["--mem-fraction", "1.5"], ["--mem-fraction", "at most 1"]),
        (["--router-policy", "random"], ["--router-policy", "round_robin, least_load"]),
        (["--log-level", "loud"], ["--log-level", "debug, info"]),
        (["--kv-cache-tokens", "64", "--kv-memory-mib", "64"], ["--kv-memory-mib", "not both"]),
        (["--device", "cpu", "--decode-graphs", "on"], ["CUDA graphs need a CUDA device"]),
    ],
)
def test_a_wrong_value_is_one_line_and_exit_2(args: list[str], says: list[str]) -> None:
    r = _serve(*args)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    for words in says:
        assert words in lines[0], lines[0]
    assert "listening on" not in r.stderr and r.stdout == ""


@pytest.mark.skipif(not _torch_is_cpu_build(), reason="torch here is built with CUDA")
def test_cuda_on_a_cpu_build_of_torch_is_one_line_before_the_worker() -> None:
    r = _serve("--device", "cuda")
    assert r.returncode == 2
    assert (
        r.stderr.strip().splitlines() == [r.stderr.strip()]
        and "--device cuda: this torch" in r.stderr
    )
    assert "built without CUDA" in r.stderr and "use --device cpu" in r.stderr


def test_a_port_in_use_is_one_line_before_the_worker() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        r = _serve("--scripted-worker", port=port)
    assert r.returncode == 2
    assert r.stderr.strip() == (
        f"error: --port {port}: cannot listen on 127.0.0.1:{port}: Address already in use"
    )


def test_a_worker_that_refuses_its_options_ends_serve_before_it_listens() -> None:
    """The worker listens before its model loads; serve binds only once it does, so a
    worker that refuses what it was given (status 2) leaves nothing bound."""
    r = _serve("--worker-args", "--bogus-flag 1")
    assert r.returncode == 2, r.stderr
    assert "gpu.worker: error: unrecognized arguments: --bogus-flag 1" in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: the worker refused")
    assert "listening on http" not in r.stderr


def test_a_worker_failing_twice_the_same_way_at_start_is_not_restarted_forever(
    tmp_path: Path,
) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps([{"point": "worker.start", "action": "raise"}]))
    r = _serve("--scripted-worker", "--faults", str(plan), "--restart-backoff", "0.1")
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last == "error: the worker exited with status 1 at start-up twice in a row", last
    assert r.stderr.count("starting worker") == 2  # one restart, then it gave up
    assert "listening on http" not in r.stderr


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"max_running": 0}, "'max_running': must be at least 1, got 0"),
        ({"weights": "q5"}, "'weights': invalid choice 'q5'"),
        ({"device": "gpu"}, "'device': invalid value 'gpu' (expected cpu, cuda or cuda:N)"),
        ({"threads": 0}, "'threads': must be at least 1"),
    ],
)
def test_the_engine_refuses_the_same_values(kwargs: dict[str, object], says: str) -> None:
    from lifecycle.option_args import engine_values

    with pytest.raises(ValueError, match="Engine\\(\\) option") as exc:
        engine_values(None, kwargs)
    assert says in str(exc.value)


def test_a_config_file_value_is_checked_as_the_flag(tmp_path: Path) -> None:
    path = tmp_path / "serve.toml"
    path.write_text('weights = "q5"\n')
    r = _serve("--config", str(path))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "weights" in r.stderr and "q5" in r.stderr and "auto, quantized" in r.stderr


def test_a_launchers_worker_that_refuses_ends_it_before_a_frontend_listens() -> None:
    """``serve --frontends 2``: the launcher starts the frontends once its workers listen;
    a worker that refuses its options (status 2) is not started again in a loop."""
    r = _serve("--frontends", "2", "--worker-args", "--bogus-flag 1")
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("gpu.worker: error: unrecognized arguments: --bogus-flag 1") == 1
    assert "frontend 0 started" not in r.stderr and "listening on http" not in r.stderr
