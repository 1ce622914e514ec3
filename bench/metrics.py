"""Serving metrics with the definitions of SGLang's ``bench_serving``.

One ``RequestOutput`` per request; ``compute_metrics`` folds them into the same fields
``bench_serving.calculate_metrics`` reports, with the same rules:

- only successful requests contribute latencies, token counts and throughputs;
- TTFT is the time to the first chunk that carries non-empty text (the whole latency
  for a non-streaming request);
- TPOT = (latency - ttft) / (output_len - 1), only for output_len > 1;
- ITL has one entry per token: a chunk that brings k new tokens splits the gap since
  the previous chunk into k equal entries;
- throughputs divide by the wall duration of the run; percentiles interpolate
  linearly between order statistics (numpy's default), and an empty sample reads 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "BenchmarkMetrics",
    "LatencyStats",
    "RequestOutput",
    "compute_metrics",
    "format_report",
    "percentile",
    "split_itl",
]


@dataclass(slots=True)
class RequestOutput:
    """What one request produced, as the client saw it (times in seconds)."""

    prompt_len: int
    success: bool = False
    latency: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_len: int = 0
    generated_text: str = ""
    status: int = 0
    error: str = ""


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def split_itl(gap: float, new_tokens: int) -> list[float]:
    """ITL entries for one chunk: the gap shared equally by the tokens it brought."""
    if new_tokens <= 0:
        return []
    return [gap / new_tokens] * new_tokens


@dataclass(frozen=True, slots=True)
class LatencyStats:
    """Mean, median, std, p95, p99 and max of one latency sample, in milliseconds."""

    mean: float
    median: float
    std: float
    p95: float
    p99: float
    max: float

    @classmethod
    def of(cls, seconds: Sequence[float]) -> LatencyStats:
        if not seconds:
            return cls(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        mean = sum(seconds) / len(seconds)
        var = sum((x - mean) ** 2 for x in seconds) / len(seconds)  # population, as np.std
        return cls(
            mean=mean * 1e3,
            median=percentile(seconds, 50) * 1e3,
            std=math.sqrt(var) * 1e3,
            p95=percentile(seconds, 95) * 1e3,
            p99=percentile(seconds, 99) * 1e3,
            max=max(seconds) * 1e3,
        )


@dataclass(frozen=True, slots=True)
class BenchmarkMetrics:
    """The aggregate of one run (``bench_serving``'s ``BenchmarkMetrics``, retokenized
    fields left out: the generated text is not re-encoded here)."""

    completed: int
    failed: int
    duration_s: float
    total_input: int
    total_output: int
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_throughput: float
    concurrency: float
    ttft_ms: LatencyStats
    tpot_ms: LatencyStats
    itl_ms: LatencyStats
    e2e_latency_ms: LatencyStats

    def to_dict(self) -> dict[str, Any]:
        """Flat JSON-ready fields named as ``bench_serving`` names them."""
        out: dict[str, Any] = {
            k: getattr(self, k)
            for k in (
                "completed",
                "failed",
                "duration_s",
                "total_input",
                "total_output",
                "request_throughput",
                "input_throughput",
                "output_throughput",
                "total_throughput",
                "concurrency",
            )
        }
        for name in ("ttft", "tpot", "itl", "e2e_latency"):
            for stat, value in asdict(getattr(self, f"{name}_ms")).items():
                out[f"{stat}_{name}_ms"] = value
        return out


def compute_metrics(outputs: Sequence[RequestOutput], duration_s: float) -> BenchmarkMetrics:
    """Fold per-request outputs into the run's metrics."""
    ok = [o for o in outputs if o.success]
    total_input = sum(o.prompt_len for o in ok)
    total_output = sum(o.output_len for o in ok)
    tpots = [(o.latency - o.ttft) / (o.output_len - 1) for o in ok if o.output_len > 1]
    itls = [gap for o in ok for gap in o.itl]
    e2e = [o.latency for o in ok]
    dur = duration_s if duration_s > 0 else math.inf
    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(outputs) - len(ok),
        duration_s=duration_s,
        total_input=total_input,
        total_output=total_output,
        request_throughput=len(ok) / dur,
        input_throughput=total_input / dur,
        output_throughput=total_output / dur,
        total_throughput=(total_input + total_output) / dur,
        concurrency=sum(e2e) / dur,
        ttft_ms=LatencyStats.of([o.ttft for o in ok]),
        tpot_ms=LatencyStats.of(tpots),
        itl_ms=LatencyStats.of(itls),
        e2e_latency_ms=LatencyStats.of(e2e),
    )


def format_report(m: BenchmarkMetrics, header: dict[str, Any]) -> str:
    """The ``Serving Benchmark Result`` block, in ``bench_serving``'s order."""
    rows: list[tuple[str, Any]] = list(header.items())
    rows += [
        ("Successful requests:", m.completed),
        ("Failed requests:", m.failed),
        ("Benchmark duration (s):", f"{m.duration_s:.2f}"),
        ("Total input tokens:", m.total_input),
        ("Total generated tokens:", m.total_output),
        ("Request throughput (req/s):", f"{m.request_throughput:.2f}"),
        ("Input token throughput (tok/s):", f"{m.input_throughput:.2f}"),
        ("Output token throughput (tok/s):", f"{m.output_throughput:.2f}"),
        ("Total token throughput (tok/s):", f"{m.total_throughput:.2f}"),
        ("Concurrency:", f"{m.concurrency:.2f}"),
    ]
    sections = [
        ("End-to-End Latency", "E2E Latency", m.e2e_latency_ms, ("mean", "median", "p99")),
        ("Time to First Token", "TTFT", m.ttft_ms, ("mean", "median", "p99")),
        ("Time per Output Token (excl. 1st token)", "TPOT", m.tpot_ms, ("mean", "median", "p99")),
        ("Inter-Token Latency", "ITL", m.itl_ms, ("mean", "median", "p95", "p99", "max")),
    ]
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]
    lines += [f"{k:<40} {v!s:<10}" for k, v in rows]
    for title, short, stats, fields in sections:
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        for f in fields:
            label = (
                f"{f.capitalize() if f in ('mean', 'median', 'max') else f.upper()} {short} (ms):"
            )
            lines.append(f"{label:<40} {getattr(stats, f):<10.2f}")
    lines.append("=" * 50)
    return "\n".join(lines)
