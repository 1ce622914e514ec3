"""Replaying a finished request from its trace (docs/replay.md).

With ``serve --trace-prompts`` each finished generation's trace carries a ``replay``
object: its prompt token ids, its sampling parameters as validated, the ids each sample
produced and the identity of the model that produced them (``replay_record``). A replay
sends that prompt and those parameters again, asking for the logprobs of the recorded
tokens too (``generate_body``), and ``compare`` says whether the new ids are the same or
where they part, with the new run's logprobs of both candidates there.

Two drivers: ``lifecycle trace replay`` over HTTP (``lifecycle.tracing.cli``) and
``POST /debug/requests/{key}/replay`` in the server (``replay_in_process``). This module
is what they share; it imports the request path only inside ``replay_in_process``, so
the CLI stays light.
"""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lifecycle.core.call import GenerateCall
    from lifecycle.core.frontend import Frontend
    from lifecycle.core.fsm import RequestRecord
    from lifecycle.core.sampling import SamplingRequest

__all__ = [
    "REPLAY_TOP_LOGPROBS",
    "ReplayRefused",
    "compare",
    "generate_body",
    "model_identity",
    "model_warnings",
    "replay_in_process",
    "replay_of",
    "replay_record",
    "sampling_json",
]

REPLAY_TOP_LOGPROBS = 5  # the replay's top logprobs at each position (at least 2)
_TEXT_OPTIONS = ("skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")


class ReplayRefused(Exception):
    """A replay that cannot run, with the HTTP status the debug route answers with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


# -- recording (the tracer's recorder, at the terminal edge) -------------------------------


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in fields(cls))
    return names


def sampling_json(sr: SamplingRequest) -> dict[str, Any]:
    """``sampling_params`` as ``/generate`` takes them that validate to ``sr`` again: every
    field, defaults included (greedy is SGLang's temperature 1.0 with top_k 1)."""
    p = sr.params
    out: dict[str, Any] = {}
    for name in _field_names(type(p)):
        value = getattr(p, name)
        if name == "grammar":
            if value is not None:
                out[value[0]] = value[1]  # json_schema / regex / ebnf: its source
            continue
        if name == "logit_bias":
            value = {str(token): bias for token, bias in value}
        elif isinstance(value, tuple):
            value = list(value)
        out[name] = value
    if sr.to_context_end:
        out["max_new_tokens"] = None  # as asked: up to the context's end
    for name in _TEXT_OPTIONS:
        out[name] = getattr(sr, name)
    return out


def model_identity(
    served_id: str | None, card: dict[str, Any], capacity: dict[str, Any]
) -> dict[str, Any]:
    """What identifies the model that ran a request: the served id, the worker's weights
    mode (HELLO ``capacity.weights``) and its file: the digest when the worker reports
    one, else the path and size (HELLO's model card, ``specs/wire.cddl``)."""
    out: dict[str, Any] = {
        "id": served_id or card.get("name"),
        "weights": capacity.get("weights"),
        "device": card.get("device"),
        "dtype": card.get("dtype"),
    }
    if card.get("sha256"):
        out["sha256"] = card["sha256"]
    else:
        out["path"] = card.get("path")
        out["file_bytes"] = card.get("file_bytes")
    return out


def replay_record(
    call: GenerateCall, rec: RequestRecord, served_id: str | None
) -> dict[str, Any] | None:
    """The trace's ``replay`` object for ``rec``, one prompt of ``call``; None for an
    embedding or a prompt that never reached the worker."""
    run = next((r for r in call.runs if r.rec is rec), None)
    item = run.item if run is not None else None
    if run is None or item is None or not run.samples or item.options.embed is not None:
        return None
    client = call.client
    card = client.model if client is not None else {}
    capacity = client.capacity if client is not None else {}
    return {
        "prompt_ids": list(run.samples[0].prompt),
        "sampling_params": sampling_json(item.sampling),
        "output_ids": [list(s.ids) for s in run.samples],
        "model": model_identity(served_id, card, capacity),
    }


# -- replaying ------------------------------------------------------------------------------


def replay_of(trace: dict[str, Any]) -> dict[str, Any]:
    """The trace's ``replay`` object, or ``ReplayRefused`` saying why there is none."""
    who = f"request {trace.get('id')}" + (f" (rid {trace['rid']})" if trace.get("rid") else "")
    if trace.get("finished_ns") is None:
        raise ReplayRefused(409, f"{who} has not finished yet; replay it once it has")
    record = trace.get("replay")
    if not isinstance(record, dict):
        raise ReplayRefused(
            409,
            f"{who} has no recorded prompt: its server ran without --trace-prompts (prompt "
            "and output ids are not recorded by default), or it was an embedding",
        )
    return record


def generate_body(record: dict[str, Any]) -> dict[str, Any]:
    """The ``/generate`` body that reruns ``record``: its prompt ids and parameters, with
    the logprobs of the new tokens, their top alternatives and the recorded tokens."""
    recorded = sorted({t for ids in record["output_ids"] for t in ids})
    body: dict[str, Any] = {
        "input_ids": list(record["prompt_ids"]),
        "sampling_params": dict(record["sampling_params"]),
        "return_logprob": True,
        "top_logprobs_num": REPLAY_TOP_LOGPROBS,
        "return_text_in_logprobs": True,
    }
    if recorded:
        body["token_ids_logprob"] = recorded
    return body


def _results(reply: Any) -> list[dict[str, Any]]:
    """A ``/generate`` reply as one result per sample (``n`` > 1 answers a list)."""
    results = reply if isinstance(reply, list) else [reply]
    if not results or not all(isinstance(r, dict) and "output_ids" in r for r in results):
        raise ValueError("the server's reply has no output_ids")
    return results


def _entry_at(rows: list[Any] | None, i: int) -> list[Any] | None:
    return rows[i] if rows is not None and i < len(rows) else None


def _candidates(meta: dict[str, Any], i: int, recorded: int | None) -> dict[str, Any]:
    """The new run's logprobs at position ``i``: its own token, the recorded one (asked
    for by id, so present whatever its rank) and the top alternatives."""
    own = _entry_at(meta.get("output_token_logprobs"), i)
    given = _entry_at(meta.get("output_token_ids_logprobs"), i) or []
    rec = next((e for e in given if e[1] == recorded), None)
    return {
        "replayed": own[0] if own else None,
        "recorded": rec[0] if rec else None,
        "texts": {"replayed": own[2] if own else None, "recorded": rec[2] if rec else None},
        "top": _entry_at(meta.get("output_top_logprobs"), i),
    }


def compare(
    record: dict[str, Any], reply: Any, now: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The replay's report: identical, or the first (sample, position) where the ids
    part, the recorded and the new token there and the new run's logprobs of both."""
    results = _results(reply)
    recorded: list[list[int]] = record["output_ids"]
    replayed = [list(r["output_ids"]) for r in results]
    report: dict[str, Any] = {
        "identical": True,
        "parted_at": None,
        "sample": None,
        "recorded": None,
        "replayed": None,
        "logprobs": None,
        "recorded_ids": recorded,
        "replayed_ids": replayed,
        "warnings": model_warnings(record.get("model") or {}, now),
        "model": {"recorded": record.get("model"), "now": now},
    }
    if len(replayed) != len(recorded):
        raise ValueError(f"{len(recorded)} samples recorded, the replay returned {len(replayed)}")
    for k, (old, new) in enumerate(zip(recorded, replayed, strict=True)):
        i = next((j for j, (a, b) in enumerate(zip(old, new, strict=False)) if a != b), None)
        if i is None and len(old) == len(new):
            continue
        i = min(len(old), len(new)) if i is None else i  # one ended where the other went on
        old_tok = old[i] if i < len(old) else None
        lp = _candidates(results[k]["meta_info"], i, old_tok)
        report.update(
            identical=False,
            parted_at=i,
            sample=k,
            recorded=old_tok,
            replayed=new[i] if i < len(new) else None,
            logprobs=lp,
        )
        break
    return report


def model_warnings(recorded: dict[str, Any], now: dict[str, Any] | None) -> list[str]:
    """What differs between the model that ran the request and the one replaying it."""
    if now is None:
        return ["could not read the server's model identity; not compared"]
    out = []
    for key, what in (
        ("weights", "weights mode"),
        ("sha256", "model file digest"),
        ("path", "model file path"),
        ("file_bytes", "model file size"),
        ("id", "served model id"),
        ("device", "device"),
        ("dtype", "dtype"),
    ):
        a, b = recorded.get(key), now.get(key)
        if a != b and (a is not None or b is not None):
            out.append(f"{what} differs: recorded {a!r}, the server now has {b!r}")
    return out


async def replay_in_process(
    fe: Frontend, trace: dict[str, Any], served_id: str | None
) -> dict[str, Any]:
    """Rerun ``trace``'s request through ``fe``'s own call path, as ``/generate`` would;
    ``ReplayRefused`` when it cannot run (no record: 409; refused: its status)."""
    from lifecycle.core.errors import RequestError, ServeError
    from lifecycle.core.params import parse_generate
    from lifecycle.core.results import unary_results
    from lifecycle.core.states import Cause

    record = replay_of(trace)
    try:
        req = parse_generate(generate_body(record), vocab_size=fe.model_config.vocab_size)
        async with fe.call(req, lambda: (Cause.CLIENT_GONE, "the replay's caller left")) as call:
            await call.start()
            try:
                await call.result()
            except ServeError as exc:
                raise ReplayRefused(exc.cause.status, f"the replay failed: {exc.message}") from None
            results = unary_results(call)
            client = call.client
            now = None
            if client is not None:
                now = model_identity(served_id, client.model, client.capacity)
    except RequestError as exc:
        raise ReplayRefused(
            exc.status, f"the recorded request is refused now: {exc.message}"
        ) from None
    except ServeError as exc:
        raise ReplayRefused(exc.cause.status, exc.message) from None
    return compare(record, results, now)
