"""OpenAI ``/v1/completions`` and ``/v1/chat/completions`` bodies, validated once at the edge.

OpenAI fields are renamed onto SGLang's ``sampling_params`` and checked by the same
``parse_sampling_params`` as ``/generate`` (one set of rules, one set of messages); only
what exists in OpenAI alone (``max_tokens``, ``logprobs``, ``echo``, ``stream_options``)
is checked here, the ``messages`` and the chat template's variables by
``openai_chat_inputs``, the tool fields by ``tool_params``. Errors carry OpenAI's shape
(``param`` names the OpenAI field) and status: 400 for bad input, 404 ``model_not_found``;
beside it, SGLang's flat ``ErrorResponse`` fields, so that the clients of both read them
(``OpenAIError.body``, the one place they are written).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from lifecycle.chat.tool_formats import ToolFormat
from lifecycle.chat.tool_params import ToolParamError, ToolSpec, parse_tools, tool_grammar
from lifecycle.core.errors import RequestError
from lifecycle.core.fields import accept_unknown
from lifecycle.core.params import MAX_SEQUENCES, GenerateItem, GenerateRequest
from lifecycle.core.sampling import SamplingRequest, parse_sampling_params
from lifecycle.faces.openai_chat_inputs import chat_messages, template_kwargs
from lifecycle.faces.openai_errors import OpenAIError
from wire import MAX_REASONING_BUDGET, RequestOptions

__all__ = ["OpenAIRequest", "parse_chat", "parse_completion"]

COMPLETION_MAX_TOKENS = 16  # SGLang's CompletionRequest default; chat: up to the context
MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat top_logprobs; used for completions too

# OpenAI name -> SGLang sampling_params name (identical where absent).
_SAMPLING = {
    "temperature": "temperature",
    "top_p": "top_p",
    "n": "n",
    "stop": "stop",
    "seed": "seed",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "logit_bias": "logit_bias",
    # SGLang extras
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "min_tokens": "min_new_tokens",
    "ignore_eos": "ignore_eos",
    "stop_token_ids": "stop_token_ids",
    "stop_regex": "stop_regex",
    "regex": "regex",
    "ebnf": "ebnf",
    "skip_special_tokens": "skip_special_tokens",
    "no_stop_trim": "no_stop_trim",
}
_COMMON = frozenset(
    {"model", "stream", "stream_options", "max_tokens", "rid", "response_format", *_SAMPLING}
)
# Accepted and ignored: bookkeeping that changes nothing about the output.
_IGNORED = frozenset({"user", "metadata", "store", "service_tier"})
_COMPLETION = _COMMON | {"prompt", "echo", "logprobs", "suffix", "best_of"}
_CHAT = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}
_CHAT |= {"tools", "tool_choice", "parallel_tool_calls"}
# OpenAI chat features we do not implement: accepted only when null (or the text default).
_CHAT_NULL_ONLY = ("functions", "function_call", "audio", "prediction")
_CHAT |= {*_CHAT_NULL_ONLY, "modalities", "web_search_options", "continue_final_message"}
_CHAT |= {"chat_template_kwargs", "separate_reasoning", "reasoning_effort"}
# A thinking budget (the reasoning closed after this many tokens) by vLLM's name and by
# Qwen's (DashScope's ``thinking_budget``, which SGLang's chat took too).
_BUDGETS = ("thinking_token_budget", "thinking_budget")
_CHAT |= {*_BUDGETS}


@dataclass(frozen=True, slots=True)
class OpenAIRequest:
    """One validated OpenAI call; ``prompts`` are texts or token ids (chat: one text)."""

    chat: bool
    model: str
    prompts: list[str | list[int]]
    sampling: SamplingRequest
    stream: bool
    include_usage: bool
    logprobs: int | None  # top logprobs per position; None: no logprobs at all
    echo: bool = False
    rid: str | None = None  # SGLang's extra: names the request for /abort_request
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage per chunk
    continue_final: bool = False  # chat: continue_final_message (the last turn left open)
    tools: ToolSpec | None = None  # chat: the tools rendered and parsed for (tool_params)
    template_kwargs: dict[str, Any] | None = None  # chat: template variables (kwargs, effort)
    separate_reasoning: bool = True  # chat: SGLang's; false: the reasoning stays in content
    reasoning_budget: int | None = None  # chat: thinking_token_budget (reasoning tokens)

    def generate_request(self, prompts: list[str | list[int]] | None = None) -> GenerateRequest:
        """The native request; ``prompts`` replaces ours (chat: the rendered token ids)."""
        prompts = prompts if prompts is not None else self.prompts
        rids = [self.rid if len(prompts) == 1 else f"{self.rid}_{i}" for i in range(len(prompts))]
        lp = self.logprobs
        options = RequestOptions(
            return_logprob=lp is not None,
            # echo + logprobs scores the prompt too (legacy completions)
            logprob_start_len=0 if self.echo and lp is not None else -1,
            top_logprobs_num=lp or 0,
        )
        items = [
            GenerateItem(
                index=i,
                text=p if isinstance(p, str) else None,
                input_ids=None if isinstance(p, str) else p,
                sampling=self.sampling,
                client_rid=rids[i] if self.rid else None,
                options=options,
                reasoning_budget=self.reasoning_budget,
            )
            for i, p in enumerate(prompts)
        ]
        return GenerateRequest(items, is_batch=len(items) > 1, stream=self.stream)


def _bad(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(message, 400, param=param)


def _check_keys(body: dict[str, Any], known: frozenset[str]) -> None:
    where = "/v1/chat/completions" if "messages" in known else "/v1/completions"
    for key in body:
        if key not in known and key not in _IGNORED and not accept_unknown(where, key):
            raise _bad(f"Unrecognized request argument supplied: {key}", key)


def _model(body: dict[str, Any], names: frozenset[str], default: str, strict: bool) -> str:
    """The served name: any ``model`` is served by our one model, as SGLang does, unless
    ``strict`` (``--strict-model-name``), where another name is a 404."""
    model = body.get("model")
    if model is None:
        return default
    if not isinstance(model, str):
        raise _bad("model must be a string.", "model")
    if strict and model not in names:
        raise OpenAIError(
            f"The model `{model}` does not exist.", 404, param="model", code="model_not_found"
        )
    return default


def _int_field(body: dict[str, Any], name: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        bound = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
        raise _bad(f"{name} must be an integer {bound}, got {v!r}.", name)
    return v


def _bool_field(body: dict[str, Any], name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _bad(f"{name} must be a boolean, got {v!r}.", name)
    return v


def _rid(body: dict[str, Any]) -> str | None:
    rid = body.get("rid")
    if rid is not None and (not isinstance(rid, str) or not rid):
        raise _bad("rid must be a non-empty string.", "rid")
    return rid


def _stream(body: dict[str, Any]) -> tuple[bool, bool, bool]:
    """``stream``, ``stream_options.include_usage``, ``.continuous_usage_stats``."""
    stream = _bool_field(body, "stream")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False, False
    if not stream:
        raise _bad("The 'stream_options' parameter is only allowed when 'stream' is enabled.")
    if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
        raise _bad("stream_options must be an object with include_usage.", "stream_options")
    return stream, _bool_field(opts, "include_usage"), _bool_field(opts, "continuous_usage_stats")


def _unsupported(body: dict[str, Any], name: str, allowed: tuple[Any, ...] = (None,)) -> None:
    if body.get(name) not in allowed:
        raise _bad(f"{name} is not supported by this server.", name)


def _response_format(body: dict[str, Any]) -> str | None:
    """``response_format`` -> the JSON schema text the output must match (None: text).

    ``json_object`` is any JSON object; ``json_schema`` is OpenAI's ``{"name", "schema",
    "strict"}`` (the schema is always enforced, strict or not: a 135M model's output only
    parses when it is)."""
    fmt = body.get("response_format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return '{"type": "object"}'
    if kind != "json_schema":
        raise _bad(
            "response_format must be an object with type 'text', 'json_object' or 'json_schema'.",
            "response_format",
        )
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise _bad(
            "response_format.json_schema must be an object with a name (and a schema).",
            "response_format",
        )
    schema = spec.get("schema", {"type": "object"})
    if not isinstance(schema, dict):
        raise _bad("response_format.json_schema.schema must be an object.", "response_format")
    return json.dumps(schema)


def _sampling(body: dict[str, Any], max_tokens: int | None, vocab_size: int) -> SamplingRequest:
    raw = {sg: body[oa] for oa, sg in _SAMPLING.items() if oa in body}
    raw["max_new_tokens"] = max_tokens
    schema = _response_format(body)
    if schema is not None:
        if raw.get("regex") is not None or raw.get("ebnf") is not None:
            raise _bad("Set only one of response_format, regex and ebnf.", "response_format")
        raw["json_schema"] = schema
    try:
        return parse_sampling_params(raw, vocab_size=vocab_size)
    except RequestError as exc:
        message = exc.message.replace("max_new_tokens", "max_tokens").replace(
            "min_new_tokens", "min_tokens"
        )
        first = message.split(" ", 1)[0].split("[", 1)[0]
        if first == "json_schema":
            first = "response_format"
        param = first if first in _SAMPLING or first in ("max_tokens", "response_format") else None
        raise _bad(message, param) from None


def _common(
    body: Any, known: frozenset[str], names: frozenset[str], default_model: str, strict: bool
) -> tuple[str, bool, bool, bool]:
    if not isinstance(body, dict):
        raise _bad("The request body must be a JSON object.")
    _check_keys(body, known)
    model = _model(body, names, default_model, strict)
    return (model, *_stream(body))


def _check_size(prompts: int, sp: SamplingRequest) -> None:
    if prompts * sp.n > MAX_SEQUENCES:
        raise _bad(f"The request asks for {prompts * sp.n} sequences; at most {MAX_SEQUENCES}.")


def _completion_prompts(prompt: Any, vocab_size: int) -> list[str | list[int]]:
    def ids(seq: Any) -> list[int]:
        if not seq or not all(type(t) is int and 0 <= t < vocab_size for t in seq):
            raise _bad(f"Token ids must be a non-empty list of integers in [0, {vocab_size}).")
        return list(seq)

    if isinstance(prompt, str):
        prompts: list[str | list[int]] = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        prompts = [ids(p) for p in prompt]
    elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        prompts = [ids(prompt)]
    else:
        raise _bad(
            "prompt must be a string, a list of strings, a list of token ids "
            "or a list of lists of token ids.",
            "prompt",
        )
    if any(p == "" for p in prompts):
        raise _bad("prompt must not be empty.", "prompt")
    return prompts


def parse_completion(
    body: Any,
    *,
    vocab_size: int,
    model_names: frozenset[str],
    default_model: str,
    strict_model: bool = False,
) -> OpenAIRequest:
    """A ``/v1/completions`` body; raises OpenAIError."""
    model, stream, include_usage, continuous = _common(
        body, _COMPLETION, model_names, default_model, strict_model
    )
    prompts = _completion_prompts(body.get("prompt"), vocab_size)
    _unsupported(body, "suffix", (None, ""))
    # max_tokens 0 with echo scores the prompt alone (legacy completions, SGLang).
    max_tokens = _int_field(body, "max_tokens", 0 if body.get("echo") is True else 1)
    sp = _sampling(body, COMPLETION_MAX_TOKENS if max_tokens is None else max_tokens, vocab_size)
    if body.get("best_of") not in (None, sp.n):
        raise _bad("best_of other than n is not supported by this server.", "best_of")
    _check_size(len(prompts), sp)
    return OpenAIRequest(
        chat=False,
        model=model,
        prompts=prompts,
        sampling=sp,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        logprobs=_int_field(body, "logprobs", 0, MAX_TOP_LOGPROBS),
        echo=_bool_field(body, "echo"),
        rid=_rid(body),
    )


def _chat_tools(
    body: dict[str, Any], sp: SamplingRequest, fmt: ToolFormat | None
) -> tuple[ToolSpec | None, SamplingRequest]:
    """The request's tools, and its sampling with the grammar a forcing ``tool_choice``
    sets in ``fmt``'s format (with another constraint asked for as well: 400); a format
    whose markers are special tokens keeps them in the text unless the body says."""
    tools = parse_tools(body)
    if tools is not None and fmt is not None and fmt.special:
        if body.get("skip_special_tokens") is None:
            sp = replace(sp, skip_special_tokens=False)
    if tools is None or not tools.forced:
        return tools, sp
    if sp.params.grammar is not None:
        raise ToolParamError("tool_choice 'required' or a named function cannot be combined "
                             "with response_format, regex or ebnf.", "tool_choice")  # fmt: skip
    grammar = ("lark", tool_grammar(tools, fmt))
    return tools, replace(sp, params=replace(sp.params, grammar=grammar))


def _thinking_budget(body: dict[str, Any]) -> int | None:
    """The thinking budget by either name (400 when both are given and differ)."""
    got = {name: _int_field(body, name, 0, MAX_REASONING_BUDGET) for name in _BUDGETS}
    values = {v for v in got.values() if v is not None}
    if len(values) > 1:
        raise _bad("thinking_token_budget and thinking_budget differ; send one.",
                   "thinking_budget")  # fmt: skip
    return values.pop() if values else None


def parse_chat(
    body: Any,
    *,
    vocab_size: int,
    model_names: frozenset[str],
    default_model: str,
    strict_model: bool = False,
    tool_format: ToolFormat | None = None,
) -> tuple[OpenAIRequest, list[dict[str, str]]]:
    """A ``/v1/chat/completions`` body and its messages; the caller renders the prompt
    (``tool_format``: the family whose calls a forcing ``tool_choice`` writes)."""
    model, stream, include_usage, continuous = _common(
        body, _CHAT, model_names, default_model, strict_model
    )
    try:
        messages = chat_messages(body.get("messages"))
    except ToolParamError as exc:
        raise _bad(exc.message, exc.param) from None
    for name in _CHAT_NULL_ONLY:
        _unsupported(body, name)
    _unsupported(body, "modalities", (None, ["text"]))
    _unsupported(body, "web_search_options")
    limit = _int_field(body, "max_completion_tokens", 1)
    if limit is None:
        limit = _int_field(body, "max_tokens", 1)
    sp = _sampling(body, limit, vocab_size)  # None: up to the context end
    try:
        tools, sp = _chat_tools(body, sp, tool_format)
    except ToolParamError as exc:
        raise _bad(exc.message, exc.param) from None
    _check_size(1, sp)
    top = _int_field(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    want = _bool_field(body, "logprobs")
    cont = _bool_field(body, "continue_final_message")
    if cont and messages[-1]["role"] != "assistant":
        raise _bad("continue_final_message needs the last message to be the assistant's.",
                   "continue_final_message")  # fmt: skip
    if top is not None and not want:
        raise _bad("top_logprobs requires logprobs to be true.", "top_logprobs")
    req = OpenAIRequest(
        chat=True,
        model=model,
        prompts=[],
        sampling=sp,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        continue_final=cont,
        template_kwargs=template_kwargs(body),
        separate_reasoning=body.get("separate_reasoning") is None
        or _bool_field(body, "separate_reasoning"),
        logprobs=(top or 0) if want else None,
        rid=_rid(body),
        tools=tools,
        reasoning_budget=_thinking_budget(body),
    )
    return req, messages
