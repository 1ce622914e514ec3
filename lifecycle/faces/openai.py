"""OpenAI's ``/v1/completions`` and ``/v1/chat/completions`` without HTTP: a body in, a
native request out, a call's outputs as OpenAI's reply.

``OpenAIFace`` holds what a served model answers as (its names, the chat template, the
tool-call and reasoning formats), checks a body (``openai_params``), renders a chat
prompt, and shapes the choices and usage of a call (``openai_outputs``). The HTTP routes
(``lifecycle/api/openai.py``) put it on the transport, with the SSE stream; the Engine's
``lifecycle batch`` answers OpenAI lines with ``reply`` alone. Every refusal is an
``OpenAIError`` (``openai_errors``), the body and status a route answers.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from lifecycle.chat.reasoning import ReasoningFormat
from lifecycle.chat.tool_formats import ToolFormat, detect_tool_format, tool_format
from lifecycle.chat.tool_params import ToolSpec
from lifecycle.chat.tool_prompt import render_chat
from lifecycle.core.call import ExitCause, GenerateCall
from lifecycle.core.errors import RequestError, ServeError
from lifecycle.core.frontend import Frontend
from lifecycle.core.params import GenerateRequest
from lifecycle.faces.openai_errors import OpenAIError
from lifecycle.faces.openai_outputs import ChoiceState, ReplyIds, TokenTexts, fingerprint, usage
from lifecycle.faces.openai_params import OpenAIRequest, parse_chat, parse_completion

if TYPE_CHECKING:
    from modelfile.chat import ChatTemplate

__all__ = ["OpenAIFace", "OpenAIPrompt", "chat_tool_format"]

# A checked request, its prompts (chat: the rendered ids), their echo texts, and the body
# field a refusal of the prompt names.
OpenAIPrompt = tuple[OpenAIRequest, list[str | list[int]], list[str], str]


class OpenAIFace:
    """One served model in OpenAI's API: its names, formats, bodies and replies."""

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

    def card(self) -> dict[str, Any]:
        """The model as ``/v1/models`` lists it."""
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

    # -- a body in -------------------------------------------------------------------------
    def opts(self) -> dict[str, Any]:
        """What ``parse_completion`` checks a body against."""
        return {
            "vocab_size": self.fe.model_config.vocab_size,
            "model_names": self.model_names,
            "default_model": self.model_id,
            "strict_model": self.strict_model,
        }

    def chat_opts(self) -> dict[str, Any]:
        """What ``parse_chat`` checks a body against."""
        return {**self.opts(), "tool_format": self.tool_format}

    async def prompt(self, chat: bool, body: Any) -> OpenAIPrompt:
        """A ``completions`` or ``chat`` body checked, with its prompts; raises
        ``OpenAIError``."""
        if not chat:
            oreq = parse_completion(body, **self.opts())
            echo = [
                (p if isinstance(p, str) else self.fe.codec.decode(p)) if oreq.echo else ""
                for p in oreq.prompts
            ]
            return oreq, oreq.prompts, echo, "prompt"
        oreq, messages = parse_chat(body, **self.chat_opts())
        ids = await self.chat_prompt(
            messages, oreq.continue_final, oreq.tools, oreq.template_kwargs
        )
        return oreq, [ids], [""], "messages"

    async def chat_prompt(
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
        oreq, prompts, _echo, _param = await self.prompt(api != "completions", body)
        return oreq.generate_request(prompts)

    # -- a reply out -----------------------------------------------------------------------
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

    def usage(self, call: GenerateCall, choices: list[ChoiceState] | None = None) -> dict[str, Any]:
        """The call's ``usage`` (so far, while it runs); with ``choices``, the reasoning
        tokens among the completion tokens."""
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

    def ids(self, oreq: OpenAIRequest) -> ReplyIds:
        """The ids every object of one reply carries."""
        return ReplyIds(oreq.chat, oreq.model, self.fingerprint)

    def reply_body(
        self, call: GenerateCall, oreq: OpenAIRequest, choices: list[ChoiceState], ids: ReplyIds
    ) -> dict[str, Any]:
        """The unary reply of a call that ended well."""
        e2e = call.e2e()
        body = ids.envelope("chat.completion" if oreq.chat else "text_completion")
        body["choices"] = sorted((c.result(e2e) for c in choices), key=lambda c: c["index"])
        body["usage"] = self.usage(call, choices)
        return body

    async def reply(self, url: Any, body: Any, exit_cause: ExitCause) -> dict[str, Any]:
        """A unary ``/v1/completions`` or ``/v1/chat/completions`` reply without HTTP (the
        batch runner's lines, their ``url`` as read); raises ``OpenAIError`` as the route
        answers it."""
        if url not in ("/v1/completions", "/v1/chat/completions"):
            raise OpenAIError(f"unsupported url {url!r}", 400, param="url")
        if isinstance(body, dict) and body.get("stream"):
            raise OpenAIError("stream is not supported here", 400, param="stream")
        oreq, prompts, echo, param = await self.prompt(url == "/v1/chat/completions", body)
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
            return self.reply_body(call, oreq, choices, self.ids(oreq))


def chat_tool_format(template: ChatTemplate | None, tool_call_parser: str | None) -> ToolFormat:
    """The tool-call format of a server: the option's (``ValueError`` for an unknown
    name), else what the chat template shows. A template that does not render tools gets
    Hermes' format (the one ``tool_prompt`` asks for)."""
    if tool_call_parser is not None:
        return tool_format(tool_call_parser)
    rendered = template is not None and template.mentions_tools
    return detect_tool_format(template.source if rendered and template else None)
