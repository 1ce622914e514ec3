"""Spec conformance: schemathesis drives every route of ``specs/openapi.yaml`` against a
live server (scripted worker) and finds no 5xx and no response, or SSE event, that
violates the spec. Bounded (examples per operation, seeded) to stay well under a minute."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import pytest

from lifecycle.testing.pytest_plugin import LiveServer

SPEC = Path(__file__).resolve().parent.parent / "specs" / "openapi.yaml"
pytest.importorskip("schemathesis")


def test_openapi_conformance_no_5xx(
    tmp_path: Path, lifecycle_server_factory: Callable[..., AbstractContextManager[LiveServer]]
) -> None:
    """Uses the package's pytest plugin (its ``lifecycle_server_factory`` fixture)."""
    exe = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    assert exe is not None
    with lifecycle_server_factory("--scripted-worker", "--max-pending", "8") as srv:
        r = subprocess.run(
            [
                exe,
                "run",
                str(SPEC),
                "--url",
                srv.url,
                "--max-examples",
                "10",
                "--checks",
                "not_a_server_error,response_schema_conformance,status_code_conformance",
                "--phases",
                "examples,coverage,fuzzing",
                "--request-timeout",
                "20",
                "--seed",
                "1",
                "--no-color",
            ],
            cwd=tmp_path,  # schemathesis keeps a cache in its working directory
            capture_output=True,
            text=True,
            timeout=240,
        )
        srv.assert_invariants(timeout=10)
    assert r.returncode == 0, r.stdout[-8000:] + r.stderr[-2000:]
