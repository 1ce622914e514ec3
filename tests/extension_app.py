"""An app's own routes for ``lifecycle serve --extend tests.extension_app:install``
(tests/test_extend.py): one plain route, and one that reads the server's live state."""

from __future__ import annotations

from lifecycle.extend import Extension
from transport import JSONResponse, Request, Response


def install(app: Extension) -> None:
    async def hello(request: Request) -> Response:
        name = request.query().get("name", ["world"])[0]
        return JSONResponse({"hello": name, "port": app.config.port})

    async def live(request: Request) -> Response:
        return JSONResponse({"live_calls": len(app.frontend.calls)})

    app.router.add("GET", "/hello", hello)
    app.router.add("GET", "/app/live", live)


not_callable = 3
