"""The registry of exported metric families: each declared once, read by the exporter, the
series cap, the catalog (docs/catalog.md), the dashboards and the alert rules' tests.

Labels are bounded: ``job_id`` (not ``job``, which Prometheus itself sets on every scraped series),
``rank``, ``layer`` (a module path of the model) and fixed enums — never a step, a pid, an address
or free text (case C34).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from .snapshot import Snapshot

PREFIX = "gradwatch_"


@dataclass(frozen=True)
class MetricDef:
    name: str  # full name; counters without the _total suffix the client adds
    kind: str  # gauge | counter | summary
    help: str
    labels: tuple[str, ...]
    unit: str
    samples: Callable[[Snapshot], Iterable]
    #: exported only for jobs above ``rank_series_max`` ranks (left out entirely when none is)
    bounded: bool = False


METRICS: dict[str, MetricDef] = {}


def metric(name: str, kind: str, help: str, labels: tuple[str, ...], unit: str = "", bounded: bool = False):
    """Register the decorated ``snapshot -> iterable of (label values, value)`` as a metric
    (``bounded``: a job-level stand-in for per-rank series, see :class:`~.seriescap.SeriesCap`)."""

    def deco(fn):
        full = PREFIX + name
        if full in METRICS:
            raise ValueError(f"metric {full} registered twice")
        METRICS[full] = MetricDef(full, kind, help, labels, unit, fn, bounded)
        return fn

    return deco


