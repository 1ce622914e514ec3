"""What every HTTP face does with a call (docs/architecture.md, "Faces"): open it for a
request (``http_call``: owned by the request's API key, so ``/abort_request`` on that
key's behalf reaches it, and ending as the request ends when the client leaves), run a
unary one while watching the client (``run_unary``), and answer an error in SGLang's
shape (``error_response``). The call closes itself when its last sample ends; a face
only formats what it holds.
"""

from __future__ import annotations

import anyio

from lifecycle.api.auth import owner
from lifecycle.core.call import ExitCause, GenerateCall
from lifecycle.core.frontend import Frontend
from lifecycle.core.params import GenerateRequest
from lifecycle.core.states import Cause
from transport import JSONResponse, Request, Response

__all__ = ["error_response", "gone_cause", "http_call", "run_unary"]


def error_response(status: int, message: str, retry_after: int | None = None) -> Response:
    headers = [("retry-after", str(retry_after))] if retry_after else None
    return JSONResponse({"error": {"message": message}}, status, headers)


def gone_cause(request: Request) -> ExitCause:
    """Why a call owned by the handler of ``request`` ended early (its ``exit_cause``)."""

    def cause() -> tuple[Cause, str]:
        reason = request.disconnect_reason
        if reason == "send_stall":
            return Cause.CLIENT_STALLED, "the client stopped reading"
        if reason == "shutdown":
            return Cause.SHUTTING_DOWN, "server shutdown"
        if request.is_disconnected():
            return Cause.CLIENT_GONE, "client disconnected"
        return Cause.INTERNAL, "handler ended early"

    return cause


def http_call(fe: Frontend, req: GenerateRequest, request: Request) -> GenerateCall:
    """A call for ``req`` made by ``request``: owned by its key, ended with its cause."""
    return fe.call(req, gone_cause(request), owner=owner(request))


async def run_unary(call: GenerateCall, request: Request) -> bool:
    """Run ``call`` to its end unless the client leaves first (watched without writing);
    False when the client left (the call's scope then closes it with the cause)."""
    with anyio.CancelScope() as scope:
        forget = request.on_disconnect(scope.cancel)  # no watcher task per request
        try:
            await call.run_to_end()
        finally:
            forget()
    return call.done
