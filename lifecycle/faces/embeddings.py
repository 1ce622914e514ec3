"""Embeddings without HTTP: the bodies of OpenAI's ``/v1/embeddings`` and SGLang's
``/encode`` checked, OpenAI's reply shaped, and a refusal as each face answers it.

``EmbeddingsFace`` is what the HTTP routes (``lifecycle/api/embeddings.py``) and the
Engine's ``lifecycle batch`` lines share: both run ``lifecycle.core.embed.embed`` (the
same call, state machine, admission and worker batches as ``/generate``). ``pooling``
(``last`` or ``mean``) and ``normalize`` are our extension fields on both routes;
``dimensions`` is refused unless it equals the model's hidden size.
"""

from __future__ import annotations

import base64
from collections.abc import Awaitable
from typing import Any, TypeVar

from lifecycle.core.call import ExitCause
from lifecycle.core.embed import Embeddings, EmbedInputs, embed, hidden_size
from lifecycle.core.errors import RequestError, ServeError
from lifecycle.core.fields import accept_unknown
from lifecycle.core.frontend import Frontend
from lifecycle.core.states import Cause
from lifecycle.faces.openai_errors import OpenAIError
from wire import pack_f32s

__all__ = ["EmbeddingsFace", "embed_options", "with_openai_errors"]

_T = TypeVar("_T")

_OPENAI_FIELDS = frozenset(
    {"input", "model", "encoding_format", "dimensions", "user", "pooling", "normalize"}
)
# /encode: SGLang's EmbeddingReqInput fields we read, and those accepted and ignored.
_ENCODE_FIELDS = frozenset({"text", "input_ids", "rid", "dimensions", "pooling", "normalize"})
_ENCODE_IGNORED = frozenset({"sampling_params", "log_metrics", "priority", "routing_key"})


def embed_options(body: dict[str, Any]) -> tuple[str, bool]:
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


class EmbeddingsFace:
    """What a served model's embeddings answer as, and the checks of their bodies."""

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
        # The names /v1/models answers to (``OpenAIFace.model_names``), or these two.
        self.model_names = model_names or frozenset({model_id, "default"})
        self.strict_model = strict_model  # as OpenAIFace: any name is ours unless strict

    async def reply(self, body: Any, exit_cause: ExitCause) -> dict[str, Any]:
        """A ``/v1/embeddings`` reply without HTTP (``lifecycle batch``'s lines); raises
        ``OpenAIError`` as the route answers it."""
        inputs, fmt = self.openai_body(body)

        async def run() -> Embeddings:
            pooling, normalize = embed_options(body)  # a RequestError as the route's 400
            return await embed(
                self.fe, inputs, pooling=pooling, normalize=normalize, exit_cause=exit_cause
            )

        return self.openai_reply(await with_openai_errors(run()), fmt)

    def openai_body(self, body: Any) -> tuple[EmbedInputs, str]:
        """A ``/v1/embeddings`` body's inputs and encoding format; raises ``OpenAIError``."""
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

    def openai_reply(self, result: Embeddings, fmt: str) -> dict[str, Any]:
        """OpenAI's reply: the vectors (floats, or base64 float32) and the usage."""
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

    def encode_body(self, body: Any) -> tuple[EmbedInputs, bool, list[str] | None]:
        """An ``/encode`` body's inputs, whether it is a batch, and its rids; raises
        ``RequestError``."""

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


async def with_openai_errors(run: Awaitable[_T]) -> _T:
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
