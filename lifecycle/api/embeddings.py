"""Embeddings over HTTP: OpenAI's ``POST /v1/embeddings`` and SGLang's ``POST /encode``.

Both run ``lifecycle.core.embed.embed``: the same call, state machine, admission and
worker batches as ``/generate``; a client that disconnects aborts its requests. The
vector is the model's final hidden state (after the final norm) pooled over the input,
``last`` position (default) or ``mean``, L2-normalised unless ``"normalize": false``:
``pooling`` and ``normalize`` are our extension fields on both routes. ``dimensions``
is refused unless it equals the model's hidden size (the model has no Matryoshka
truncation). Errors have each face's own shape: OpenAI's ``{"error": {message, type,
param, code}}`` on ``/v1/embeddings``, SGLang's ``{"error": {"message"}}`` on
``/encode``. An aborted request (``/abort_request``) has no vector: it answers 400
with code ``aborted``.
"""

from __future__ import annotations

import base64
from collections.abc import Awaitable
from typing import Any, TypeVar

import anyio

from lifecycle.api.auth import owner
from lifecycle.api.calls import error_response, gone_cause
from lifecycle.api.openai import openai_error
from lifecycle.api.openai_errors import OpenAIError
from lifecycle.core.call import ExitCause
from lifecycle.core.embed import Embeddings, EmbedInputs, embed, hidden_size
from lifecycle.core.errors import RequestError, ServeError
from lifecycle.core.fields import accept_unknown
from lifecycle.core.frontend import Frontend
from lifecycle.core.states import Cause
from transport import HTTPError, JSONResponse, Request, Response, Router
from wire import pack_f32s

__all__ = ["EmbeddingsAPI"]

_T = TypeVar("_T")

_OPENAI_FIELDS = frozenset(
    {"input", "model", "encoding_format", "dimensions", "user", "pooling", "normalize"}
)
# /encode: SGLang's EmbeddingReqInput fields we read, and those accepted and ignored.
_ENCODE_FIELDS = frozenset({"text", "input_ids", "rid", "dimensions", "pooling", "normalize"})
_ENCODE_IGNORED = frozenset({"sampling_params", "log_metrics", "priority", "routing_key"})


def _options(body: dict[str, Any]) -> tuple[str, bool]:
    """The extension fields; their values are checked by ``embed`` (``EmbedOptions``)."""
    pooling = body.get("pooling")
    normalize = body.get("normalize")
    return ("last" if pooling is None else pooling), (True if normalize is None else normalize)


def _dimensions(body: dict[str, Any], hidden: int) -> str | None:
    """The refusal of a ``dimensions`` the model cannot give, or None."""
    d = body.get("dimensions")
    if d is None:
        return None
    if isinstance(d, bool) or not isinstance(d, int) or d < 1:
        return f"dimensions must be a positive integer, got {d!r}."
    if d != hidden:
        return (
            f"This model does not support dimensions={d}: its embeddings have "
            f"{hidden} dimensions (omit the field, or send {hidden})."
        )
    return None


def _openai_input(raw: Any) -> EmbedInputs:
    """OpenAI's ``input``: a string, strings, one token array or token arrays."""
    if isinstance(raw, str):
        return [raw]
    if isinstance(raw, list) and raw:
        if all(isinstance(x, str) for x in raw):
            return raw
        if all(type(x) is int for x in raw):
            return [raw]
        if all(isinstance(x, list) for x in raw):
            return raw
    raise OpenAIError(
        "input must be a non-empty string, a list of strings, a list of token ids or a "
        "list of lists of token ids.",
        param="input",
    )


def _encoded(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "base64":  # OpenAI's: little-endian float32, base64
        return base64.b64encode(pack_f32s(vector)).decode("ascii")
    return vector


class EmbeddingsAPI:
    def __init__(
        self,
        frontend: Frontend,
        *,
        model_id: str,
        model_names: frozenset[str] | None = None,
        strict_model: bool = False,
    ) -> None:
        self.fe = frontend
        self.model_id = model_id
        # The names /v1/models answers to (``OpenAIAPI.model_names``), or these two.
        self.model_names = model_names or frozenset({model_id, "default"})
        self.strict_model = strict_model  # as OpenAIAPI: any name is ours unless strict

    def install(self, router: Router) -> None:
        router.add("POST", "/v1/embeddings", self.embeddings)
        router.add(["POST", "PUT"], "/encode", self.encode)

    async def _run(
        self, request: Request, inputs: EmbedInputs, body: dict[str, Any], rids: Any
    ) -> Embeddings | None:
        """``embed`` owned by this handler: None when the client left (the call was then
        closed client_gone, what the worker held aborted)."""
        pooling, normalize = _options(body)
        with anyio.CancelScope() as scope:
            forget = request.on_disconnect(scope.cancel)
            try:
                return await embed(
                    self.fe,
                    inputs,
                    pooling=pooling,
                    normalize=normalize,
                    rids=rids,
                    exit_cause=gone_cause(request),
                    owner=owner(request),
                )
            finally:
                forget()
        return None

    # -- OpenAI ------------------------------------------------------------------------------
    async def embeddings(self, request: Request) -> Response:
        try:
            body = await request.json()
        except HTTPError as exc:
            return openai_error(OpenAIError(exc.message, exc.status))
        try:
            inputs, fmt = self._openai_body(body)
            result = await _openai_errors(self._run(request, inputs, body, None))
        except OpenAIError as exc:
            return openai_error(exc, exc.retry_after)
        if result is None:
            return Response(b"", 499)  # nobody reads it
        return JSONResponse(self._openai_reply(result, fmt))

    async def reply(self, body: Any, exit_cause: ExitCause) -> dict[str, Any]:
        """A ``/v1/embeddings`` reply without HTTP (``lifecycle batch``'s lines); raises
        ``OpenAIError`` as the route answers it."""
        inputs, fmt = self._openai_body(body)

        async def run() -> Embeddings:
            pooling, normalize = _options(body)  # a RequestError as the route's 400
            return await embed(
                self.fe, inputs, pooling=pooling, normalize=normalize, exit_cause=exit_cause
            )

        return self._openai_reply(await _openai_errors(run()), fmt)

    def _openai_body(self, body: Any) -> tuple[EmbedInputs, str]:
        if not isinstance(body, dict):
            raise OpenAIError("The request body must be a JSON object.")
        for key in body:
            if key not in _OPENAI_FIELDS and not accept_unknown("/v1/embeddings", key):
                raise OpenAIError(f"Unrecognized request argument supplied: {key}", param=key)
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise OpenAIError("model must be a string.", param="model")
        if self.strict_model and model is not None and model not in self.model_names:
            raise OpenAIError(
                f"The model `{model}` does not exist.", 404, param="model", code="model_not_found"
            )
        fmt = body.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            raise OpenAIError(
                f"encoding_format must be 'float' or 'base64', got {fmt!r}.",
                param="encoding_format",
            )
        refusal = _dimensions(body, hidden_size(self.fe))
        if refusal is not None:
            raise OpenAIError(refusal, param="dimensions")
        if body.get("user") is not None and not isinstance(body["user"], str):
            raise OpenAIError("user must be a string.", param="user")
        return _openai_input(body.get("input")), fmt

    def _openai_reply(self, result: Embeddings, fmt: str) -> dict[str, Any]:
        n = result.prompt_tokens
        return {
            "object": "list",
            "data": [
                {"object": "embedding", "index": e.index, "embedding": _encoded(e.embedding, fmt)}
                for e in result.items
            ],
            "model": self.model_id,
            "usage": {"prompt_tokens": n, "total_tokens": n},
        }

    # -- SGLang /encode ----------------------------------------------------------------------
    async def encode(self, request: Request) -> Response:
        body = await request.json()
        try:
            inputs, is_batch, rids = self._encode_body(body)
            result = await self._run(request, inputs, body, rids)
        except RequestError as exc:
            return error_response(exc.status, exc.message)
        except ServeError as exc:
            status = 400 if exc.cause is Cause.ABORTED else exc.cause.status
            return error_response(status, exc.message, exc.cause.retry_after)
        if result is None:
            return Response(b"", 499)
        items = result.encode_results()
        return JSONResponse(items if is_batch else items[0])

    def _encode_body(self, body: Any) -> tuple[EmbedInputs, bool, list[str] | None]:
        def bad(message: str) -> RequestError:
            return RequestError(message, 400, Cause.INVALID)

        if not isinstance(body, dict):
            raise bad("The request body must be a JSON object.")
        for key in body:
            if key == "stream" and body[key] not in (None, False):
                raise bad("stream is not supported by /encode.")
            known = key in _ENCODE_FIELDS or key in _ENCODE_IGNORED
            if not known and not accept_unknown("/encode", key):
                raise bad(f"Unknown field in the request body: {key!r}.")
        refusal = _dimensions(body, hidden_size(self.fe))
        if refusal is not None:
            raise bad(refusal)
        text, ids = body.get("text"), body.get("input_ids")
        if (text is None) == (ids is None):
            raise bad("Provide exactly one of text or input_ids.")
        if isinstance(text, str) or (isinstance(ids, list) and ids and type(ids[0]) is int):
            inputs: Any = [text if text is not None else ids]
            is_batch = False
        elif isinstance(text if text is not None else ids, list):
            inputs, is_batch = text if text is not None else ids, True
        else:
            raise bad(
                "text must be a string or a list of strings; input_ids a list of ints or lists."
            )
        return inputs, is_batch, _encode_rids(body.get("rid"), len(inputs), is_batch)


async def _openai_errors(run: Awaitable[_T]) -> _T:
    """``run``'s result; its refusal as the ``OpenAIError`` /v1/embeddings answers (with
    ``retry_after`` set for a 503)."""
    try:
        return await run
    except RequestError as exc:
        if exc.cause is Cause.TOO_LONG:
            raise OpenAIError.from_cause(exc.cause, exc.message, "input") from None
        first = exc.message.split(" ", 1)[0]  # "input 3 ...", "pooling must ..."
        name = "input" if first in ("input", "inputs") else first
        param = name if name in _OPENAI_FIELDS else None
        raise OpenAIError(exc.message, exc.status, param=param) from None
    except ServeError as exc:
        if exc.cause is Cause.ABORTED:
            raise OpenAIError(exc.message, 400, code="aborted") from None
        err = OpenAIError.from_cause(exc.cause, exc.message)
        err.retry_after = exc.cause.retry_after
        raise err from None


def _encode_rids(rid: Any, n: int, is_batch: bool) -> list[str] | None:
    """SGLang's rid rules: a string names one request, or ``{rid}_{i}`` in a batch."""
    if rid is None:
        return None
    if isinstance(rid, str) and rid:
        return [f"{rid}_{i}" for i in range(n)] if is_batch else [rid]
    if is_batch and isinstance(rid, list) and all(isinstance(r, str) and r for r in rid):
        if len(set(rid)) != len(rid):
            raise RequestError(f"Duplicate request IDs detected within the request: {rid}", 400)
        return rid
    raise RequestError("The rid should be a string, or a list of strings for a batch.", 400)
