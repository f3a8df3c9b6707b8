"""The series budget: how many per-layer series a job's latest round may export.

A layer (activation slot) exports :data:`SERIES_PER_LAYER` series, a module (the parameters it
owns) :data:`SERIES_PER_MODULE`: its statistics times their aggregations over ranks. A job's
latest round exports at most ``max_series_per_job`` of them (the first layers in forward order),
and all jobs together ``max_series_total``, first come first served: a newcomer's schema cannot
push a running job off the scrape (:func:`allowance`). The rest are cut (:func:`cap_series`) and
counted in ``JobState.series_dropped``; the checks still see every layer.
"""

from __future__ import annotations

from dataclasses import replace

from gradwatch.columns import ARRAYS, STATISTICS

from .limits import Limits
from .reconcile import RoundResult, group_layers


def _per(kind: str) -> int:
    return sum(len(s.aggs) for s in STATISTICS if ARRAYS[s.array].exported_per == kind)


#: per-layer series one exported layer (an activation slot) or module (parameters) costs:
#: its statistics x their aggregations (min, median, max) over ranks
SERIES_PER_LAYER = _per("layer")
SERIES_PER_MODULE = _per("module")


def series_of(rr: RoundResult) -> int:
    """Per-layer series ``rr`` exports (at most: a statistic no rank observed is left out)."""
    return len(rr.layers) * SERIES_PER_LAYER + len(rr.modules) * SERIES_PER_MODULE


def cap_series(rr: RoundResult, budget: int) -> tuple[RoundResult, int]:
    """``rr`` cut to at most ``budget`` per-layer series, and how many series were cut.

    A layer (activation slot) exports :data:`SERIES_PER_LAYER` series, a module
    :data:`SERIES_PER_MODULE`; over budget, layers and modules keep the same share, the first ones
    in forward (``named_parameters``) order. Per-rank fields are untouched.
    """
    nl, nm = len(rr.layers), len(rr.modules)
    total = series_of(rr)
    if total <= budget:
        return rr, 0
    f = budget / total
    kl, km = int(nl * f), int(nm * f)
    agg = {}
    for stat in STATISTICS:
        values, observed = rr.agg[stat.name]
        k = km if ARRAYS[stat.array].exported_per == "module" else kl
        agg[stat.name] = (values[:, :k], observed[:k])
    cut = replace(
        rr, layers=rr.layers[:kl], act=rr.act[:, :kl], act_grad=rr.act_grad[:, :kl],
        layer_types=rr.layer_types[:kl], modules=rr.modules[:km], module=rr.module[:, :km], agg=agg,
        grouped=None,
    )
    if rr.grouped is not None:  # the layers merged for export follow the cut (on the writer, as the cut is)
        cut = replace(cut, grouped=group_layers(cut, rr.grouped.group_depth))
    return cut, total - kl * SERIES_PER_LAYER - km * SERIES_PER_MODULE

def allowance(jobs, job, limits: Limits) -> int:
    """Per-layer series ``job``'s next round may export: ``max_series_per_job``, and within
    ``max_series_total`` what the other proven jobs of ``jobs`` (their ``exported_series``) leave
    (a job not proven exports nothing: an invented one's schema takes no running job's share)."""
    others = sum(j.exported_series for j in jobs if j is not job and j.proven)
    return min(limits.max_series_per_job, max(0, limits.max_series_total - others))
