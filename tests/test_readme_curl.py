"""Every curl command in README.md works as printed: run with the real ``curl`` against a
live server (scripted worker), only the documented port substituted; each must answer
200 with valid JSON, or an SSE stream of JSON events ending in ``[DONE]``."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from .scripted import lifecycle_server

README = Path(__file__).resolve().parent.parent / "README.md"
DOCUMENTED = "localhost:30000"


def readme_curls() -> list[str]:
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", README.read_text(), re.S | re.M)
    return [line.strip() for b in blocks for line in b.splitlines() if line.startswith("curl ")]


@pytest.fixture(scope="module")
def host() -> Iterator[str]:
    with lifecycle_server("--scripted-worker") as url:
        yield url.removeprefix("http://")


def test_readme_has_the_documented_examples() -> None:
    text = "\n".join(readme_curls())
    for path in ("/generate", "/v1/completions", "/v1/chat/completions", "/v1/models"):
        assert f"{DOCUMENTED}{path}" in text
    assert all(DOCUMENTED in c for c in readme_curls())


def _check_body(body: str) -> None:
    if not body.startswith("data: "):
        json.loads(body)
        return
    events = [e.removeprefix("data: ") for e in body.strip().split("\n\n")]
    assert events[-1] == "[DONE]", body
    for event in events[:-1]:
        assert "error" not in json.loads(event), event


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
@pytest.mark.parametrize("command", readme_curls())
def test_readme_curl_works_as_printed(host: str, command: str) -> None:
    argv = shlex.split(command.replace(DOCUMENTED, host))
    assert argv[0] == "curl"
    out = subprocess.run(
        [*argv, "-w", "\n%{http_code}"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    body, _, status = out.rpartition("\n")
    assert status == "200", out
    _check_body(body)
