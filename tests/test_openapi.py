"""specs/openapi.yaml documents exactly the routes the native API installs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from lifecycle.api_native import NativeAPI

SPEC = Path(__file__).resolve().parent.parent / "specs" / "openapi.yaml"


class RouteRecorder:
    """A stand-in router that only records what is added."""

    def __init__(self) -> None:
        self.paths: set[str] = set()

    def add(self, methods: Any, path: str, handler: Any) -> None:
        self.paths.add(path)


def test_every_installed_route_is_specified() -> None:
    spec = yaml.safe_load(SPEC.read_text())
    assert spec["openapi"].startswith("3.1")
    recorder = RouteRecorder()
    NativeAPI.install(NativeAPI.__new__(NativeAPI), recorder)  # type: ignore[arg-type]
    assert recorder.paths == set(spec["paths"])
