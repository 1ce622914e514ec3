"""Hugging Face Hub repos without the Hub: a cache in huggingface_hub's own on-disk
layout (``hub_repo``), and a local HTTP server answering the few routes the library
asks of the Hub to list and download a repo (``FakeHub``), for ``HF_ENDPOINT``.

The cache: ``models--ORG--NAME/refs/main`` holds the commit, each file is a blob named
by its sha256 under ``blobs/``, and ``snapshots/<commit>/<path>`` links to it, as
``snapshot_download`` leaves it. The server: ``GET /api/models/ORG/NAME[/revision/R]``
(the listing ``HfApi.model_info`` reads), ``GET /api/models/ORG/NAME/tree/<commit>``
(what ``snapshot_download`` lists), ``HEAD`` and ``GET /ORG/NAME/resolve/<commit>/<path>``
(a file's metadata and bytes); anything else is 404. Each request is recorded.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["COMMIT", "FakeHub", "fake_hub", "hub_repo"]

COMMIT = "0123456789abcdef0123456789abcdef01234567"
Files = dict[str, pathlib.Path | str]


def _bytes(src: pathlib.Path | str) -> bytes:
    return src.read_bytes() if isinstance(src, pathlib.Path) else src.encode()


def hub_repo(cache: pathlib.Path, repo: str, files: Files) -> pathlib.Path:
    """``repo`` in huggingface_hub's cache layout under ``cache`` at ``COMMIT`` (refs/main
    names it), each file (a path to copy, or text) a blob its snapshot entry links to;
    the snapshot folder."""
    root = cache / ("models--" + repo.replace("/", "--"))
    snapshot = root / "snapshots" / COMMIT
    (root / "blobs").mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(COMMIT)
    for name, src in files.items():
        data = _bytes(src)
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        entry = snapshot / name
        entry.parent.mkdir(parents=True, exist_ok=True)
        up = [".."] * (len(pathlib.Path(name).parts) + 1)  # from the entry's folder to root
        entry.symlink_to(pathlib.Path(*up, "blobs", blob.name))
    return snapshot


class FakeHub:
    """The repos ``repos`` (repo id -> files) served at ``endpoint``; ``requests``
    records each request line."""

    def __init__(self, repos: dict[str, Files]) -> None:
        self.repos = {r: {n: _bytes(s) for n, s in files.items()} for r, files in repos.items()}
        self.requests: list[str] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"

    def _answer(self, method: str, path: str) -> tuple[int, dict[str, str], bytes]:
        self.requests.append(f"{method} {path}")
        path = path.split("?")[0]
        for repo, files in self.repos.items():
            api = f"/api/models/{repo}"
            if path == api or path.startswith(api + "/revision/"):
                siblings = [{"rfilename": name} for name in files]
                return _json({"id": repo, "sha": COMMIT, "siblings": siblings})
            if path.startswith(api + "/tree/"):
                return _json([{"type": "file", "path": name, "size": len(data),
                               "oid": hashlib.sha1(data).hexdigest()}
                              for name, data in files.items()])  # fmt: skip
            prefix = f"/{repo}/resolve/{COMMIT}/"
            if path.startswith(prefix) and path[len(prefix) :] in files:
                data = files[path[len(prefix) :]]
                headers = {"X-Repo-Commit": COMMIT, "Content-Length": str(len(data)),
                           "ETag": f'"{hashlib.sha256(data).hexdigest()}"'}  # fmt: skip
                return 200, headers, b"" if method == "HEAD" else data
        if path.startswith("/api/models/"):  # as the Hub says it of a private repo too
            return 404, {"Content-Length": "0", "X-Error-Code": "RepoNotFound"}, b""
        return 404, {"Content-Length": "0"}, b""

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _reply(self) -> None:
                status, headers, body = hub._answer(self.command, self.path)
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_HEAD = _reply

        return Handler


def _json(obj: Any) -> tuple[int, dict[str, str], bytes]:
    body = json.dumps(obj).encode()
    return 200, {"Content-Type": "application/json", "Content-Length": str(len(body))}, body


@contextmanager
def fake_hub(repos: dict[str, Files]) -> Iterator[FakeHub]:
    """A ``FakeHub`` answering in a thread for the body."""
    hub = FakeHub(repos)
    thread = threading.Thread(target=hub.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        hub.server.shutdown()
        hub.server.server_close()
        thread.join()
