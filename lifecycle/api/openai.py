"""The OpenAI-compatible HTTP API: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``.

Bodies are mapped onto the native request (``openai_params``) and run through the same
``Frontend`` as ``/generate``: one state machine, one admission queue, one disconnect and
error path. Everything refused before the stream starts is an OpenAI error body with its
status (400 bad input, 404 ``model_not_found``, 503 not ready or overloaded); once SSE
headers are out, an error is a ``data: {"error": {...}}`` chunk followed by
``data: [DONE]``, so a truncated stream never looks like success.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import orjson

from lifecycle.api.calls import http_call, run_unary
from lifecycle.api.openai_errors import OpenAIError
from lifecycle.api.openai_outputs import ChoiceState, ReplyIds, TokenTexts, fingerprint, usage
from lifecycle.api.openai_params import OpenAIRequest, parse_chat, parse_completion
from lifecycle.chat.reasoning import ReasoningFormat
from lifecycle.chat.tool_formats import ToolFormat, detect_tool_format, tool_format
from lifecycle.chat.tool_params import ToolSpec
from lifecycle.chat.tool_prompt import render_chat
from lifecycle.core.call import ExitCause, GenerateCall
from lifecycle.core.errors import RequestError, ServeError
from lifecycle.core.frontend import Frontend
from lifecycle.core.params import GenerateRequest
from transport import HTTPError, JSONResponse, Request, Response, Router, SSEResponse

if TYPE_CHECKING:
    from modelfile.chat import ChatTemplate

__all__ = ["OpenAIAPI", "openai_error"]

log = logging.getLogger("lifecycle.api.openai")


def openai_error(exc: OpenAIError, retry_after: int | None = None) -> Response:
    headers = [("retry-after", str(retry_after))] if retry_after else None
    return JSONResponse(exc.body(), exc.status, headers)


class OpenAIAPI:
    def __init__(
        self,
        frontend: Frontend,
        chat_template: ChatTemplate | None,
        *,
        model_id: str,
        model_path: str | None = None,
        strict_model: bool = False,
        tool_call_parser: str | None = None,
    ) -> None:
        from lifecycle.core.version import __version__

        self.fe = frontend
        self.template = chat_template
        self.model_id = model_id
        aliases = {model_id, "default"}
        if model_path:
            aliases |= {model_path, model_path.rsplit("/", 1)[-1].removesuffix(".gguf")}
        self.model_names = frozenset(aliases)
        self.strict_model = strict_model  # another model name: 404, not our model
        self.created = int(time.time())
        self.fingerprint = fingerprint(__version__, model_path or model_id)
        self.texts = TokenTexts(frontend.tokenizer)
        # the server's reasoning format is the frontend's (the one the core counts by)
        self.reasoning: ReasoningFormat | None = frontend.reasoning
        self.tool_format = chat_tool_format(chat_template, tool_call_parser)

    def install(self, router: Router) -> None:
        router.add("POST", "/v1/completions", self.completions)
        router.add("POST", "/v1/chat/completions", self.chat_completions)
        router.add("GET", "/v1/models", self.models)
        router.add("GET", "/v1/models/{model:path}", self.model)

    # -- models ------------------------------------------------------------------------------
    def _card(self) -> dict[str, Any]:
        return {
            "id": self.model_id,
            "object": "model",
            "created": self.created,
            "owned_by": "lifecycle",
            "root": self.model_id,
            "parent": None,
            "max_model_len": self.fe.model_config.context_length,
            "state": self.fe.model_state(),  # loaded | loading | unloading | unloaded
        }

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._card()]})

    async def model(self, request: Request) -> Response:
        name = unquote(request.path_params.get("model", ""))
        if name not in self.model_names:
            return openai_error(
                OpenAIError(
                    f"The model `{name}` does not exist.",
                    404,
                    param="model",
                    code="model_not_found",
                )
            )
        return JSONResponse(self._card())

    # -- generation --------------------------------------------------------------------------
    async def _body(self, request: Request) -> Any:
        try:
            return await request.json()
        except HTTPError as exc:  # invalid JSON (400), a body over the limit (413)
            raise OpenAIError(exc.message, exc.status) from None

    def _chat_opts(self) -> dict[str, Any]:
        return {**self._opts(), "tool_format": self.tool_format}

    def _opts(self) -> dict[str, Any]:
        return {
            "vocab_size": self.fe.model_config.vocab_size,
            "model_names": self.model_names,
            "default_model": self.model_id,
            "strict_model": self.strict_model,
        }

    async def completions(self, request: Request) -> Response:
        try:
            oreq = parse_completion(await self._body(request), **self._opts())
        except OpenAIError as exc:
            return openai_error(exc)
        echo = [
            (p if isinstance(p, str) else self.fe.codec.decode(p)) if oreq.echo else ""
            for p in oreq.prompts
        ]
        return await self._generate(request, oreq, oreq.prompts, echo, "prompt")

    async def chat_completions(self, request: Request) -> Response:
        try:
            oreq, messages = parse_chat(await self._body(request), **self._chat_opts())
            ids = await self._chat_prompt(
                messages, oreq.continue_final, oreq.tools, oreq.template_kwargs
            )
        except OpenAIError as exc:
            return openai_error(exc)
        return await self._generate(request, oreq, [ids], [""], "messages")

    async def _chat_prompt(
        self,
        messages: list[dict[str, Any]],
        continue_final: bool = False,
        tools: ToolSpec | None = None,
        variables: dict[str, Any] | None = None,
    ) -> list[int]:
        """The prompt ids; ``continue_final``: the last (assistant) message left open, so
        the model continues it; ``tools``: rendered as ``tool_prompt`` says; ``variables``:
        the request's ``chat_template_kwargs``."""
        if self.template is None:
            raise OpenAIError("This model has no chat template; use /v1/completions.")
        try:
            text = render_chat(
                self.template,
                messages,
                tools=tools,
                add_generation_prompt=not continue_final,
                continue_final=continue_final,
                variables=variables,
                fmt=self.tool_format,
            )
        except ValueError as exc:  # ChatTemplateError: the template refused the messages
            raise OpenAIError(str(exc), param="messages") from None
        # The template writes its own special tokens (BOS included, when it wants one).
        return (await self.fe.codec.encode([text], add_special_tokens=False))[0]

    async def native_request(self, api: str, body: Any) -> GenerateRequest:
        """An OpenAI ``completions`` or ``chat`` body as the native request (for the
        WebSocket route); raises ``OpenAIError``."""
        if api == "completions":
            oreq = parse_completion(body, **self._opts())
            return oreq.generate_request(oreq.prompts)
        oreq, messages = parse_chat(body, **self._chat_opts())
        ids = await self._chat_prompt(
            messages, oreq.continue_final, oreq.tools, oreq.template_kwargs
        )
        return oreq.generate_request([ids])

    async def _generate(
        self,
        request: Request,
        oreq: OpenAIRequest,
        prompts: list[str | list[int]],
        echo: list[str],
        prompt_param: str,
    ) -> Response:
        async with http_call(self.fe, oreq.generate_request(prompts), request) as call:
            refused = await start_call(call, prompt_param)
            if refused is not None:
                return refused
            choices = self.choices(call, oreq, echo)
            ids = ReplyIds(oreq.chat, oreq.model, self.fingerprint)
            if oreq.stream:
                events = self._events(call, oreq, choices, ids)
                return await request.respond(SSEResponse(events))
            return await self._unary(call, request, oreq, choices, ids)

    def choices(
        self, call: GenerateCall, oreq: OpenAIRequest, echo: list[str]
    ) -> list[ChoiceState]:
        """One state per sample, in the frontend's order (``GenerateCall.samples``); the
        OpenAI index is prompt-major: prompt ``i``, sample ``j`` -> ``i * n + j``. The
        Responses and Messages APIs take the one state of their one chat prompt."""
        n, runs = oreq.sampling.n, call.runs
        tools = oreq.tools.names if oreq.tools is not None else None
        return [
            ChoiceState(
                i * n + j,
                runs[i].samples[j],
                self.texts,
                chat=oreq.chat,
                echo=echo[i],
                tools=tools,
                tool_format=self.tool_format,
                tool_schemas=oreq.tools.schemas if oreq.tools is not None else None,
                reasoning=self.reasoning if oreq.chat else None,
                separate_reasoning=oreq.separate_reasoning,
            )  # fmt: skip
            for j in range(n)
            for i in range(len(runs))
        ]

    def _usage(
        self, call: GenerateCall, choices: list[ChoiceState] | None = None
    ) -> dict[str, Any]:
        firsts = [run.samples[0] for run in call.runs if run.samples]
        reasoning = None
        if choices and choices[0].reasoning is not None:
            reasoning = sum(c.reasoning_tokens() for c in choices)
        return usage(
            sum(s.prompt_tokens for s in firsts),
            sum(len(s.ids) for s in call.samples()),
            sum(s.cached_tokens for s in firsts),
            reasoning,
        )

    async def _unary(
        self,
        call: GenerateCall,
        request: Request,
        oreq: OpenAIRequest,
        choices: list[ChoiceState],
        ids: ReplyIds,
    ) -> Response:
        refused = await run_call(call, request)
        if refused is not None:
            return refused
        body = self._reply(call, oreq, choices, ids)
        return JSONResponse(body)

    def _reply(
        self, call: GenerateCall, oreq: OpenAIRequest, choices: list[ChoiceState], ids: ReplyIds
    ) -> dict[str, Any]:
        """The unary reply of a call that ended well."""
        e2e = call.e2e()
        body = ids.envelope("chat.completion" if oreq.chat else "text_completion")
        body["choices"] = sorted((c.result(e2e) for c in choices), key=lambda c: c["index"])
        body["usage"] = self._usage(call, choices)
        return body

    async def reply(self, url: str, body: Any, exit_cause: ExitCause) -> dict[str, Any]:
        """A unary ``/v1/completions`` or ``/v1/chat/completions`` reply without HTTP (the
        batch runner's lines); raises ``OpenAIError`` as the route answers it."""
        if url not in ("/v1/completions", "/v1/chat/completions"):
            raise OpenAIError(f"unsupported url {url!r}", 400, param="url")
        if isinstance(body, dict) and body.get("stream"):
            raise OpenAIError("stream is not supported here", 400, param="stream")
        if url == "/v1/completions":
            oreq = parse_completion(body, **self._opts())
            prompts, param = oreq.prompts, "prompt"
            echo = [
                (p if isinstance(p, str) else self.fe.codec.decode(p)) if oreq.echo else ""
                for p in prompts
            ]
        else:
            oreq, messages = parse_chat(body, **self._chat_opts())
            ids = await self._chat_prompt(
                messages, oreq.continue_final, oreq.tools, oreq.template_kwargs
            )
            prompts, param, echo = [ids], "messages", [""]
        async with self.fe.call(oreq.generate_request(prompts), exit_cause) as call:
            try:
                await call.start()
            except (RequestError, ServeError) as exc:
                raise OpenAIError.from_cause(exc.cause, exc.message, param) from None
            choices = self.choices(call, oreq, echo)
            try:
                await call.result()
            except ServeError as exc:
                raise OpenAIError.from_cause(exc.cause, exc.message) from None
            reply = self._reply(
                call, oreq, choices, ReplyIds(oreq.chat, oreq.model, self.fingerprint)
            )
            return reply

    async def _events(
        self,
        call: GenerateCall,
        oreq: OpenAIRequest,
        choices: list[ChoiceState],
        ids: ReplyIds,
    ) -> AsyncIterator[bytes]:
        """The stream's chunks; owns nothing (the handler's call scope does)."""
        obj = "chat.completion.chunk" if oreq.chat else "text_completion"

        def chunk(choice: dict[str, Any]) -> bytes:
            out = {**ids.envelope(obj), "choices": [choice]}
            if oreq.continuous_usage:
                out["usage"] = self._usage(call)  # so far
            elif oreq.include_usage:
                out["usage"] = None
            return orjson.dumps(out)

        if oreq.chat:
            for state in sorted(choices, key=lambda c: c.index):
                yield chunk(state.role_choice())
        async for index, _sample, frame in call.frames(True):
            for choice in choices[index].chunk_choices(frame):
                yield chunk(choice)
        err = call.error()
        if err is not None:
            cause, message = err
            yield orjson.dumps(OpenAIError.from_cause(cause, message).body())
        elif oreq.include_usage:
            final = self._usage(call, choices)
            yield orjson.dumps({**ids.envelope(obj), "choices": [], "usage": final})
        yield b"[DONE]"


def chat_tool_format(template: ChatTemplate | None, tool_call_parser: str | None) -> ToolFormat:
    """The tool-call format of a server: the option's (``ValueError`` for an unknown
    name), else what the chat template shows. A template that does not render tools gets
    Hermes' format (the one ``tool_prompt`` asks for)."""
    if tool_call_parser is not None:
        return tool_format(tool_call_parser)
    rendered = template is not None and template.mentions_tools
    return detect_tool_format(template.source if rendered and template else None)


async def start_call(call: GenerateCall, param: str | None) -> Response | None:
    """``call.start()``; the OpenAI error reply when it was refused (``param``: the field
    a 4xx names), else None."""
    try:
        await call.start()
    except RequestError as exc:
        return openai_error(OpenAIError.from_cause(exc.cause, exc.message, param))
    except ServeError as exc:
        err = OpenAIError.from_cause(exc.cause, exc.message)
        return openai_error(err, exc.cause.retry_after)
    return None


async def run_call(call: GenerateCall, request: Request) -> Response | None:
    """Run a unary call to its end; the reply when it did not end well (499 when the
    client left, the OpenAI error when it failed), else None."""
    if not await run_unary(call, request):
        return Response(b"", 499)  # nobody reads it; the scope closes the call
    failed = call.error()
    if failed is not None:
        cause, message = failed
        return openai_error(OpenAIError.from_cause(cause, message), cause.retry_after)
    return None
