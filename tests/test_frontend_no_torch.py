"""The frontend never loads torch (docs: README "Installing"): ``lifecycle serve`` on the
scripted worker, after it answered /health and one /generate, has imported no ``torch``
module and mapped no torch library.

Two witnesses, each of which sees lazy imports too, not only the ones at start-up:
``python -X importtime`` writes one stderr line for every module the process imports, at
the moment it imports it, and ``/proc/PID/maps`` lists every shared object the running
process has loaded (torch's ``_C`` extension, ``libtorch*``, ``libc10``). The control test
runs both on a process that does import torch, so a witness that went blind fails."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

import httpx
import pytest

from wire.child import stop_process

ROOT = Path(__file__).resolve().parent.parent

__all__ = ["Served", "generate_once", "serve_process", "torch_imports", "torch_libraries"]

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/PID/maps"),
]

# "import time:   self [us] | cumulative |   module" (python -X importtime, nested names
# indented); a torch submodule counts as much as torch itself.
_IMPORT_LINE = re.compile(r"^import time:\s*\d+\s*\|\s*\d+\s*\|\s*(\S+)\s*$", re.M)
# What the torch wheel maps: torch/_C*.so, torch/lib/libtorch*.so and libc10*.so, and the
# vendored libraries in torch.libs/.
_TORCH_LIBRARY = re.compile(r"/torch/|/torch\.libs/|libtorch|libc10")
_LISTENING = re.compile(r"listening on http://[^:\s]+:(\d+)")


def torch_imports(stderr: str) -> list[str]:
    """The torch modules a ``-X importtime`` log shows were imported."""
    names = _IMPORT_LINE.findall(stderr)
    return [n for n in names if n == "torch" or n.startswith("torch.")]


def torch_libraries(pid: int) -> list[str]:
    """torch's shared objects mapped into the process ``pid`` now."""
    paths = {line.split()[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines()}
    return sorted(p for p in paths if p.startswith("/") and _TORCH_LIBRARY.search(p))


@dataclass(frozen=True, slots=True)
class Served:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@contextmanager
def serve_process(
    argv: Sequence[str], log: Path, *, cwd: Path = ROOT, env: dict[str, str] | None = None
) -> Iterator[Served]:
    """Run a ``lifecycle serve ... --port 0`` command line, its stdout and stderr into
    ``log``; yields once the port it logged answers /health with 200."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        url = _wait_healthy(proc, log, deadline=time.monotonic() + 90)
        yield Served(proc, url, log)
    finally:
        stop_process(proc)


def _wait_healthy(proc: subprocess.Popen[bytes], log: Path, deadline: float) -> str:
    url = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()}")
        if url is None and (m := _LISTENING.search(log.read_text(errors="replace"))):
            url = f"http://127.0.0.1:{m.group(1)}"
        if url is not None:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return url
            except httpx.TransportError:
                pass
        time.sleep(0.05)
    raise RuntimeError(f"server not healthy in time:\n{log.read_text(errors='replace')}")


def generate_once(url: str, text: str = "hello world") -> dict[str, object]:
    r = httpx.post(
        url + "/generate",
        timeout=30,
        json={"text": text, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["meta_info"]["completion_tokens"] == 4, body
    return body


def test_serving_frontend_imports_and_maps_no_torch(tmp_path: Path) -> None:
    argv = [sys.executable, "-X", "importtime", "-m", "lifecycle", "serve"]
    argv += ["--scripted-worker", "--port", "0"]
    with serve_process(argv, tmp_path / "serve.log") as served:
        generate_once(served.url)
        assert httpx.get(served.url + "/v1/models", timeout=10).status_code == 200
        libraries = torch_libraries(served.proc.pid)
        log = served.log_text()
    assert len(_IMPORT_LINE.findall(log)) > 100, "no -X importtime log: the witness is blind"
    assert "lifecycle.app" in _IMPORT_LINE.findall(log)
    assert torch_imports(log) == []
    assert libraries == []


@pytest.mark.skipif(find_spec("torch") is None, reason="torch not installed (the control)")
def test_control_both_witnesses_see_a_process_that_imports_torch(tmp_path: Path) -> None:
    script = "import sys, torch; print('ready', flush=True); sys.stdin.read()"
    log = tmp_path / "importtime.log"
    with open(log, "wb") as err:  # a file: torch's import log overfills a pipe
        proc = subprocess.Popen(
            [sys.executable, "-X", "importtime", "-c", script],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
        )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        libraries = torch_libraries(proc.pid)
    finally:
        proc.communicate(b"", timeout=30)
    assert "torch" in torch_imports(log.read_text())
    assert any("_C" in p for p in libraries) and any("libtorch" in p for p in libraries)


# An Engine that served a generation, a chat, a batch file of OpenAI lines (the three
# URLs) and /server_info, then listed what it imported.
_ENGINE_SCRIPT = """
import json, sys, tempfile
from pathlib import Path
from lifecycle.engine import Engine
with Engine(scripted_worker=True) as e, tempfile.TemporaryDirectory() as tmp:
    out = e.generate("hi", {"max_new_tokens": 2, "ignore_eos": True})
    assert out["meta_info"]["completion_tokens"] == 2, out
    chat = e.chat([{"role": "user", "content": "hi"}], {"max_new_tokens": 2})
    lines = [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 2}),
             ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
             ("/v1/embeddings", {"input": "hi"})]
    inp, res = Path(tmp, "in.jsonl"), Path(tmp, "out.jsonl")
    inp.write_text("".join(json.dumps({"url": u, "body": b}) + "\\n" for u, b in lines))
    summary = e.run_batch(inp, res, progress=False)
    assert summary.ok == 3, res.read_text()
    assert e.server_info()["live_requests"] == 0
loaded = [m for m in sys.modules if m.split(".")[0] in ("transport", "torch")
          or m.startswith("lifecycle.api")]
print(json.dumps(loaded))
"""


def test_the_engine_imports_no_http_code() -> None:
    """Issue 38: ``lifecycle/engine`` is the runtime without HTTP, so importing it, and
    an Engine that starts, generates, chats, answers OpenAI batch lines and
    ``server_info`` (issue 57), load neither the transport nor the HTTP faces
    (``lifecycle.api``), nor torch (the worker is another process)."""
    bare = subprocess.run(
        [sys.executable, "-c", "import sys, lifecycle.engine; print(sorted(sys.modules))"],
        capture_output=True, text=True, check=True, cwd=ROOT,
    )  # fmt: skip
    mods = bare.stdout.split("'")
    assert "lifecycle.engine" in mods
    assert not [m for m in mods if m.startswith(("transport", "lifecycle.api", "torch"))]
    ran = subprocess.run(
        [sys.executable, "-c", _ENGINE_SCRIPT], capture_output=True, text=True, cwd=ROOT,
        timeout=90,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert json.loads(ran.stdout.strip().splitlines()[-1]) == []
