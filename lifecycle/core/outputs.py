"""One output sample in SGLang's shapes (reference/sglang.md §4): ids, text, logprobs, meta.

A ``SampleOutput`` consumes the chunks of its ``OutputBuffer`` and renders either a unary
reply item or a stream frame, cumulative or incremental. Logprob entries are
``[logprob, token_id, text|null]``; text only with ``return_text_in_logprobs``. Token
text for logprobs is decoded once per token, never again per frame.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lifecycle.core.buffers import Chunk
from lifecycle.core.detok import SampleText, TokenizerLike
from lifecycle.core.reasoning import ReasoningCount, ReasoningFormat
from lifecycle.core.sampling import SamplingRequest
from wire import Finish, RequestOptions, f32s_to_list, ids_to_list

if TYPE_CHECKING:
    from lifecycle.core.params import GenerateItem

__all__ = [
    "SPEC_KEYS",
    "OutputOptions",
    "SampleOutput",
    "grammar_detail",
    "prompt_reasoning",
    "spec_meta",
]

# A speculating request's record in its terminal STEP entry (specs/wire.cddl): steps that
# checked a proposal, tokens proposed, tokens of those accepted.
SPEC_KEYS = ("spec_verify_ct", "spec_num_proposed_drafts", "spec_num_correct_drafts")


def spec_meta(spec: dict[str, int]) -> dict[str, Any]:
    """``meta_info``'s speculative keys (SGLang's names): the record, the accepted share
    of the proposed tokens, and the tokens a checked step gave on average (the accepted
    ones and the one it samples itself)."""
    proposed, correct, steps = (spec[k] for k in ("spec_num_proposed_drafts",
                                                  "spec_num_correct_drafts", "spec_verify_ct"))  # fmt: skip
    return {
        **spec,
        "spec_accept_rate": correct / proposed if proposed else 0.0,
        "spec_accept_length": 1 + correct / steps if steps else 0.0,
    }


Entry = list[Any]  # [logprob | None, token_id, text | None]


@dataclass(frozen=True, slots=True)
class OutputOptions:
    """What one prompt's samples report, and how their text is cut: the request's own
    values as they are, and the server's facts about it."""

    request: RequestOptions = field(default_factory=RequestOptions)  # what the worker returns
    # how the text is cut: stops (a stop_regex match's finish names its pattern), special
    # tokens, the stop's trim
    sampling: SamplingRequest = field(default_factory=SamplingRequest)
    return_text_in_logprobs: bool = False
    weight_version: str = "default"  # the server's, in every meta_info (SGLang's key)
    reasoning: ReasoningFormat | None = None  # what meta_info.reasoning_tokens counts
    reasoning_open: bool = False  # the prompt opened the reasoning
    dp_rank: int | None = None  # the --dp worker that runs it (SGLang's key; None: one)

    @classmethod
    def of(
        cls,
        item: GenerateItem,
        request: RequestOptions,
        weight_version: str,
        reasoning: ReasoningFormat | None = None,
        reasoning_open: bool = False,
        dp_rank: int | None = None,
    ) -> OutputOptions:
        """``item``'s, with ``request`` the options its SUBMIT carries."""
        return cls(
            request=request,
            sampling=item.sampling,
            return_text_in_logprobs=item.return_text_in_logprobs,
            weight_version=weight_version,
            reasoning=reasoning,
            reasoning_open=reasoning_open,
            dp_rank=dp_rank,
        )


def prompt_reasoning(
    fmt: ReasoningFormat | None, item: GenerateItem, prompt: list[int], tok: TokenizerLike
) -> tuple[ReasoningFormat | None, bool]:
    """The reasoning format a prompt's samples count by, and whether the prompt opened it
    (read from the prompt's text, or its last tokens' text)."""
    if fmt is None:
        return None, False
    text = item.text
    if text is None:
        text = tok.decode(prompt[-8:], skip_special_tokens=False)
    return fmt, fmt.opened_by(text)


def _regex_finish(finish: Any, opts: OutputOptions) -> Any:
    """A ``stop_regex`` match's finish names the pattern that matched, as SGLang's does:
    the worker reports the matched text (which the text was trimmed by) and the
    pattern's index."""
    i = finish.get("regex")
    if i is None:
        return finish
    patterns = opts.sampling.params.stop_regex
    if not (type(i) is int and 0 <= i < len(patterns)):
        raise ValueError(f"a stop_regex finish names pattern {i!r} of {len(patterns)}")
    return {"type": Finish.STOP, "matched": patterns[i]}


def _lp(v: float) -> float | None:
    return None if math.isnan(v) else v


class SampleOutput:
    def __init__(
        self, tokenizer: TokenizerLike, opts: OutputOptions, prompt: list[int], rid: str
    ) -> None:
        self.tok = tokenizer
        self.opts = opts
        self.prompt = prompt
        self.rid = rid
        self.text = SampleText(
            tokenizer,
            skip_special_tokens=opts.sampling.skip_special_tokens,
            stops=opts.sampling.stop,
            no_stop_trim=opts.sampling.no_stop_trim,
        )
        self.ids: list[int] = []
        self.finish: Any = None  # finish_reason dict once ended
        self.failure: Any = None  # WorkerFailure / Cause when it ended without one
        self.prompt_tokens = len(prompt)
        self.cached_tokens = 0
        self.num_retractions = 0
        self.spec: dict[str, int] = {}  # speculative decoding's record (its terminal entry)
        self.lp: dict[str, list[Any]] = {}
        self.hidden: list[list[float]] = []
        self.embedding: list[float] | None = None  # an embed request's pooled vector
        self.grammar: dict[str, Any] | None = None  # a constrained sample: compile, done
        self.sent_ids = 0
        self.sent_chars = 0
        self.final_text: str | None = None
        self._lp_pos = 0  # output position of the next logprob entry while consuming
        # the reasoning's count reads each token's text as a stream decodes it (a token
        # that ends inside a multi-byte character adds "" and still counts)
        self.reasoning: ReasoningCount | None = None
        if opts.reasoning is not None:
            self.reasoning = ReasoningCount(opts.reasoning, opts.reasoning_open)
            self._reasoning_text = tokenizer.decode_stream(skip_special_tokens=False)

    # -- input ---------------------------------------------------------------------------
    def consume(self, chunk: Chunk) -> None:
        # A chunk may hold several appends (steps); each extra describes the ids of its
        # own append, so logprobs are matched to ids from the chunk's start, in order.
        self._lp_pos = len(self.ids)
        if chunk.ids:
            self.ids += chunk.ids
            self.text.feed(chunk.ids)
            if self.reasoning is not None:
                for i in chunk.ids:
                    self.reasoning.feed(self._reasoning_text.step(i))
        for extra in chunk.extras:
            self._extra(extra)

    def _extra(self, extra: dict[str, Any]) -> None:
        self.prompt_tokens = extra.get("prompt_tokens", self.prompt_tokens)
        self.cached_tokens = extra.get("cached_tokens", self.cached_tokens)
        self.num_retractions = extra.get("num_retractions", self.num_retractions)
        if "spec_verify_ct" in extra:
            self.spec = {k: extra.get(k, 0) for k in SPEC_KEYS}
        if "embedding" in extra:
            self.embedding = f32s_to_list(extra["embedding"])
        if "grammar_compile_ms" in extra:
            self.grammar = {"compile_ms": extra["grammar_compile_ms"],
                            "cached": bool(extra.get("grammar_cached")), "done": False}  # fmt: skip
        if extra.get("grammar_done") and self.grammar is not None:
            self.grammar["done"] = True
        if not self.opts.request.return_logprob:
            if "hidden_states" in extra:
                self.hidden += [f32s_to_list(h) for h in extra["hidden_states"]]
            return
        # Output positions these extras describe: the ids appended with them.
        if "logprobs" in extra:
            values = f32s_to_list(extra["logprobs"])
            ids = self.ids[self._lp_pos : self._lp_pos + len(values)]
            self._lp_pos += len(values)
            self._add(
                "output_token_logprobs",
                [self._entry(v, i) for v, i in zip(values, ids, strict=False)],
            )
            if "top_ids" in extra:
                self._add(
                    "output_top_logprobs", self._tops(extra["top_ids"], extra["top_logprobs"])
                )
            if "ids_logprobs" in extra and self.opts.request.token_ids_logprob:
                self._add("output_token_ids_logprobs", self._given(extra["ids_logprobs"]))
        if "prompt_logprobs" in extra:
            start = max(self.opts.request.logprob_start_len, 0)
            values = f32s_to_list(extra["prompt_logprobs"])
            ids = self.prompt[start : start + len(values)]
            self._add(
                "input_token_logprobs",
                [self._entry(v, i) for v, i in zip(values, ids, strict=False)],
            )
            if "prompt_top_ids" in extra:
                self._add(
                    "input_top_logprobs",
                    self._tops(extra["prompt_top_ids"], extra["prompt_top_logprobs"]),
                )
            if "prompt_ids_logprobs" in extra and self.opts.request.token_ids_logprob:
                self._add("input_token_ids_logprobs", self._given(extra["prompt_ids_logprobs"]))
        if "hidden_states" in extra:
            self.hidden += [f32s_to_list(h) for h in extra["hidden_states"]]

    def _add(self, key: str, entries: list[Any]) -> None:
        self.lp.setdefault(key, []).extend(entries)

    def _entry(self, v: float, token_id: int) -> Entry:
        text = self.tok.token_text(token_id) if self.opts.return_text_in_logprobs else None
        return [_lp(v), token_id, text]

    def _tops(self, ids_rows: list[bytes], lp_rows: list[bytes]) -> list[Any]:
        return [
            [self._entry(v, i) for v, i in zip(f32s_to_list(lps), ids_to_list(ids), strict=False)]
            or None
            for ids, lps in zip(ids_rows, lp_rows, strict=False)
        ]

    def _given(self, rows: list[bytes]) -> list[Any]:
        given = self.opts.request.token_ids_logprob or ()
        return [
            [self._entry(v, i) for v, i in zip(f32s_to_list(r), given, strict=False)] for r in rows
        ]

    # -- output --------------------------------------------------------------------------
    def end(self, finish: Any) -> None:
        """The worker's finish; ValueError for an embed finish without its vector."""
        if finish.get("type") == Finish.EMBED and (
            self.embedding is None or len(self.embedding) != finish.get("dimensions")
        ):
            raise ValueError("an embed finish without an embedding of its dimensions")
        self.final_text = self.text.final(finish, self.sent_chars)  # trims the matched text
        self.finish = _regex_finish(finish, self.opts)

    def meta(self, e2e: float | None) -> dict[str, Any]:
        m: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finish,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.ids),
            "reasoning_tokens": self.reasoning.tokens if self.reasoning is not None else 0,
            "cached_tokens": self.cached_tokens,
            "num_retractions": self.num_retractions,
            "weight_version": self.opts.weight_version,
        }
        if self.spec:
            m.update(spec_meta(self.spec))
        if self.opts.dp_rank is not None:
            m["dp_rank"] = self.opts.dp_rank
        if e2e is not None:
            m["e2e_latency"] = e2e
        return m

    def result(self, e2e: float) -> dict[str, Any]:
        """The unary reply item."""
        meta = self.meta(e2e)
        if self.opts.request.return_logprob:
            meta.update(self._lp_fields(0))
            meta["output_token_logprobs_length"] = len(self.lp.get("output_token_logprobs", ()))
        if self.opts.request.return_hidden_states:
            meta["hidden_states"] = self.hidden
        text = self.final_text if self.final_text is not None else self.text.raw
        return {"text": text, "output_ids": list(self.ids), "meta_info": meta}

    def frame(self, incremental: bool, e2e: float | None) -> dict[str, Any]:
        """A stream frame covering everything since the previous frame."""
        ended = self.finish is not None
        text = (
            self.final_text
            if ended and self.final_text is not None
            else self.text.visible(self.sent_chars)
        )
        meta = self.meta(e2e if ended else None)
        if incremental:
            out_text, out_ids = text[self.sent_chars :], self.ids[self.sent_ids :]
            lp_from = self.sent_ids
        else:
            out_text, out_ids = text, list(self.ids)
            lp_from = 0
        if self.opts.request.return_logprob:
            meta.update(self._lp_fields(lp_from))
        if self.opts.request.return_hidden_states and ended:
            meta["hidden_states"] = self.hidden
        self.sent_chars = max(self.sent_chars, len(text))
        self.sent_ids = len(self.ids)
        return {"text": out_text, "output_ids": out_ids, "meta_info": meta}

    def _lp_fields(self, out_from: int) -> dict[str, Any]:
        o = self.opts.request
        fields: dict[str, Any] = {
            "input_token_logprobs": self.lp.get("input_token_logprobs", []),
            "output_token_logprobs": self.lp.get("output_token_logprobs", [])[out_from:],
        }
        if o.top_logprobs_num:
            fields["input_top_logprobs"] = self.lp.get("input_top_logprobs", [])
            fields["output_top_logprobs"] = self.lp.get("output_top_logprobs", [])[out_from:]
        if o.token_ids_logprob:
            fields["input_token_ids_logprobs"] = self.lp.get("input_token_ids_logprobs", [])
            fields["output_token_ids_logprobs"] = self.lp.get("output_token_ids_logprobs", [])[
                out_from:
            ]
        return fields


def grammar_detail(samples: list[SampleOutput]) -> str | None:
    """The finish edge's detail for a constrained request (its trace says what the
    grammar cost and whether it, not a length or a stop, ended the output)."""
    info = [s.grammar for s in samples if s.grammar is not None]
    if not info:
        return None
    first = info[0]
    hit = "cache hit" if first["cached"] else "cache miss"
    done = sum(g["done"] for g in info)
    return (
        f"grammar: compiled in {first['compile_ms']:.2f} ms ({hit}); "
        f"complete in {done} of {len(samples)} samples"
    )
