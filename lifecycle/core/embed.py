"""Embeddings: the model's final hidden states pooled over each input, through the same
call as ``/generate``.

``embed`` is the one core function behind ``POST /v1/embeddings``, SGLang's ``/encode``
and the in-process Engine's ``encode``. Each input is a ``GenerateItem`` flagged
``embed`` (``wire.EmbedOptions``), so it goes through the same ``GenerateCall``: one
request record per input, the registry, admission, the dispatcher's credits, the
worker's batches (prefill only, nothing sampled, its KV released when its one STEP
entry comes), the same traces and metrics, and the same exit: leaving ``embed`` for any
reason (an error, the caller cancelled, the client gone) closes the call and aborts
what the worker still holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lifecycle.core.call import ExitCause
from lifecycle.core.errors import RequestError, ServeError
from lifecycle.core.frontend import Frontend
from lifecycle.core.params import MAX_SEQUENCES, GenerateItem, GenerateRequest
from lifecycle.core.sampling import parse_sampling_params
from lifecycle.core.states import Cause
from wire import EmbedOptions, Finish, RequestOptions

__all__ = ["EmbedInputs", "Embedding", "Embeddings", "embed", "embed_request", "hidden_size"]

EmbedInputs = Sequence[str] | Sequence[Sequence[int]]

MAX_INPUTS = MAX_SEQUENCES  # as /generate's batches (OpenAI allows 2048; admission holds 1024)


@dataclass(frozen=True, slots=True)
class Embedding:
    """One input's vector, in input order (``index``)."""

    index: int
    embedding: list[float]
    prompt_tokens: int
    cached_tokens: int
    id: str

    def meta_info(self, e2e: float) -> dict[str, Any]:
        """SGLang's ``/encode`` ``meta_info`` (its finish reason for embeddings, too)."""
        return {
            "id": self.id,
            "finish_reason": {"type": Finish.LENGTH, "length": 0},
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "e2e_latency": e2e,
        }


@dataclass(frozen=True, slots=True)
class Embeddings:
    items: list[Embedding]
    e2e: float  # seconds from the call's start to its end

    @property
    def vectors(self) -> list[list[float]]:
        return [e.embedding for e in self.items]

    @property
    def prompt_tokens(self) -> int:
        return sum(e.prompt_tokens for e in self.items)

    def encode_results(self) -> list[dict[str, Any]]:
        """SGLang's ``/encode`` items: ``{"embedding": [...], "meta_info": {...}}``."""
        return [{"embedding": e.embedding, "meta_info": e.meta_info(self.e2e)} for e in self.items]


def _bad(message: str) -> RequestError:
    return RequestError(message, 400, Cause.INVALID)


def hidden_size(frontend: Frontend) -> int:
    """The length of every vector: the model's hidden size."""
    return int(frontend.model_config.hidden)


def embed_request(
    inputs: EmbedInputs,
    *,
    vocab_size: int,
    pooling: str = "last",
    normalize: bool = True,
    rids: Sequence[str] | None = None,
) -> GenerateRequest:
    """The call's request: one embed item per input; RequestError (400) for bad input."""
    try:
        options = EmbedOptions(pooling, normalize)
    except ValueError as exc:
        raise _bad(str(exc)) from None
    if isinstance(inputs, str) or not isinstance(inputs, Sequence) or not inputs:
        raise _bad("inputs must be a non-empty list of strings or of token id lists.")
    if len(inputs) > MAX_INPUTS:
        raise _bad(f"at most {MAX_INPUTS} inputs per request, got {len(inputs)}.")
    if rids is not None and len(rids) != len(inputs):
        raise _bad(f"{len(rids)} rids for {len(inputs)} inputs.")
    sampling = parse_sampling_params(None, vocab_size=vocab_size)
    items = []
    for i, one in enumerate(inputs):
        text, ids = _input(one, i, vocab_size)
        items.append(
            GenerateItem(
                index=i,
                text=text,
                input_ids=ids,
                sampling=sampling,
                client_rid=None if rids is None else rids[i],
                options=RequestOptions(embed=options),
            )
        )
    return GenerateRequest(items, is_batch=len(items) > 1, stream=False)


def _input(one: Any, i: int, vocab_size: int) -> tuple[str | None, list[int] | None]:
    if isinstance(one, str):
        if not one:
            raise _bad(f"input {i} is an empty string.")
        return one, None
    if not isinstance(one, Sequence) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in one
    ):
        raise _bad(f"input {i} must be a string or a list of token ids.")
    if not one:
        raise _bad(f"input {i} is an empty list of token ids.")
    if any(not 0 <= t < vocab_size for t in one):
        raise _bad(f"input {i} has token ids outside [0, {vocab_size}).")
    return None, list(one)


async def embed(
    frontend: Frontend,
    inputs: EmbedInputs,
    *,
    pooling: str = "last",
    normalize: bool = True,
    rids: Sequence[str] | None = None,
    exit_cause: ExitCause | None = None,
    owner: object = None,
) -> Embeddings:
    """Every input's pooled, by default L2-normalised, final hidden state.

    Raises RequestError (4xx: bad input, ``too_long``) or ServeError (not ready,
    overloaded, worker lost, aborted, ...). Cancelling the caller aborts the requests;
    ``exit_cause`` says why the owner left (e.g. ``gone_cause(request)`` over HTTP);
    ``owner`` who made it (``Frontend.call``)."""
    req = embed_request(
        inputs,
        vocab_size=frontend.model_config.vocab_size,
        pooling=pooling,
        normalize=normalize,
        rids=rids,
    )
    async with frontend.call(req, exit_cause, owner=owner) as call:
        await call.start()
        try:
            await call.result()
        except ServeError as exc:
            if exc.cause in (Cause.INVALID, Cause.TOO_LONG):
                raise RequestError(exc.message, exc.cause.status, exc.cause) from None
            raise
        items = []
        for i, run in enumerate(call.runs):
            s = run.samples[0]
            if s.finish.get("type") == Finish.ABORT:
                raise ServeError(Cause.ABORTED, str(s.finish.get("message", "aborted")))
            if s.finish.get("type") != Finish.EMBED or s.embedding is None:
                raise ServeError(Cause.INTERNAL, "the worker does not support embeddings")
            items.append(Embedding(i, s.embedding, s.prompt_tokens, s.cached_tokens, s.rid))
        e2e = call.e2e()
    return Embeddings(items, e2e)
