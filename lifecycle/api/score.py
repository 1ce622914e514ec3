"""``POST /v1/score``: SGLang's scoring API (docs/api.md).

For each item, the prompt ``query + item`` (``item + query`` with ``item_first``; text
joined as text, token ids as lists) runs one prefill through the generate call, and the
reply gives the next-token probabilities of ``label_token_ids`` there: ``exp(logprob)``,
or with ``apply_softmax`` the softmax over the labels' logprobs. The same checks and
errors as ``/generate`` (the OpenAI error shape), one request record per item. An item
aborted by ``/abort_request`` has no score: the request is a 400 with code ``aborted``,
as ``/v1/embeddings`` answers.
"""

from __future__ import annotations

import math
from typing import Any

from lifecycle.api.calls import http_call
from lifecycle.api.openai import openai_error, run_call, start_call
from lifecycle.core.call import GenerateCall
from lifecycle.core.errors import RequestError
from lifecycle.core.fields import accept_unknown
from lifecycle.core.frontend import Frontend
from lifecycle.core.params import MAX_SEQUENCES, parse_generate
from lifecycle.faces.openai_errors import OpenAIError
from transport import HTTPError, JSONResponse, Request, Response, Router

__all__ = ["ScoreAPI", "score_body"]

_FIELDS = {"query", "items", "label_token_ids", "apply_softmax", "item_first", "model", "rid"}


def _bad(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(message, 400, param=param)


def _ids(v: Any) -> bool:
    return isinstance(v, list) and all(type(t) is int for t in v)


def score_body(body: Any, vocab_size: int) -> tuple[dict[str, Any], list[int], bool]:
    """The ``/generate`` body of a score request, its labels and ``apply_softmax``."""
    if not isinstance(body, dict):
        raise _bad("The request body must be a JSON object.")
    for key in body:
        if key not in _FIELDS and not accept_unknown("/v1/score", key):
            raise _bad(f"Unrecognized request argument supplied: {key}", key)
    query, items = body.get("query"), body.get("items")
    labels = body.get("label_token_ids")
    if not _ids(labels) or not labels:
        raise _bad("label_token_ids must be a non-empty list of token ids.", "label_token_ids")
    for t in labels:  # SGLang's message, which its own endpoint test reads
        if not 0 <= t < vocab_size:
            raise _bad(f"Token ID {t} is out of vocabulary (vocab size: {vocab_size}).",
                       "label_token_ids")  # fmt: skip
    softmax, item_first = body.get("apply_softmax", False), body.get("item_first", False)
    for name, flag in (("apply_softmax", softmax), ("item_first", item_first)):
        if not isinstance(flag, bool):
            raise _bad(f"{name} must be a boolean.", name)
    if isinstance(items, str):
        items = [items]
    if (
        isinstance(query, str)
        and isinstance(items, list)
        and items
        and all(isinstance(i, str) for i in items)
    ):
        key, prompts = "text", [i + query if item_first else query + i for i in items]
    elif _ids(query) and isinstance(items, list) and items and all(_ids(i) for i in items):
        key, prompts = "input_ids", [i + query if item_first else query + i for i in items]
    else:
        raise _bad("query and items must both be text (a string, and a string or a list of "
                   "strings) or both token ids (a list, and a list of lists).", "items")  # fmt: skip
    if len(prompts) > MAX_SEQUENCES:
        raise _bad(f"at most {MAX_SEQUENCES} items per request.", "items")
    gen = {
        key: prompts,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "return_logprob": True,
        "token_ids_logprob": labels,
    }
    if body.get("rid") is not None:
        gen["rid"] = body["rid"]
    return gen, labels, softmax


def scores(logprobs: list[float], softmax: bool) -> list[float]:
    if not softmax:
        return [math.exp(lp) for lp in logprobs]
    top = max(logprobs)
    exps = [math.exp(lp - top) for lp in logprobs]
    total = sum(exps)
    return [e / total for e in exps]


def _abort_message(call: GenerateCall) -> str | None:
    """The abort's message when an item was aborted (``/abort_request``), else None."""
    for run in call.runs:
        for sample in run.samples:
            finish = sample.finish
            if isinstance(finish, dict) and finish.get("type") == "abort":
                return str(finish.get("message", "aborted"))
    return None


class ScoreAPI:
    def __init__(self, frontend: Frontend, model_id: str) -> None:
        self.fe = frontend
        self.model_id = model_id

    def install(self, router: Router) -> None:
        router.add(["POST", "PUT"], "/v1/score", self.score)

    async def score(self, request: Request) -> Response:
        try:
            try:
                body = await request.json()
            except HTTPError as exc:  # invalid JSON (400), a body over the limit (413)
                raise OpenAIError(exc.message, exc.status) from None
            gen, labels, softmax = score_body(body, self.fe.model_config.vocab_size)
            req = parse_generate(gen, vocab_size=self.fe.model_config.vocab_size)
        except RequestError as exc:
            return openai_error(OpenAIError.from_cause(exc.cause, exc.message, "items"))
        except OpenAIError as exc:
            return openai_error(exc)
        async with http_call(self.fe, req, request) as call:
            refused = await start_call(call, "items") or await run_call(call, request)
            if refused is not None:
                return refused
            aborted = _abort_message(call)
            if aborted is not None:  # no logprobs to score: embeddings' answer
                return openai_error(OpenAIError(aborted, 400, code="aborted"))
            out, prompt_tokens = [], 0
            for run in call.runs:
                sample = run.samples[0]
                meta = sample.result(call.e2e())["meta_info"]
                given = {t: lp for lp, t, _ in meta["output_token_ids_logprobs"][0]}
                out.append(scores([given[t] for t in labels], softmax))
                prompt_tokens += sample.prompt_tokens
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 0,
                 "total_tokens": prompt_tokens}  # fmt: skip
        return JSONResponse({"scores": out, "model": self.model_id, "usage": usage,
                             "object": "scoring"})  # fmt: skip
