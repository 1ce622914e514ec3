"""One in-process app (``lifecycle.app.serve_app``) on a real socket, driving a real
scripted worker process: what the tests that need a live server in this process share."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio

from lifecycle.app import App, AppConfig, serve_app


@asynccontextmanager
async def running_app(**kw: Any) -> AsyncIterator[App]:
    """``serve_app`` on an ephemeral port with the scripted worker, ready; ``kw`` are
    ``AppConfig`` fields. Cancelled (drained, worker reaped) at the end."""
    cfg = AppConfig(**{"port": 0, "worker_module": "lifecycle.testing.scripted_worker", **kw})
    async with anyio.create_task_group() as tg:
        app: App = await tg.start(serve_app, cfg)
        with anyio.fail_after(60):
            await app.supervisor.wait_ready()
        try:
            yield app
        finally:
            tg.cancel_scope.cancel()
