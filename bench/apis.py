"""Request bodies and response reading for the three APIs the load generator speaks.

- ``generate``: SGLang-native ``POST /generate``; a stream is cumulative ``text`` with
  ``meta_info.completion_tokens``, whose deltas split the inter-token gaps (as
  ``bench_serving``'s sglang client does).
- ``completions`` / ``chat``: OpenAI ``POST /v1/completions`` and
  ``/v1/chat/completions``; each chunk that carries text is one token unless the chunk
  also carries ``usage.completion_tokens``, whose deltas are then used instead.

A stream counts as successful only if it ends with ``data: [DONE]``, carried no error
event and no ``abort`` finish reason, and its HTTP body ended cleanly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from bench.metrics import RequestOutput, split_itl

__all__ = ["API_PATHS", "IGNORE_EOS_MODES", "RequestSpec", "ResponseReader", "build_body"]

API_PATHS = {
    "generate": "/generate",
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
}
# off: let the model stop; flag: send ``ignore_eos: true``; logit_bias: forbid the
# end-of-generation ids with a -100 bias (for servers that ignore ``ignore_eos``).
IGNORE_EOS_MODES = ("off", "flag", "logit_bias")


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """How every request of a run is asked: API, streaming, output-length forcing."""

    api: str = "generate"
    stream: bool = True
    ignore_eos: str = "flag"
    eog_ids: tuple[int, ...] = (0, 2, 4)
    model: str = "default"
    stream_usage: bool = False
    extra_body: Mapping[str, Any] = field(default_factory=dict)

    @property
    def path(self) -> str:
        return API_PATHS[self.api]


def _eos_fields(spec: RequestSpec) -> dict[str, Any]:
    if spec.ignore_eos == "flag":
        return {"ignore_eos": True}
    if spec.ignore_eos == "logit_bias":
        return {"logit_bias": {str(i): -100 for i in spec.eog_ids}}
    return {}


def build_body(spec: RequestSpec, prompt: str | tuple[int, ...], output_len: int) -> bytes:
    """The JSON body for one request (greedy, ``output_len`` new tokens)."""
    body: dict[str, Any]
    if spec.api == "generate":
        key = "text" if isinstance(prompt, str) else "input_ids"
        sampling = {"temperature": 0.0, "max_new_tokens": output_len, **_eos_fields(spec)}
        body = {key: prompt if isinstance(prompt, str) else list(prompt)}
        body.update(sampling_params=sampling, stream=spec.stream)
    elif spec.api in ("completions", "chat"):
        if spec.api == "chat":
            if not isinstance(prompt, str):
                raise ValueError("the chat API takes text prompts, not token ids")
            body = {"messages": [{"role": "user", "content": prompt}]}
        else:
            body = {"prompt": prompt if isinstance(prompt, str) else list(prompt)}
        body.update(model=spec.model, temperature=0.0, max_tokens=output_len, stream=spec.stream)
        body.update(_eos_fields(spec))
        if spec.stream and spec.stream_usage:
            body["stream_options"] = {"include_usage": True}
    else:
        raise ValueError(f"unknown api {spec.api!r}")
    body.update(spec.extra_body)
    return orjson.dumps(body)


def _error_text(obj: Any) -> str | None:
    """The message of an error object or an ``abort`` finish, else None."""
    if not isinstance(obj, dict):
        return "response is not a JSON object"
    if "error" in obj:
        err = obj["error"]
        return str(err.get("message", err)) if isinstance(err, dict) else str(err)
    meta = obj.get("meta_info")
    finish = meta.get("finish_reason") if isinstance(meta, dict) else None
    if isinstance(finish, dict) and finish.get("type") == "abort":
        return f"aborted: {finish.get('message', '')}"
    return None


class ResponseReader:
    """Turns one response's events (SSE data or a whole JSON body) into a RequestOutput.

    Times are absolute ``perf_counter`` seconds; ``start`` is when the request was sent."""

    def __init__(self, spec: RequestSpec, prompt_len: int, start: float) -> None:
        self.spec = spec
        self.start = start
        self.out = RequestOutput(prompt_len=prompt_len)
        self._last_t = start
        self._last_count = 0  # tokens reported (or counted) at the last timed chunk
        self._counted = 0  # text-bearing chunks seen
        self._reported: int | None = None  # latest usage/meta completion_tokens
        self._done = False
        self._parts: list[str] = []

    def on_event(self, data: str, t: float) -> None:
        """One SSE ``data`` payload received at time t."""
        self.out.latency = t - self.start
        if data == "[DONE]":
            self._done = True
            return
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            self._fail(f"bad JSON in stream: {data[:80]!r}")
            return
        err = _error_text(obj)
        if err is not None:
            self._fail(err)
            return
        text, reported = self._extract(obj, streaming=True)
        if reported is not None:
            self._reported = reported
        if not text:
            return
        self._counted += 1
        count = reported if reported is not None else self._counted
        if self._counted == 1:
            self.out.ttft = t - self.start
        else:
            new = count - self._last_count
            if new <= 0:
                return  # bench_serving skips a chunk that adds no token, clock included
            self.out.itl.extend(split_itl(t - self._last_t, new))
        self._last_t = t
        self._last_count = count

    def on_body(self, body: bytes, t: float) -> None:
        """A whole non-streaming JSON body received at time t."""
        self.out.latency = self.out.ttft = t - self.start
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError:
            self._fail(f"bad JSON body: {body[:80]!r}")
            return
        err = _error_text(obj)
        if err is not None:
            self._fail(err)
            return
        text, reported = self._extract(obj, streaming=False)
        self.out.generated_text = text
        self.out.output_len = reported if reported is not None else 0
        self.out.success = True

    def finish_stream(self) -> RequestOutput:
        """Close a streaming response whose HTTP body ended cleanly."""
        out = self.out
        if not out.error and not self._done:
            self._fail("stream ended without [DONE]")
        out.output_len = self._reported if self._reported is not None else self._counted
        out.generated_text = "".join(self._parts)
        out.success = not out.error
        return out

    def fail(self, status: int, message: str) -> RequestOutput:
        self.out.status = status
        self._fail(message)
        return self.out

    def _fail(self, message: str) -> None:
        if not self.out.error:
            self.out.error = message
        self.out.success = False

    def _extract(self, obj: dict[str, Any], streaming: bool) -> tuple[str, int | None]:
        """(new or cumulative text, completion_tokens if the payload reports it)."""
        if self.spec.api == "generate":
            meta = obj.get("meta_info") or {}
            text = obj.get("text") or ""
            self._parts = [text]  # SGLang streams cumulative text by default
            return text, meta.get("completion_tokens")
        usage = obj.get("usage") or {}
        choices = obj.get("choices") or [{}]
        if self.spec.api == "chat":
            part = choices[0].get("delta" if streaming else "message") or {}
            text = part.get("content") or ""
        else:
            text = choices[0].get("text") or ""
        if streaming and text:
            self._parts.append(text)
        return text, usage.get("completion_tokens")
