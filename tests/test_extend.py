"""``lifecycle serve --extend MODULE:FUNCTION`` (issue 53, point 7): an app's own routes
on the built-in router, so they get the same API keys, request ids, metrics and access
log lines; a name that cannot be called is one line and exit 2 before listening. A real
server (the scripted worker) and the routes of ``tests/extension_app.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.scripted import ROOT, free_port, lifecycle_server

pytestmark = pytest.mark.timeout(120)


def test_an_extensions_routes_are_authenticated_and_traced(tmp_path: Path) -> None:
    access = tmp_path / "access.jsonl"
    args = ("--scripted-worker", "--extend", "tests.extension_app:install",
            "--api-key", "user-key", "--access-log", str(access))  # fmt: skip
    with lifecycle_server(*args) as url:
        assert httpx.get(url + "/hello").status_code == 401  # the same keys as the API
        key = {"Authorization": "Bearer user-key"}
        r = httpx.get(url + "/hello?name=ops", headers={**key, "X-Request-Id": "ext-1"})
        assert r.status_code == 200
        assert r.json() == {"hello": "ops", "port": int(url.rsplit(":", 1)[1])}
        assert r.headers["x-request-id"] == "ext-1"  # the built-in routes' request ids
        assert httpx.get(url + "/app/live", headers=key).json() == {"live_calls": 0}
        # the built-in routes are all still there
        assert httpx.get(url + "/v1/models", headers=key).status_code == 200
        metrics = httpx.get(url + "/metrics", headers=key).text
        assert 'endpoint="/hello"' in metrics  # counted under its route template
    lines = [json.loads(line) for line in access.read_text().splitlines()]
    hello = [x for x in lines if x.get("path", "").startswith("/hello")]
    assert [(x["status"], x["path"]) for x in hello] == [(200, "/hello")], hello
    assert "ext-1" in json.dumps(hello[0])  # the line names the request by its id


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("tests.no_such_module:install", "cannot import tests.no_such_module"),
        ("tests.extension_app:absent", "tests.extension_app has no callable absent"),
        ("tests.extension_app:not_callable", "has no callable not_callable"),
        ("tests.extension_app", "expected MODULE:FUNCTION"),
    ],
)
def test_an_extension_that_cannot_be_called_is_one_line(spec: str, says: str) -> None:
    argv = [sys.executable, "-m", "lifecycle", "serve", "--port", str(free_port()),
            "--scripted-worker", "--extend", spec]  # fmt: skip
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"error: --extend {spec}: " + r.stderr.split(": ", 2)[2].strip()
    ]
    assert says in r.stderr
