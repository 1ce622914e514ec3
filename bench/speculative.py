"""Speculative decoding against none: the same model served twice, one run, A B A B.

    python -m bench.speculative                                  # the bundled SmolLM2
    python -m bench.speculative --model /tmp/qwen2.5-0.5b-Q4_K_M.gguf --peer llama-server

Starts ``lifecycle serve`` with ``--speculative off`` and with ``--speculative ngram``
and sends both the same requests, in turn (as ``bench/compare.py`` does), for two
workloads at each ``--levels`` concurrency: ``grounded`` (rewrite or repeat a passage
given in the prompt, chat-templated, each answer ending where the model ends it:
``bench/workload.py``) and ``random`` (random words, a forced ``--max-tokens``: nothing
to look up). Greedy throughout. Prints output tok/s, ITL p50 and TTFT p50 for both and
ngram/off; the acceptance (accepted of proposed tokens) from the ``/metrics`` counters
over the timed runs, and from each request's ``meta_info`` in an untimed non-streaming
pass (the mean accepted per verify step); and checks that every request's greedy text is
the same with and without speculation, printing each mismatch loudly and exiting 1.

``--peer llama-server`` adds llama.cpp's server without and with its own n-gram
speculation (``--spec-type``) to the rotation, where its build has it
(``bench/speculative_peer.py``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import shlex
import sys
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script (make bench): the repository's packages
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import llama_server, speculative_peer  # noqa: E402
from bench.apis import RequestSpec, build_body  # noqa: E402
from bench.compare import LevelResult  # noqa: E402
from bench.contenders import OURS_CMD, Contender, default_model_path  # noqa: E402
from bench.cpu_steal import steal_share, steal_ticks  # noqa: E402
from bench.procs import free_port  # noqa: E402
from bench.serving import LoadConfig, run_load_sync  # noqa: E402
from bench.workload import Prompt, WorkloadConfig, chat_wrapped, make_workload  # noqa: E402

__all__ = [
    "Acceptance",
    "Results",
    "SameTokens",
    "first_difference",
    "main",
    "metric_totals",
    "print_report",
    "run",
]

# random: random common words; ids: random token ids (neither has a span to look up)
DATASETS = ("grounded", "random", "ids")
DRAFT, ACCEPTED = "lifecycle_spec_draft_tokens_total", "lifecycle_spec_accepted_tokens_total"
VERIFY = "lifecycle_spec_verify_steps_total"
# meta_info's keys (SGLang's names), each before the name it may also go by
META_KEYS = (
    ("spec_num_proposed_drafts", "spec_draft_tokens"),
    ("spec_num_correct_drafts", "spec_accepted_tokens"),
    ("spec_verify_ct",),
)
PAIRS = (("off", "ngram"), speculative_peer.LABELS)  # (without, with) speculation


@dataclass(slots=True)
class Acceptance:
    """Proposed and accepted draft tokens, and the steps that checked a proposal (None:
    the server did not report it)."""

    proposed: int | None = None
    accepted: int | None = None
    verify_steps: int | None = None

    def add(self, proposed: float | None, accepted: float | None, steps: float | None) -> None:
        def plus(a: int | None, b: float | None) -> int | None:
            return a if b is None else int(b) + (a or 0)

        self.proposed = plus(self.proposed, proposed)
        self.accepted = plus(self.accepted, accepted)
        self.verify_steps = plus(self.verify_steps, steps)

    def line(self) -> str:
        if self.proposed is None or self.accepted is None:
            return "n/a"
        rate = f"{100 * self.accepted / self.proposed:.1f} %" if self.proposed else "-"
        out = f"{self.accepted}/{self.proposed} accepted ({rate})"
        if self.verify_steps:
            per = self.accepted / self.verify_steps
            out += f", {per:.2f} accepted per verify step ({1 + per:.2f} tokens a checked step)"
        return out


def metric_totals(text: str, prefix: str = "lifecycle_spec_") -> dict[str, float]:
    """The sum over labels of every sample named ``prefix...`` in a Prometheus text page."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            name, _, value = line.rpartition(" ")
            key = name.split("{", 1)[0]
            out[key] = out.get(key, 0.0) + float(value)
    return out


def _scrape(c: Contender) -> dict[str, float]:
    if c.kind != "ours":
        return {}
    try:
        url = f"http://{c.proc.host}:{c.proc.port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            return metric_totals(r.read().decode())
    except OSError:
        return {}


def first_difference(a: str, b: str) -> int:
    """The index of the first character where ``a`` and ``b`` part (-1: equal)."""
    if a == b:
        return -1
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


# --- servers --------------------------------------------------------------------------


def _ours(mode: str, model: str, args: argparse.Namespace) -> Contender | None:
    argv = shlex.split(
        OURS_CMD.format(
            python=shlex.quote(sys.executable),
            port=free_port(),
            model=shlex.quote(model),
            kv_tokens=llama_server.CTX_SIZE,
        )
    )
    argv += ["--speculative", mode, "--speculative-tokens", str(args.speculative_tokens)]
    spec = RequestSpec(api="generate")
    return speculative_peer.start_contender(mode, argv, spec, "ours", args.start_timeout)


# --- the runs -------------------------------------------------------------------------


@dataclass(slots=True)
class Cell:
    """One contender at one dataset and concurrency, all reps pooled."""

    level: LevelResult = field(default_factory=LevelResult)
    acceptance: Acceptance = field(default_factory=Acceptance)


@dataclass(slots=True)
class SameTokens:
    """The promise under test: a request's greedy text is the same with speculation
    (``pair``: the labels of the runs without and with it)."""

    pair: tuple[str, str] = PAIRS[0]
    compared: int = 0
    mismatches: list[dict[str, Any]] = field(default_factory=list)

    def check(self, where: str, texts: dict[str, list[str | None]]) -> None:
        """The two runs of ``pair`` in ``texts``, request by request (a failed request is
        not compared: the table counts it as failed)."""
        a, b = self.pair
        if a in texts and b in texts:
            for i, (x, y) in enumerate(zip(texts[a], texts[b], strict=False)):
                if x is None or y is None:
                    continue
                self.compared += 1
                if (at := first_difference(x, y)) >= 0:
                    self.mismatches.append(
                        {
                            "where": where,
                            "request": i,
                            "char": at,
                            a: x[at : at + 40],
                            b: y[at : at + 40],
                        }
                    )


def _prompts(dataset: str, n: int, seed: int, model: str, args: argparse.Namespace) -> list[Prompt]:
    kind = {"grounded": "grounded", "random": "text", "ids": "ids"}[dataset]
    cfg = WorkloadConfig(
        kind=kind, num_requests=n, input_len=args.input_len, output_len=args.max_tokens, seed=seed
    )
    prompts = make_workload(cfg)
    return chat_wrapped(prompts, model) if dataset == "grounded" else prompts


def _spec(c: Contender, dataset: str) -> RequestSpec:
    # grounded answers end where the model ends them; random ones run the full length
    return dataclasses.replace(c.spec, ignore_eos="off" if dataset == "grounded" else "flag")


def _timed(
    c: Contender, spec: RequestSpec, prompts: list[Prompt], cfg: LoadConfig, cell: Cell
) -> list[str | None]:
    """One timed run into ``cell``: its load figures, the ``/metrics`` counters' growth
    over it, its CPU steal; the texts, None for a failed request."""
    before, cpu0, steal0 = _scrape(c), c.proc.cpu_seconds(), steal_ticks()
    res = run_load_sync(c.target, spec, prompts, cfg)
    steal, after = steal_share(steal0, steal_ticks()), _scrape(c)
    cell.level.add(res, c.proc.cpu_seconds() - cpu0, 0.0, steal)
    if DRAFT in after:
        grew = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in (DRAFT, ACCEPTED, VERIFY)}
        cell.acceptance.add(grew[DRAFT], grew[ACCEPTED], grew[VERIFY] if VERIFY in after else None)
    return [o.generated_text if o.success else None for o in res.outputs]


def _probe(
    c: Contender, spec: RequestSpec, prompts: list[Prompt]
) -> tuple[list[str | None], Acceptance]:
    """Every prompt non-streaming, 8 at a time, untimed: the texts and the acceptance each
    response reports (ours: ``meta_info``; llama-server: ``timings`` of /completion)."""
    ours = c.kind == "ours"
    path = "/generate" if ours else speculative_peer.PROBE_PATH
    unary = dataclasses.replace(spec, stream=False)

    def one(p: Prompt) -> dict[str, Any]:
        if ours:
            body = build_body(unary, p.prompt, p.output_len)
        else:
            body = speculative_peer.probe_body(p, spec)
        url = f"http://{c.proc.host}:{c.proc.port}{path}"
        req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            obj: dict[str, Any] = json.loads(r.read())
        return obj

    acc, texts = Acceptance(), list[str | None]()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for fut in [pool.submit(one, p) for p in prompts]:
            try:
                obj = fut.result()
            except (OSError, ValueError) as exc:
                print(f"   {c.label}: a non-streaming request failed: {exc}", file=sys.stderr)
                texts.append(None)
                continue
            if ours:
                meta = obj.get("meta_info") or {}
                texts.append(obj.get("text", ""))
                acc.add(*(next((meta[k] for k in ks if k in meta), None) for ks in META_KEYS))
            else:
                text, counts = speculative_peer.probe_reading(obj)
                texts.append(text)
                acc.add(*counts)
    return texts, acc


@dataclass(slots=True)
class Results:
    cells: dict[str, dict[int, dict[str, Cell]]] = field(default_factory=dict)
    probes: dict[str, dict[str, Acceptance]] = field(default_factory=dict)
    same: SameTokens = field(default_factory=SameTokens)
    # llama-server's own consistency: reported, not our promise
    peer_same: SameTokens = field(default_factory=lambda: SameTokens(PAIRS[1]))

    def check(self, where: str, texts: dict[str, list[str | None]]) -> None:
        self.same.check(where, texts)
        self.peer_same.check(where, texts)


def _level(
    contenders: list[Contender],
    dataset: str,
    conc: int,
    model: str,
    args: argparse.Namespace,
    out: Results,
) -> None:
    """``--reps`` rotations of every contender on the same fresh prompts."""
    row = out.cells.setdefault(dataset, {}).setdefault(conc, {c.label: Cell() for c in contenders})
    for rep in range(args.reps):
        # a seed per level and rep, as bench.compare: a later run repeats no earlier prompt
        prompts = _prompts(
            dataset, max(args.num_requests, conc), 1 + rep + 1000 * conc, model, args
        )
        texts: dict[str, list[str | None]] = {}
        for c in contenders:
            print(f"== {dataset}, concurrency {conc}, rep {rep + 1}/{args.reps}: {c.label}")
            cfg = LoadConfig(
                max_concurrency=conc,
                time_cap_s=args.time_cap,
                warmup_requests=0,
                progress=not args.quiet,
                seed=rep,
            )
            texts[c.label] = _timed(c, _spec(c, dataset), prompts, cfg, row[c.label])
        out.check(f"{dataset} c={conc} rep {rep + 1}", texts)


def run(contenders: list[Contender], model: str, args: argparse.Namespace) -> Results:
    out = Results()
    warm = _prompts("random", 2, 0, model, args)
    for c in contenders:  # one untimed warm-up each, so the first run is not penalised
        run_load_sync(c.target, _spec(c, "random"), warm, LoadConfig(progress=False))
    for dataset in args.datasets:
        for conc in args.levels:
            _level(contenders, dataset, conc, model, args, out)
        # the first level's first prompts once more, non-streaming and batched: meta_info
        first = args.levels[0]
        prompts = _prompts(dataset, max(args.num_requests, first), 1 + 1000 * first, model, args)
        texts: dict[str, list[str | None]] = {}
        for c in contenders:
            print(f"== {dataset}, non-streaming, 8 at a time: {c.label}", flush=True)
            texts[c.label], out.probes.setdefault(dataset, {})[c.label] = _probe(
                c, _spec(c, dataset), prompts
            )
        out.check(f"{dataset} non-streaming", texts)
    return out


# --- the report -----------------------------------------------------------------------

_COLS = (
    ("output_tok_s", "out tok/s", 1),
    ("itl_p50_ms", "ITL p50 ms", 2),
    ("ttft_p50_ms", "TTFT p50 ms", 1),
)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


def print_report(out: Results, labels: list[str]) -> None:
    pairs = [(a, b) for a, b in PAIRS if a in labels and b in labels]
    for dataset, levels in out.cells.items():
        print(f"\n{dataset}" + " (answers end at the end of turn)" * (dataset == "grounded"))
        head = f"{'conc':>5}  {'':<12}" + "".join(f"{lb:>12}" for lb in labels)
        print(head + "".join(f"{b + '/' + a.split('-')[-1]:>16}" for a, b in pairs))
        for conc, row in levels.items():
            summ = {lb: row[lb].level.summary() for lb in labels}
            for key, title, digits in _COLS:
                vals = {lb: summ[lb][key] for lb in labels}
                line = f"{conc:>5}  {title:<12}" + "".join(
                    f"{vals[lb]:>12.{digits}f}" for lb in labels
                )
                print(line + "".join(f"{_ratio(vals[b], vals[a]):>16}" for a, b in pairs))
            done = ", ".join(f"{lb} {summ[lb]['completed']}/{summ[lb]['failed']}" for lb in labels)
            steal = max(max(summ[lb]["rep_steal_pct"], default=0.0) for lb in labels)
            print(f"{'':>7}completed/failed: {done}; most CPU steal in a run {steal:.1f} %")
        for conc, row in levels.items():
            for lb in labels:
                if row[lb].acceptance.proposed is not None or lb.endswith("ngram"):
                    print(f"  acceptance c={conc} {lb} (/metrics): {row[lb].acceptance.line()}")
        for lb, acc in out.probes.get(dataset, {}).items():
            if lb.endswith("ngram") or acc.proposed is not None:
                print(f"  acceptance {lb} (per request, non-streaming pass): {acc.line()}")
    _print_same(out.same)
    if out.peer_same.compared:
        print(speculative_peer.same_line(out.peer_same))


def _print_same(same: SameTokens) -> None:
    if not same.mismatches:
        print(
            f"\ngreedy texts identical without and with speculation: {same.compared} of "
            f"{same.compared} requests"
        )
        return
    bar = "!" * 78
    print(
        f"\n{bar}\nMISMATCH: {len(same.mismatches)} of {same.compared} requests gave other "
        f"text with speculation than without (the promise: the same tokens)\n{bar}"
    )
    for m in same.mismatches:
        print("  " + json.dumps(m, ensure_ascii=False))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.speculative",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default=None, help="GGUF file (default: the bundled SmolLM2)")
    p.add_argument("--datasets", nargs="+", choices=DATASETS, default=["grounded", "random"])
    p.add_argument("--levels", type=int, nargs="+", default=[1, 32])
    p.add_argument("--reps", type=int, default=2, help="A B rotations per level")
    p.add_argument(
        "--num-requests", type=int, default=16, help="per level and rep (at least the concurrency)"
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=256,
        help="output cap: grounded passages fit it, random runs it all",
    )
    p.add_argument("--input-len", type=int, default=128, help="random, ids: prompt tokens")
    p.add_argument(
        "--speculative-tokens",
        type=int,
        default=12,
        help="most tokens proposed a step (ours, the worker's default; and llama-server's draft "
        "length)",
    )
    p.add_argument(
        "--peer",
        choices=("llama-server",),
        default=None,
        help="also llama-server without and with its n-gram speculation",
    )
    p.add_argument(
        "--llama-server",
        default=None,
        metavar="PATH",
        help="the llama-server binary (default: what `make bench-peer` built)",
    )
    p.add_argument("--time-cap", type=float, default=600.0, help="per run, seconds")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--json", default=None, metavar="OUT", help="write the figures as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def _to_json(out: Results, args: argparse.Namespace) -> dict[str, Any]:
    meta = {k: v for k, v in vars(args).items() if isinstance(v, str | int | float | list)}
    return {
        "args": meta,
        "levels": {
            ds: {
                str(conc): {
                    lb: {**cell.level.summary(), "acceptance": asdict(cell.acceptance)}
                    for lb, cell in row.items()
                }
                for conc, row in levels.items()
            }
            for ds, levels in out.cells.items()
        },
        "probes": {ds: {lb: asdict(a) for lb, a in row.items()} for ds, row in out.probes.items()},
        "compared": out.same.compared,
        "mismatches": out.same.mismatches,
        "peer_compared": out.peer_same.compared,
        "peer_mismatches": out.peer_same.mismatches,
    }


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    model = args.model or default_model_path()
    contenders = [c for c in (_ours("off", model, args), _ours("ngram", model, args)) if c]
    try:
        if args.peer:
            contenders += speculative_peer.start_peers(
                model, args.speculative_tokens, args.llama_server, args.start_timeout
            )
        if len(contenders) < 2:
            print("nothing to compare: a server did not start", file=sys.stderr)
            return 1
        out = run(contenders, model, args)
    finally:
        for c in contenders:
            c.proc.stop()
    print_report(out, [c.label for c in contenders])
    if args.json:
        Path(args.json).write_text(json.dumps(_to_json(out, args), indent=2))
    return 1 if out.same.mismatches else 0


if __name__ == "__main__":
    raise SystemExit(main())
