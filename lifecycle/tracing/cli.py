"""``lifecycle trace``: questions about finished requests, from a trace log or a live server.

::

    lifecycle trace summary  --log traces.jsonl            # p50/p99 ms spent in each state
    lifecycle trace timeline 42 --log traces.jsonl         # one request, by id or client rid
    lifecycle trace slowest -n 10 --by queued --url http://127.0.0.1:30000
    lifecycle trace errors deadline --log traces.jsonl --since 15m
    lifecycle trace list --status 503 --since 2026-12-02T12:00:00Z --until 5m
    lifecycle trace replay 42 --url http://127.0.0.1:30000  # rerun it, compare the tokens

``--log`` reads the file and its rotated backups (``PATH.1`` ...); ``--url`` reads the
ring of a running server (``/debug/traces``; ``--key`` for the admin key). ``--json``
prints machine-readable answers. ``replay`` (docs/replay.md) exits 0 when the rerun gave
the recorded ids, 1 when they part, 2 when it could not run.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.parse
import urllib.request
from datetime import UTC, datetime
from typing import Any

from lifecycle.tracing.query import (
    Trace,
    filter_traces,
    find,
    parse_time,
    slowest,
    state_summary,
    timeline,
    with_cause,
)
from lifecycle.tracing.replay import (
    ReplayRefused,
    compare,
    generate_body,
    model_identity,
    replay_of,
)

__all__ = ["add_trace_parser", "load_traces", "run_trace"]


def add_trace_parser(sub: Any) -> None:
    """Add the ``trace`` subcommand to the CLI's subparsers."""
    common = argparse.ArgumentParser(add_help=False)
    src = common.add_argument_group("source (one of)")
    src.add_argument("--log", help="a trace log written by serve --trace-log")
    src.add_argument("--url", help="a running server, e.g. http://127.0.0.1:30000")
    src.add_argument("--key", default=None, help="admin key for --url")
    src.add_argument("--no-rotated", action="store_true", help="skip the log's .N backups")
    flt = common.add_argument_group("filters")
    flt.add_argument("--since", help="finished at or after: unix s, ISO 8601, or an age (15m)")
    flt.add_argument("--until", help="finished at or before (same forms)")
    flt.add_argument("--status", help="done | error | an error cause | an HTTP status")
    flt.add_argument("--route", help="the route it came in on, e.g. /v1/chat/completions")
    common.add_argument("--json", action="store_true", help="print JSON")

    trace = sub.add_parser("trace", help="inspect finished request traces")
    actions = trace.add_subparsers(dest="trace_action", required=True)
    actions.add_parser("summary", parents=[common], help="p50/p99 ms spent in each state")
    actions.add_parser("list", parents=[common], help="every matching request, one line each")
    tl = actions.add_parser("timeline", parents=[common], help="one request's timeline")
    tl.add_argument(
        "request", help="internal id, rid, X-Request-Id, or a reply id (chatcmpl-..., meta_info.id)"
    )
    sl = actions.add_parser("slowest", parents=[common], help="the slowest requests")
    sl.add_argument("-n", type=int, default=10)
    sl.add_argument("--by", default="total", help="total, or a state (e.g. queued)")
    er = actions.add_parser("errors", parents=[common], help="requests that ended in a cause")
    er.add_argument("cause")
    rp = actions.add_parser(
        "replay",
        help="rerun a finished request from its trace (recorded with serve --trace-prompts) "
        "and say whether its tokens are the same; exit 0 identical, 1 parted, 2 error",
    )
    rp.add_argument("request", help="internal id or client rid")
    rp.add_argument("--url", required=True, help="the server to rerun it on (and read it from)")
    rp.add_argument("--log", help="read the trace from this log instead of the server")
    rp.add_argument("--key", default=None, help="API or admin key for --url")
    rp.add_argument("--timeout", type=float, default=300.0, help="seconds for the rerun")
    rp.add_argument("--json", action="store_true", help="print the report as JSON")


def _fetch(url: str, key: str | None, body: Any = None, timeout: float = 30) -> Any:
    """GET ``url`` (POST ``body`` as JSON when given) and read the JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data)
    if data is not None:
        req.add_header("content-type", "application/json")
    if key:
        req.add_header("authorization", f"Bearer {key}")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def load_traces(args: argparse.Namespace) -> list[Trace]:
    if bool(args.log) == bool(args.url):
        raise SystemExit("lifecycle trace: give exactly one of --log PATH or --url URL")
    if args.log:
        from lifecycle.tracing.store import read_log  # the FSM import is not needed for --url

        return read_log(args.log, rotated=not args.no_rotated)
    return list(_fetch(args.url.rstrip("/") + "/debug/traces", args.key)["traces"])


def _lookup_live(args: argparse.Namespace, key: str) -> Trace | None:
    url = f"{args.url.rstrip('/')}/debug/requests/{urllib.parse.quote(key, safe='')}"
    try:
        return dict(_fetch(url, args.key))
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise


def _when(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%H:%M:%S.%f")[:-3]


def _ended(t: Trace) -> str:
    return t["state"] if t["cause"] is None else f"error({t['cause']})"


def _line(t: Trace, extra: str = "") -> str:
    rid = t["rid"] or t.get("request_id") or "-"
    route = t.get("route") or "-"
    return (
        f"{t['id']:>8} {rid:<32.32} {route:<22.22} {_when(t['created'])} "
        f"{t['total_ms']:>10.2f} ms {t['status']:>4} {_ended(t)}{extra}"
    )


def _print_timeline(t: Trace) -> None:
    print(f"request {t['id']} rid={t['rid'] or '-'} request_id={t.get('request_id') or '-'} "
          f"{_ended(t)} status={t['status']}")  # fmt: skip
    if t.get("message"):
        print(f"  message: {t['message']}")
    facts = [
        ("route", t.get("route")), ("client", t.get("client")),
        ("prompt tokens", t.get("prompt_tokens")), ("cached", t.get("cached_tokens")),
        ("output tokens", t.get("tokens")),
        ("ttft ms", None if t.get("ttft_ms") is None else f"{t['ttft_ms']:.1f}"),
        ("tokens/s", None if t.get("tokens_per_s") is None else f"{t['tokens_per_s']:.1f}"),
        ("finish", ",".join(map(str, t["finish_reasons"])) if t.get("finish_reasons") else None),
        ("worker", t.get("worker")),
    ]  # fmt: skip
    said = "  ".join(f"{k}={v}" for k, v in facts if v is not None)
    if said:
        print(f"  {said}")
    for row in timeline(t):
        detail = "" if row["detail"] is None else f"  ({row['detail']})"
        leave = f" -{row['event']}->" if row["event"] else ""
        print(f"  {_when(row['entered'])} {row['state']:<10} {row['ms']:>10.3f} ms{leave}{detail}")
    for name, at in t["handoffs"].items():
        print(f"  {name:<16} {_when(at['time']) if at else '-'}")


def _filtered(args: argparse.Namespace) -> list[Trace]:
    try:
        since = parse_time(args.since) if args.since else None
        until = parse_time(args.until) if args.until else None
        return filter_traces(
            load_traces(args), since=since, until=until, status=args.status, route=args.route
        )
    except ValueError as exc:
        raise SystemExit(f"lifecycle trace: {exc}") from None


def _answer(args: argparse.Namespace) -> tuple[Any, list[Trace] | None]:
    """(JSON answer, traces to print one per line or None)."""
    action = args.trace_action
    if action == "timeline":
        found = find(_filtered(args), args.request)
        if found is None and args.url:
            found = _lookup_live(args, args.request)
        if found is None:
            raise SystemExit(f"lifecycle trace: no request {args.request!r}")
        return found, None
    traces = _filtered(args)
    try:
        if action == "summary":
            return state_summary(traces), None
        if action == "slowest":
            picked = slowest(traces, args.n, args.by)
        elif action == "errors":
            picked = with_cause(traces, args.cause)
        else:
            picked = traces
    except ValueError as exc:
        raise SystemExit(f"lifecycle trace: {exc}") from None
    return picked, picked


def run_trace(args: argparse.Namespace) -> int:
    if args.trace_action == "replay":
        return run_replay(args)
    answer, rows = _answer(args)
    if args.json:
        json.dump(answer, sys.stdout, indent=1)
        print()
    elif args.trace_action == "timeline":
        _print_timeline(answer)
    elif args.trace_action == "summary":
        print(f"{'state':<10} {'count':>7} {'p50 ms':>10} {'p99 ms':>10} {'max ms':>10}")
        for state, s in answer.items():
            print(
                f"{state:<10} {s['count']:>7} {s['p50_ms']:>10.3f} {s['p99_ms']:>10.3f} "
                f"{s['max_ms']:>10.3f}"
            )
    else:
        by = getattr(args, "by", "total")
        for t in rows or []:
            extra = f"  {by}={t['states_ms'].get(by, 0):.2f} ms" if by != "total" else ""
            print(_line(t, extra))
        print(f"({len(rows or [])} requests)")
    return 0


# -- replay -------------------------------------------------------------------------------


def run_replay(args: argparse.Namespace) -> int:
    """``lifecycle trace replay``: 0 identical, 1 parted, 2 could not run (said why)."""
    try:
        report = _replay(args)
    except ReplayRefused as exc:
        print(f"lifecycle trace replay: {exc.message}", file=sys.stderr)
        return 2
    except urllib.error.HTTPError as exc:
        print(f"lifecycle trace replay: {exc.url}: {_http_error(exc)}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:  # unreachable server, a reply that is not JSON
        print(f"lifecycle trace replay: {args.url}: {exc}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(report, sys.stdout, indent=1)
        print()
    else:
        _print_replay(report)
    return 0 if report["identical"] else 1


def _replay(args: argparse.Namespace) -> dict[str, Any]:
    base = args.url.rstrip("/")
    trace = _trace_to_replay(args, base)
    record = replay_of(trace)
    reply = _fetch(base + "/generate", args.key, generate_body(record), args.timeout)
    report = compare(record, reply, _server_model(base, args.key))
    report["request"] = {"id": trace.get("id"), "rid": trace.get("rid")}
    return report


def _trace_to_replay(args: argparse.Namespace, base: str) -> Trace:
    if args.log:
        from lifecycle.tracing.store import read_log

        found = find(read_log(args.log), args.request)
        where = args.log
    else:
        found = _lookup_live(args, args.request)
        where = base
    if found is None:
        raise ReplayRefused(404, f"no request {args.request!r} in {where}")
    return found


def _server_model(base: str, key: str | None) -> dict[str, Any] | None:
    """The model the server runs now (``/model_info`` and the first worker's HELLO in
    ``/server_info``), or None when it does not say."""
    try:
        info, served = _fetch(base + "/server_info", key), _fetch(base + "/model_info", key)
    except (OSError, ValueError):
        return None
    states = [s for s in info.get("internal_states") or [] if isinstance(s.get("model"), dict)]
    if not states:
        return None
    return model_identity(served.get("served_model_name"), states[0]["model"],
                          states[0].get("capacity") or {})  # fmt: skip


def _http_error(exc: urllib.error.HTTPError) -> str:
    try:
        message = json.loads(exc.read())["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = exc.reason
    return f"{exc.code} {message}"


def _token(token: int | None, text: str | None) -> str:
    if token is None:
        return "(none: this output ended here)"
    return f"{token} {text!r}" if text is not None else str(token)


def _logprob(lp: float | None) -> str:
    return "-" if lp is None else f"{lp:.4f}"


def _print_replay(r: dict[str, Any]) -> None:
    who = f"request {r['request']['id']}" + (
        f" (rid {r['request']['rid']})" if r["request"]["rid"] else ""
    )
    for warning in r["warnings"]:
        print(f"warning: {warning}")
    if r["identical"]:
        n = sum(len(ids) for ids in r["recorded_ids"])
        print(f"{who}: identical ({n} tokens)")
        return
    sample = f" of sample {r['sample']}" if len(r["recorded_ids"]) > 1 else ""
    print(f"{who}: parted at token {r['parted_at']}{sample}")
    lp = r["logprobs"] or {}
    texts = lp.get("texts") or {}
    print(f"  recorded {_token(r['recorded'], texts.get('recorded'))}, "
          f"logprob in the replay {_logprob(lp.get('recorded'))}")  # fmt: skip
    print(f"  replayed {_token(r['replayed'], texts.get('replayed'))}, "
          f"logprob {_logprob(lp.get('replayed'))}")  # fmt: skip
