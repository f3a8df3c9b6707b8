"""The series cap: which samples one scrape exports so that every family together stays within
``--max-series-total``, and per-rank series within ``--rank-detail-max`` and ``--rank-series-max``.

:class:`SeriesCap` makes a :class:`Plan` from the snapshot and the samples of the families it
counts as they are, then filters each family's samples by it. The collector
(:class:`~.exporter.SnapshotCollector`) reads the plan; nothing here builds a sample.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import numpy as np

from gradwatch import columns

from .families import METRICS, PREFIX, MetricDef
from .snapshot import Snapshot


def _int(label: str):
    """A rank label as the int findings name it (a label that is no number stays as it is)."""
    try:
        return int(label)
    except ValueError:
        return label

#: per-rank series exported for every rank of a job however large (the alerts need them); the
#: others only up to ``rank_detail_max`` ranks, beyond that for the ranks an active finding names
ESSENTIAL_RANK_METRICS = frozenset(PREFIX + n for n in (
    "rank_step", "rank_steps", "rank_nonfinite_steps", "rank_last_seen_timestamp_seconds",
    "agent_dropped_reports", "rank_messages_lost", "check_rank_flagged",
))


#: per-rank series that exist only for the ranks findings name (bounded by the cap's plan for
#: jobs whose per-rank series it leaves out)
RANK_SERIES_OF_FINDINGS = frozenset(PREFIX + n for n in ("check_rank_flagged", "rank_finding_raised_timestamp_seconds",
                                                          "finding_stack_info"))

#: ranks a job whose per-rank series the series cap leaves out (or above ``rank_series_max``)
#: keeps per-rank series for: the first ones (by rank) an active finding names
NAMED_RANKS_MAX = 64
#: samples a scrape holds besides the registered families (decode_seconds' count and sum)
_UNREGISTERED = 2
#: the findings' per-rank family bounded by the runner (a job's first ranks per check), not by ranks named now
TIMED = PREFIX + "rank_finding_raised_timestamp_seconds"
#: the family of the samples the cap left out (written once the plan is made)
LEFT_OUT = PREFIX + "series_left_out"


def kind_of(d: MetricDef) -> str:
    """How the series cap counts family ``d``: ``rank`` (one sample per rank at most, estimated),
    ``finding`` (per rank, of findings: counted), ``layer`` (per layer: counted from the round),
    ``bounded`` (job-level stand-ins), ``job`` or ``global`` (counted)."""
    if d.bounded:
        return "bounded"
    if "rank" in d.labels:
        return "finding" if d.name in RANK_SERIES_OF_FINDINGS else "rank"
    if d.labels == ("job_id", "layer", "agg"):
        return "layer"
    return "job" if "job_id" in d.labels else "global"


def layer_samples(rr) -> int:
    """Per-layer samples the ``_layer_stat`` families export for a round (observed statistics)."""
    if rr is None:
        return 0
    return sum(len(stat.aggs) * int(np.count_nonzero(rr.agg[stat.name][1])) for stat in columns.STATISTICS)


@dataclass
class Plan:
    """What one scrape exports within the series cap (:meth:`SnapshotCollector.plan`).

    Attributes:
        reduced: ``{job: ranks}`` of the jobs whose per-rank series only these ranks keep (at most
            :data:`NAMED_RANKS_MAX`, ranks a finding names), job-level stand-ins for the rest; such
            a job keeps :data:`NAMED_RANKS_MAX` ranks' ``rank_finding_raised_timestamp_seconds``
            at most, none if in ``untimed``.
        no_layers: jobs whose per-layer series are left out.
        dropped: jobs none of whose series are exported.
        left_out: ``{kind: samples}`` left out (``rank``, ``layer``, ``job``).
        samples: samples the scrape holds at most.
    """

    reduced: dict = field(default_factory=dict)
    untimed: set = field(default_factory=set)
    no_layers: set = field(default_factory=set)
    dropped: set = field(default_factory=set)
    left_out: dict = field(default_factory=lambda: {"rank": 0, "layer": 0, "job": 0})
    samples: int = 0

class SeriesCap:
    """The bounds one scrape keeps, and how (see :class:`~.exporter.SnapshotCollector` for the
    arguments)."""

    def __init__(self, rank_detail_max: int | None = None, rank_series_max: int | None = None,
                 max_series_total: int | None = None):
        self.rank_detail_max = rank_detail_max
        self.rank_series_max = rank_series_max
        self.max_series_total = max_series_total

    @staticmethod
    def over(snap: Snapshot, limit: int | None) -> set[str]:
        """Jobs with more than ``limit`` ranks (none when ``limit`` is None)."""
        return set() if limit is None else {j.job for j in snap.jobs if max(j.world, j.n_ranks) > limit}

    def named(self, snap: Snapshot) -> dict:
        """``{job: ranks its active findings name}``."""
        named: dict = collections.defaultdict(set)
        for f in (snap.checks.active if snap.checks else ()):
            if f.rank is not None:
                named[f.job].add(f.rank)
        return named

    def plan(self, snap: Snapshot, held: dict) -> Plan:
        """What this scrape exports (:class:`Plan`): every job's series while the samples stay
        within ``max_series_total``; past it, in turn, the jobs of the most ranks (the newest
        first among equals) are shown by their job-level stand-ins and the per-rank
        series of at most :data:`NAMED_RANKS_MAX` ranks a finding names, the named ranks of the
        newest such jobs go, the newest jobs' per-layer series go, and the newest jobs go whole.
        Jobs above ``rank_series_max`` ranks are always shown so. ``held``: the samples of every
        family but the per-rank and per-layer ones, by name (counted as they are); per-rank
        samples are estimated from above (each per-rank family at most one sample per rank), and
        per-layer ones counted from the rounds, so the scrape holds at most :attr:`Plan.samples`."""
        jobs = [j.job for j in snap.jobs]
        by_job = {j.job: j for j in snap.jobs}
        rank_fams = [d for d in METRICS.values() if kind_of(d) == "rank"]
        n_rank = len(rank_fams)
        n_essential = sum(d.name in ESSENTIAL_RANK_METRICS for d in rank_fams)
        named = self.named(snap)
        fixed = _UNREGISTERED
        per_job, bounded, findings, timed = (collections.Counter() for _ in range(4))
        flagged: dict = collections.defaultdict(collections.Counter)  # job -> rank -> capped findings' samples
        for name, got in held.items():
            d = METRICS[name]
            kind = kind_of(d)
            if "job_id" not in d.labels:
                fixed += len(got)
                continue
            ji = d.labels.index("job_id")
            ri = d.labels.index("rank") if kind == "finding" else None
            for lv, _ in got:
                job = lv[ji]
                if job not in by_job:
                    fixed += 1  # a job id of no exported job (the jobs not admitted): the aggregator's own
                elif kind == "bounded":
                    bounded[job] += 1
                elif kind == "finding":
                    findings[job] += 1
                    if name == TIMED:
                        timed[job] += 1
                    else:
                        flagged[job][_int(lv[ri])] += 1
                else:
                    per_job[job] += 1
        layers = {j.job: layer_samples(j.last_round) for j in snap.jobs}
        huge = self.over(snap, self.rank_series_max)
        detail = self.over(snap, self.rank_detail_max)

        def kept_ranks(job: str) -> list:
            return sorted(k for k in named.get(job, ()) if isinstance(k, int))[:NAMED_RANKS_MAX]

        def full(job: str) -> int:
            n, few = by_job[job].n_ranks, named.get(job, ())
            per_rank = n * n_rank if job not in detail else n * n_essential + min(len(few), n) * (n_rank - n_essential)
            return per_rank + findings[job]

        def reduced(job: str, ranks, with_timed: bool = True) -> int:
            got = flagged.get(job, {})
            return (bounded[job] + len(ranks) * n_rank + sum(got.get(k, 0) for k in ranks)
                    + (min(timed[job], NAMED_RANKS_MAX) if with_timed else 0))

        out = Plan(reduced={job: kept_ranks(job) for job in jobs if job in huge})
        cost = {job: per_job[job] + layers[job] + (reduced(job, out.reduced[job]) if job in out.reduced else full(job))
                for job in jobs}
        total = fixed + sum(cost.values())
        cap = self.max_series_total
        if cap is not None and total > cap:
            # the jobs of most ranks first (they buy the most room; not by findings, which come and
            # go: a job's series would flap), the newest first among equals
            order = sorted((job for job in jobs if job not in out.reduced),
                           key=lambda job: (by_job[job].n_ranks, jobs.index(job)), reverse=True)
            for job in order:
                if total <= cap:
                    break
                ranks = kept_ranks(job)
                new = per_job[job] + layers[job] + reduced(job, ranks)
                out.left_out["rank"] += cost[job] - new
                total += new - cost[job]
                cost[job], out.reduced[job] = new, ranks
            for job in reversed(jobs):  # then the named ranks of the newest
                if total <= cap:
                    break
                if job in out.reduced and (out.reduced[job] or timed[job]):
                    new = per_job[job] + layers[job] + reduced(job, [], with_timed=False)
                    out.left_out["rank"] += cost[job] - new
                    total += new - cost[job]
                    cost[job], out.reduced[job] = new, []
                    out.untimed.add(job)
            for job in reversed(jobs):  # then the newest jobs' per-layer series
                if total <= cap:
                    break
                if layers[job]:
                    out.no_layers.add(job)
                    out.left_out["layer"] += layers[job]
                    total -= layers[job]
                    cost[job] -= layers[job]
            for job in reversed(jobs):  # and, past every job's own, the newest jobs
                if total <= cap:
                    break
                out.dropped.add(job)
                out.left_out["job"] += cost[job]
                total -= cost[job]
        out.samples = total
        return out

    def findings_kept(self, name: str, d: MetricDef, plan: Plan, samples: list) -> list:
        """The findings' per-rank samples of family ``name`` a reduced job keeps: those of its
        kept ranks, and (``gradwatch_rank_finding_raised_timestamp_seconds``) its first
        :data:`NAMED_RANKS_MAX` by check and rank (none once ``untimed``)."""
        if not plan.reduced:
            return samples
        ji, ri = d.labels.index("job_id"), d.labels.index("rank")
        kept = {job: {str(k) for k in ranks} for job, ranks in plan.reduced.items()}
        if name != TIMED:
            return [(lv, v) for lv, v in samples if lv[ji] not in kept or lv[ri] in kept[lv[ji]]]
        out, n = [], collections.Counter()
        for lv, v in sorted(samples, key=lambda x: (x[0][ji] in kept, x[0][:ri], _int(x[0][ri]))):
            job = lv[ji]
            if job in kept:
                if job in plan.untimed or n[job] >= NAMED_RANKS_MAX:
                    continue
                n[job] += 1
            out.append((lv, v))
        return out

    def keep(self, snap: Snapshot, d: MetricDef, kind: str, plan: Plan, samples):
        """``samples`` of family ``d`` within ``plan``: no sample of a dropped job, no per-layer one
        of a job without layers, per-rank ones of a reduced job for its kept ranks only, and
        non-essential per-rank ones of jobs above ``rank_detail_max`` for the ranks an active
        finding names."""
        if "job_id" not in d.labels:
            return samples
        ji = d.labels.index("job_id")
        gone = plan.dropped | plan.no_layers if kind == "layer" else plan.dropped
        if kind != "rank":
            return ((lv, v) for lv, v in samples if lv[ji] not in gone) if gone else samples
        ri = d.labels.index("rank")
        keep = {job: {str(k) for k in ranks} for job, ranks in plan.reduced.items()}
        detail = self.over(snap, self.rank_detail_max) if d.name not in ESSENTIAL_RANK_METRICS else set()
        detail -= keep.keys()
        named = {(job, str(k)) for job, ranks in self.named(snap).items() for k in ranks} if detail else set()
        if not (gone or keep or detail):
            return samples
        return ((lv, v) for lv, v in samples
                if lv[ji] not in gone
                and (lv[ji] not in keep or lv[ri] in keep[lv[ji]])
                and (lv[ji] not in detail or (lv[ji], lv[ri]) in named))
