"""specs/openapi.yaml documents exactly the routes the native API installs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from lifecycle.api.anthropic import AnthropicAPI
from lifecycle.api.debug import install_debug
from lifecycle.api.embeddings import EmbeddingsAPI
from lifecycle.api.metrics import install_metrics
from lifecycle.api.model_admin import install_model_admin
from lifecycle.api.native import NativeAPI
from lifecycle.api.openai import OpenAIAPI
from lifecycle.api.replica_admin import install_replica_admin
from lifecycle.api.responses import ResponsesAPI
from lifecycle.api.score import ScoreAPI
from lifecycle.api.websocket import WebSocketAPI
from lifecycle.link.model_set import ModelSet
from lifecycle.tracing.metrics import Metrics
from lifecycle.tracing.tracer import Tracer

SPEC = Path(__file__).resolve().parent.parent / "specs" / "openapi.yaml"


class RouteRecorder:
    """A stand-in router that only records what is added."""

    def __init__(self) -> None:
        self.paths: set[str] = set()

    def add(self, methods: Any, path: str, handler: Any) -> None:
        self.paths.add(path.replace(":path}", "}"))  # OpenAPI has no catch-all segments


def test_every_installed_route_is_specified() -> None:
    spec = yaml.safe_load(SPEC.read_text())
    assert spec["openapi"].startswith("3.1")
    recorder = RouteRecorder()
    NativeAPI.install(NativeAPI.__new__(NativeAPI), recorder)  # type: ignore[arg-type]
    OpenAIAPI.install(OpenAIAPI.__new__(OpenAIAPI), recorder)  # type: ignore[arg-type]
    EmbeddingsAPI.install(EmbeddingsAPI.__new__(EmbeddingsAPI), recorder)  # type: ignore[arg-type]
    ResponsesAPI.install(ResponsesAPI.__new__(ResponsesAPI), recorder)  # type: ignore[arg-type]
    AnthropicAPI.install(AnthropicAPI.__new__(AnthropicAPI), recorder)  # type: ignore[arg-type]
    ScoreAPI.install(ScoreAPI.__new__(ScoreAPI), recorder)  # type: ignore[arg-type]
    WebSocketAPI.install(WebSocketAPI.__new__(WebSocketAPI), recorder)  # type: ignore[arg-type]
    install_metrics(recorder, Metrics.__new__(Metrics))  # type: ignore[arg-type]
    install_debug(recorder, Tracer(), replay=_no_replay)  # type: ignore[arg-type]
    install_model_admin(recorder, ModelSet([]), {})  # type: ignore[arg-type]
    install_replica_admin(recorder, {})  # type: ignore[arg-type]
    assert recorder.paths == set(spec["paths"])


async def _no_replay(trace: dict[str, Any]) -> dict[str, Any]:
    raise AssertionError("only installed, never called")


def test_core_request_path_does_not_import_transport() -> None:
    """The dispatcher, supervisor and request path stay usable without HTTP."""
    import ast

    root = SPEC.parent.parent / "lifecycle"
    paths = [
        *sorted((root / "core").glob("*.py")),  # the whole request core
        *sorted((root / "testing").glob("*.py")),  # the scripted worker and the plugin
        *sorted((root / "faces").glob("*.py")),  # the APIs without HTTP
    ]
    assert len(paths) > 15 and all(p.is_file() for p in paths)
    for path in paths:
        name = str(path.relative_to(root))
        tree = ast.parse(path.read_text())
        mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        mods |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not any(m.split(".")[0] == "transport" for m in mods), name
