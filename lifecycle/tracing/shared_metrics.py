"""One scrape for the whole server under ``serve --frontends N`` (docs/scaling.md).

Each frontend keeps its own requests and so its own counters, and a scrape of the shared
port reaches whichever frontend the kernel picks: alone, each answer would describe one
frontend, and a counter would seem to go back and forth between scrapes. So each
frontend publishes its exposition to the launcher's private folder every second (and at
each scrape), and answers a scrape with every frontend's latest, each sample labelled
``frontend="i"``: the whole server, each series one frontend's own monotonic count, at
most a second old for the frontends not asked. Sum over ``frontend`` for the server.

A server with several models (``--model`` repeated) answers one scrape for all of them
the same way (``join_models``): each model's exposition, its series labelled
``model_name``, under one HELP and TYPE per family.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from lifecycle.tracing.metrics import MODEL_LABEL

__all__ = ["PUBLISH_INTERVAL", "SharedMetrics", "join_models"]

log = logging.getLogger("lifecycle.metrics")

PUBLISH_INTERVAL = 1.0  # seconds between a frontend's unasked publications


class SharedMetrics:
    """This frontend's side of the folder: ``metrics-{index}.prom`` for each frontend."""

    def __init__(self, folder: str | Path, index: int) -> None:
        self.folder, self.index = Path(folder), index

    def publish(self, text: bytes) -> None:
        """This frontend's exposition, replaced whole (a reader never sees half). Not
        once the launcher has removed the folder (it is stopping)."""
        path = self.folder / f"metrics-{self.index}.prom"
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_bytes(text)
            os.replace(tmp, path)
        except OSError as exc:
            log.debug("metrics not published: %s", exc)

    def merged(self, own: bytes) -> bytes:
        """Every frontend's latest exposition (``own`` for this one) as one, each sample
        labelled with its frontend."""
        texts = {self.index: own}
        for path in self.folder.glob("metrics-*.prom"):
            name = path.stem.removeprefix("metrics-")
            if name.isdigit() and int(name) != self.index:
                try:
                    texts[int(name)] = path.read_bytes()
                except FileNotFoundError:  # replaced or gone since the listing
                    continue
        families: dict[str, Metric] = {}
        for i, text in sorted(texts.items()):
            for family in text_string_to_metric_families(text.decode()):
                out = families.get(family.name)
                if out is None:
                    out = Metric(family.name, family.documentation, family.type, family.unit)
                    families[family.name] = out
                out.samples += [
                    s._replace(labels={"frontend": str(i), **s.labels}) for s in family.samples
                ]
        return _exposition(families)


def join_models(texts: Sequence[bytes]) -> bytes:
    """Several models' expositions (``Metrics.text``, one per model, in order) as one: one
    HELP and TYPE per family, every model's samples under it; a sample without
    ``model_name`` (the process's own) from the first exposition only."""
    families: dict[str, Metric] = {}
    for text in texts:
        for family in text_string_to_metric_families(text.decode()):
            out = families.get(family.name)
            if out is None:
                families[family.name] = family
            else:
                out.samples += [s for s in family.samples if MODEL_LABEL in s.labels]
    return _exposition(families)


def _exposition(families: dict[str, Metric]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)
