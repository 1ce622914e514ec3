"""The error of the OpenAI-compatible routes: OpenAI's nested ``error`` object beside
SGLang's flat ``ErrorResponse`` fields (docs/api.md, "Errors")."""

from __future__ import annotations

from typing import Any

from lifecycle.core.states import Cause

__all__ = ["OpenAIError", "sglang_error_type"]

# SGLang's ``ErrorResponse.type`` by status: the reason phrase in CamelCase ending in
# ``Error``, as its handlers name them (``create_error_response``'s default
# ``BadRequestError``, ``NotFoundError`` for an unknown model, ``InternalServerError``,
# ``ServiceUnavailableError``). Spelled out: Python's phrases change between versions.
_SGLANG_TYPES = {
    400: "BadRequestError",
    401: "UnauthorizedError",
    403: "ForbiddenError",
    404: "NotFoundError",
    408: "RequestTimeoutError",
    413: "RequestEntityTooLargeError",
    429: "TooManyRequestsError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def sglang_error_type(status: int) -> str:
    """SGLang's ``ErrorResponse.type`` for an error of ``status``."""
    default = "BadRequestError" if status < 500 else "InternalServerError"
    return _SGLANG_TYPES.get(status, default)


class OpenAIError(Exception):
    """A request that ends before generation, with the error body of the OpenAI routes."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        *,
        param: str | None = None,
        code: str | None = None,
        err_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code
        self.retry_after: int | None = None  # seconds, sent as Retry-After (a 503's)
        self.err_type = err_type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        """OpenAI's nested ``error`` object (what the official SDKs read) beside SGLang's
        flat ``ErrorResponse`` (``object: "error"``, ``message``, ``type`` as SGLang
        names it, ``param``, ``code``: the status), which SGLang's clients and tests read
        (issue 56, point 6). Unary replies and stream error events alike."""
        return {
            "object": "error",
            "message": self.message,
            "type": sglang_error_type(self.status),
            "param": self.param,
            "code": self.status,
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.code,
            },
        }

    @classmethod
    def from_cause(cls, cause: Cause, message: str, param: str | None = None) -> OpenAIError:
        if cause is Cause.TOO_LONG:
            return cls(message, cause.status, param=param, code="context_length_exceeded")
        return cls(message, cause.status, code=cause.value)
