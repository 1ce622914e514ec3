"""Prometheus and Grafana (docs/monitoring.md) against a live server (a real process on
the scripted worker) after some traffic: ``promtool check metrics`` passes on its
``/metrics`` and ``promtool check config`` on docs/monitoring/prometheus.yml (both
skipped without promtool: ``make ci-deps`` installs it), and every metric the Grafana
dashboard's PromQL expressions query is in that ``/metrics``."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .scripted import lifecycle_server
from .ws_helpers import echo_body

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "docs" / "monitoring" / "grafana-dashboard.json"
SCRAPE_CONFIG = ROOT / "docs" / "monitoring" / "prometheus.yml"

pytestmark = pytest.mark.timeout(60)

needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool not installed (make ci-deps)"
)


@pytest.fixture(scope="module")
def metrics_text() -> Iterator[str]:
    """``/metrics`` of a server that has served, failed and streamed requests."""
    with lifecycle_server("--scripted-worker") as url:
        with httpx.Client(base_url=url, timeout=30) as c:
            for i in range(3):
                assert c.post("/generate", json=echo_body(i, 4)).status_code == 200
            too_long = {"input_ids": [5] * 9000, "sampling_params": {"max_new_tokens": 4}}
            assert c.post("/generate", json=too_long).status_code == 400
            stream = {**echo_body(4, 4), "stream": True}
            with c.stream("POST", "/generate", json=stream) as r:
                assert r.status_code == 200 and r.read()
            assert c.get("/no_such_route").status_code == 404
            yield c.get("/metrics").text


# -- PromQL: the metric names an expression selects ----------------------------------------
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
             "or", "unless", "offset", "inf", "nan"}  # fmt: skip


def metric_names(expr: str) -> list[str]:
    """The metric names ``expr`` selects: identifiers left once strings, label matchers,
    range and offset brackets and grouping label lists are removed, that are neither a
    function or aggregation (followed by ``(``) nor a keyword."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", "", e)
    e = re.sub(r"\[[^\]]*\]", "", e)
    e = re.sub(r"\boffset\s+-?\w+", "", e)
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    e = re.sub(r"\b\d+(?:\.\d+)?(?:e[+-]?\d+)?\b", "", e)  # numbers (0.99, 1e3)
    names = []
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        if e[m.end() :].lstrip().startswith("(") or m.group().lower() in _KEYWORDS:
            continue
        names.append(m.group())
    return names


def test_metric_names_parser() -> None:
    expr = ('histogram_quantile(0.99, sum by (le) (rate(a_seconds_bucket{instance=~"$i", '
            'le!="+Inf"}[$__rate_interval]))) / on (job) group_left (x) b_total offset 5m '
            "> bool 1e3 and up")  # fmt: skip
    assert metric_names(expr) == ["a_seconds_bucket", "b_total", "up"]
    assert metric_names('label_values(lifecycle_worker_ready, instance)') == [
        "lifecycle_worker_ready", "instance"
    ]  # fmt: skip


def dashboard_queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            q = var["query"]["query"]
            assert q.startswith("label_values(") and q.endswith(")")
            exprs.append(q[len("label_values(") : q.rindex(",")])
    return exprs


# Gauges only the model worker's STATS carry (the scripted one has no prefix cache and
# reports no memory; the GPU gauges need CUDA). tests/test_metrics.py reads the model
# worker's from a real server (and the GPU ones on CUDA).
MODEL_WORKER_ONLY = {
    "lifecycle_worker_kv_blocks_cached",
    "lifecycle_worker_memory_rss_bytes",
    "lifecycle_worker_gpu_memory_reserved_bytes",
    "lifecycle_worker_gpu_memory_allocated_bytes",
}


def test_every_metric_the_dashboard_queries_is_served(metrics_text: str) -> None:
    served = {s.name for f in text_string_to_metric_families(metrics_text) for s in f.samples}
    assert not [n for n in served if n.endswith("_created")]  # switched off
    source = (ROOT / "lifecycle" / "tracing" / "metrics.py").read_text()
    for name in MODEL_WORKER_ONLY:  # not served here, but made by the collector
        assert name not in served and f'"{name.removeprefix("lifecycle_worker_")}"' in source
    served |= MODEL_WORKER_ONLY
    queried: set[str] = set()
    for expr in dashboard_queries():
        names = metric_names(expr)
        assert names, f"no metric in {expr!r}"
        missing = [n for n in names if n not in served]
        assert not missing, f"{expr!r} queries {missing}, which /metrics lacks"
        queried.update(names)
    # What the dashboard must show (docs/monitoring.md): each of these is queried.
    for family in ("requests_total", "generation_tokens_total", "request_errors_total",
                   "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                   "e2e_request_latency_seconds_bucket", "admission_queue_depth",
                   "worker_kv_blocks_used", "requests_in_state", "worker_restarts_total",
                   "finish_reasons_total", "request_prompt_tokens_bucket",
                   "request_generation_tokens_bucket", "request_prefill_time_seconds_bucket",
                   "request_decode_time_seconds_bucket", "worker_step_seconds_bucket",
                   "worker_batch_size_bucket", "worker_kv_usage_ratio", "retractions_total",
                   "worker_memory_rss_bytes", "worker_gpu_memory_reserved_bytes",
                   "build_info", "worker_info"):  # fmt: skip
        assert f"lifecycle_{family}" in queried, family


@needs_promtool
def test_promtool_check_metrics(metrics_text: str) -> None:
    r = _promtool(["check", "metrics"], metrics_text)
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
def test_promtool_check_scrape_config() -> None:
    r = _promtool(["check", "config", str(SCRAPE_CONFIG)])
    assert r.returncode == 0, r.stdout + r.stderr


def _promtool(args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess[Any]:
    return subprocess.run(
        ["promtool", *args], input=stdin, capture_output=True, text=True, timeout=30
    )
