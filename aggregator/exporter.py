"""Prometheus exporter: a custom collector that turns the latest snapshot into metric families.

Each exported metric is one self-registering unit (:func:`~.families.metric`): its name, type,
help and labels, and a function from a :class:`~.snapshot.Snapshot` to samples; they register
here, in :data:`~.families.METRICS` (docs/catalog.md is generated from it). Per-layer series are
aggregated over ranks and per-rank series over layers, never rank x layer; the series cap
(:mod:`.seriescap`) decides what one scrape keeps.

Counters only ever carry finite, non-decreasing values; NaN or Inf reach gauges only (case C36).
"""

from __future__ import annotations

import bisect
import collections
import math
import operator
from dataclasses import replace
from typing import Callable

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.registry import Collector

from gradwatch import columns

from .checks import CHECKS
from .families import METRICS, PREFIX, metric
from .reconcile import group_layers
from .runner import Runner
from .seriescap import ESSENTIAL_RANK_METRICS, LEFT_OUT, NAMED_RANKS_MAX, SeriesCap, kind_of
from .snapshot import Snapshot
from .state import REJECT_REASONS

__all__ = ["METRICS", "ESSENTIAL_RANK_METRICS", "NAMED_RANKS_MAX", "SnapshotCollector"]

JR = ("job_id", "rank")


def _ranks(snap: Snapshot):
    for j in snap.jobs:
        for r in j.ranks:
            yield j, r


def _rank_metric(name, kind, help, attr, unit=""):
    metric(name, kind, help, JR, unit)(lambda s: (((j.job, str(r.rank)), getattr(r, attr)) for j, r in _ranks(s)))


# --- per rank (sentinel, every step) ------------------------------------------------------------
_rank_metric("rank_step", "gauge", "Latest optimizer step reported by the rank (0-based).", "step")
_rank_metric("rank_grad_norm", "gauge", "Global L2 norm of the rank's gradients at its latest optimizer step (after any gradient clipping: what the optimizer applies); NaN/Inf pass through.", "grad_norm")
_rank_metric("rank_loss", "gauge", "Loss the training script handed to Monitor.observe_loss at the rank's latest step (mean over micro-steps); NaN when not observed.", "loss")
_rank_metric("rank_loss_scale", "gauge", "AMP GradScaler loss scale at the rank's latest step; NaN without a scaler.", "loss_scale")
_rank_metric("rank_skipped_steps", "counter", "Steps the rank's AMP loss scaler skipped (inf/NaN gradients while it searches the scale): labelled, not alerted.", "skipped_steps")
_rank_metric("rank_nonfinite_skipped_steps", "counter", "Steps whose optimizer update the rank's agent skipped because the gradients were not finite (its local breaker, on_nonfinite=\"skip\"): the weights stayed as they were.", "nonfinite_skipped")
_rank_metric("rank_local_grad_norm", "gauge", "L2 norm of the rank's own gradients before all-reduce at its latest step (DDP communication hook); NaN when the agent cannot measure it.", "local_grad_norm")
_rank_metric("rank_grad_nonfinite_params", "gauge", "Parameters whose gradient held NaN or Inf at the rank's latest step.", "grad_nonfinite")
_rank_metric("rank_step_seconds", "gauge", "Wall time of the rank's latest optimizer step, host clock.", "step_time", "seconds")
_rank_metric("rank_steps", "counter", "Optimizer steps reported by the rank.", "steps")
_rank_metric("rank_probes", "counter", "Probed steps reported by the rank.", "probes")
_rank_metric("rank_nonfinite_steps", "counter", "Steps whose gradient held NaN or Inf on the rank (alert on increase()).", "nonfinite_steps")
_rank_metric("rank_messages_received", "counter", "Messages received from the rank.", "received")
_rank_metric("rank_messages_lost", "counter", "Messages lost in flight from the rank, from gaps in its sequence numbers.", "lost")
_rank_metric("rank_restarts", "counter", "Times the rank's agent restarted (a new boot id).", "restarts")
_rank_metric("rank_last_seen_timestamp_seconds", "gauge", "When the aggregator last heard from the rank, seconds since the epoch.", "last_seen", "seconds")
_rank_metric("agent_dropped_reports", "counter", "Reports the rank's agent dropped (full queue or ZeroMQ high-water mark), as the agent reports them.", "agent_drops")
_rank_metric("agent_errors", "counter", "Internal failures of the rank's agent (a statistic skipped, a message that failed to build).", "agent_errors")
_rank_metric("rank_agent_cost_ratio", "gauge", "The rank's agent cost (sentinel every step, probes at the interval in use, bursts excluded) over its training step time, as the agent measures it, in its latest message; NaN until measured.", "agent_cost")
_rank_metric("rank_probe_interval_steps", "gauge", "Steps between the rank's probes, in its latest message (fixed by every=N, else chosen within the budget; 0 from older agents).", "probe_interval")
_rank_metric("rank_agent_over_budget", "gauge", "1 when the rank's agent costs over 3 budgets even at its longest probe interval (max_probe_interval_s), in its latest message, else 0.", "over_budget")


# --- per rank, totalled over layers at the latest probed step ------------------------------------
def _round_ranks(j, rr):
    """``(index, rank)`` of the round's ranks the job's view exports (``JobView.only``)."""
    if j.only is None:
        return enumerate(rr.ranks)
    # the few named ranks looked up in the round's ascending ranks, not 16,384 ranks walked per metric
    found = ((bisect.bisect_left(rr.ranks, rank), rank) for rank in sorted(j.only))
    return [(k, rr.ranks[k]) for k, rank in found if k < len(rr.ranks) and rr.ranks[k] == rank]


def _rank_total(col: int):
    def fn(s: Snapshot):
        for j in s.jobs:
            rr = j.last_round
            if rr is None:
                continue
            for k, rank in _round_ranks(j, rr):
                yield (j.job, str(rank)), float(rr.rank_totals[k, col])

    return fn


for _col, _stat in enumerate(s for s in columns.STATISTICS if s.rank_total):
    metric(_stat.rank_total[0], "gauge", _stat.rank_total[1], JR)(_rank_total(_col))


# --- per layer, aggregated over ranks at the latest probed step -----------------------------------
def _layer_stat(stat: columns.Statistic):
    per_module = columns.ARRAYS[stat.array].exported_per == "module"

    def fn(s: Snapshot):
        for j in s.jobs:
            rr = j.last_round
            if rr is None:
                continue
            names = rr.modules if per_module else rr.layers
            values, observed = rr.agg[stat.name]
            for a, agg in enumerate(stat.aggs):
                for i in observed.nonzero()[0]:
                    yield (j.job, names[i], agg), float(values[a, i])

    return fn


for _stat in columns.STATISTICS:
    metric(
        f"layer_{_stat.name}", "gauge",
        f"{_stat.help} Aggregated over ranks (agg={'|'.join(_stat.aggs)}) at the latest probed step.",
        ("job_id", "layer", "agg"), _stat.unit,
    )(_layer_stat(_stat))


# --- per job -------------------------------------------------------------------------------------
metric("job_world_size", "gauge", "World size the job's ranks report.", ("job_id",))(lambda s: (((j.job,), j.world) for j in s.jobs))
metric("job_ranks_reporting", "gauge", "Ranks of the job the aggregator currently hears from.", ("job_id",))(lambda s: (((j.job,), j.n_ranks) for j in s.jobs))
metric("job_restarts", "counter", "Times the job came back from an earlier step under the same job id (all ranks restarted from a checkpoint); its state and the checks' start over.", ("job_id",))(
    lambda s: (((j.job,), j.restarts) for j in s.jobs)
)
metric("job_ended", "gauge", "1 once every rank of the job said goodbye as its process ended (training finished, the interpreter exited, an exception left the loop, or its monitor was closed), round_grace_s ago: the shipped alerts about its ranks at work (straggler, silent, stalled, skew, outlier) resolve; its series and findings stay until rank_ttl_s. 0 while it runs.", ("job_id",))(
    lambda s: (((j.job,), float(j.ended)) for j in s.jobs)
)
# --- per job, in place of per-rank series above rank_series_max ranks -----------------------------
def _over_ranks(attr: str, aggs: tuple[str, ...]):
    def fn(s: Snapshot):
        for j in s.jobs:
            if j.rank_columns is not None:  # a huge job's snapshot: every rank's values as columns
                v = j.rank_columns[attr]
            else:
                v = np.fromiter(map(operator.attrgetter(attr), j.ranks), np.float64, len(j.ranks))
            if len(v):
                for a in aggs:
                    yield (j.job, a), float(getattr(np, a)(v))

    return fn


def _job_total(name: str):
    return lambda s: (((j.job,), dict(j.totals).get(name, 0)) for j in s.jobs)


BOUNDED = (" Exported for jobs above --rank-series-max ranks, and jobs whose per-rank series --max-series-total leaves"
           " out, whose per-rank series only the ranks a finding names keep (64 at most).")
metric("job_rank_step", "gauge", "Latest optimizer step over the job's ranks (agg=min|median|max)." + BOUNDED,
       ("job_id", "agg"), bounded=True)(_over_ranks("step", ("min", "median", "max")))
metric("job_rank_last_seen_timestamp_seconds", "gauge", "When the aggregator last heard from the job's ranks, seconds since the epoch (agg=min: the longest silent rank, max)." + BOUNDED,
       ("job_id", "agg"), "seconds", bounded=True)(_over_ranks("last_seen", ("min", "max")))
metric("job_steps", "counter", "Optimizer steps reported, summed over the job's ranks." + BOUNDED, ("job_id",), bounded=True)(_job_total("steps"))
metric("job_nonfinite_steps", "counter", "Steps whose gradient held NaN or Inf, summed over the job's ranks." + BOUNDED, ("job_id",), bounded=True)(
    _job_total("nonfinite_steps"))
metric("job_agent_dropped_reports", "counter", "Reports the agents dropped, summed over the job's ranks." + BOUNDED, ("job_id",), bounded=True)(
    _job_total("agent_drops"))
metric("job_messages_lost", "counter", "Messages lost in flight, summed over the job's ranks." + BOUNDED, ("job_id",), bounded=True)(
    _job_total("lost"))


metric("job_probe_step", "gauge", "Step of the latest reconciled probed step.", ("job_id",))(
    lambda s: (((j.job,), j.last_round.step) for j in s.jobs if j.last_round is not None)
)
metric("rounds", "counter", "Probed steps reconciled, by outcome: complete (every rank reported), partial (the ranks missing did not probe the step: their probe interval skips it, or a burst on other ranks) or incomplete (a report that should have come did not: grace period ran out, or the rank went past the step without it).", ("job_id", "outcome"))(
    lambda s: [x for j in s.jobs for x in (((j.job, "complete"), j.rounds_complete), ((j.job, "partial"), j.rounds_partial),
                                          ((j.job, "incomplete"), j.rounds_incomplete))]
)

# --- the aggregator itself --------------------------------------------------------------------------
metric("messages_received", "counter", "Valid messages received, by kind (schema, report, heartbeat).", ("kind",))(
    lambda s: (((k,), v) for k, v in s.received)
)
metric("job_series_dropped", "gauge", "Per-layer series of the job's latest probed step not exported: over --max-series-per-job, or over --max-series-total with the other jobs' series.", ("job_id",))(
    lambda s: (((j.job,), j.series_dropped) for j in s.jobs)
)
metric("jobs_evicted", "counter", "Jobs evicted before they sent a schema and a report (more than --max-pending-jobs such jobs at once).", ())(
    lambda s: (((), s.jobs_evicted),)
)
metric("jobs_unproven_evicted", "counter", "Jobs holding a slot but not proven (--proof-steps) evicted: for a job that needed the slot, by a newer job of the same sender past --max-unproven-per-source, or for the schemas of another (jobs not proven hold 1/16 of --max-schema-bytes).", ())(
    lambda s: (((), s.unproven_evicted),)
)
metric("jobs", "gauge", "Jobs the aggregator holds, by stage: proven (exported and judged), unproven (holding a slot, quiet until --proof-rank-share of its ranks advanced their step in --proof-steps messages each), pending (no slot yet).", ("stage",))(
    lambda s: (((k,), n) for k, n in s.stages)
)
metric("jobs_not_admitted", "counter", "Jobs refused a slot because every --max-jobs slot holds a proven job (their reports rejected as too_many_jobs), each counted once; never judged.", ())(
    lambda s: (((), s.jobs_refused),)
)
metric("job_not_admitted", "gauge", "1 for each of the 16 latest jobs not admitted while they wait for a slot, with why (too_many_jobs: raise --max-jobs); the series goes once the job is admitted or gone.", ("job_id", "reason"))(
    lambda s: (((label, reason), 1.0) for label, reason in s.not_admitted)
)
metric("series_left_out", "gauge", "Samples this scrape left out to stay within --max-series-total, by kind: rank (per-rank series of jobs shown by job-level series instead), layer (per-layer series of the newest jobs), job (every series of the newest jobs).", ("kind",))(
    lambda s: (((k,), 0.0) for k in ("rank", "layer", "job"))  # the collector writes this scrape's (SnapshotCollector.plan)
)
metric("probes_shed", "counter", "Probe reports the aggregator had no room for under overload and kept as their step's record alone: counted as received reports; their rounds lack those ranks' arrays (incomplete).", ())(
    lambda s: (((), s.probes_shed),)
)
def _rejected(s: Snapshot):
    counts = dict(s.rejected)
    return (((k,), counts.get(k, 0)) for k in REJECT_REASONS)  # each reason from the start: rate() sees 0, not nothing


metric("messages_rejected", "counter", "Messages rejected, by reason (malformed, too_large, unknown_schema, ...).", ("reason",))(_rejected)


# --- cross-rank checks -----------------------------------------------------------------------------
def _status(s: Snapshot):
    v = s.checks
    for job, check, outcome in (v.status if v else ()):
        for st in ("healthy", "finding", "no_data"):
            yield (job, check, st), 1.0 if st == outcome else 0.0


metric("check_status", "gauge", "Outcome of each check's latest evaluation: 1 for the current status (healthy, finding, no_data), 0 for the others.", ("job_id", "check", "status"))(_status)
def _findings(s: Snapshot):
    v = s.checks
    raised = dict(v.raised) if v else {}
    # 0 for every check with a status too, so that increase() sees a job's first finding
    for k in sorted({*raised, *((j, c) for j, c, _ in (v.status if v else ()))}):
        yield k, raised.get(k, 0)


metric("findings", "counter", "Findings raised by each check (a finding stays raised until it resolves).", ("job_id", "check"))(_findings)
metric("rank_finding_raised_timestamp_seconds", "gauge", "When each check last raised a finding naming the rank, seconds since the epoch (a job's first " + str(Runner.RANKS_TIMED_MAX) + " ranks named per check): the rank of a finding shorter than a scrape, which check_rank_flagged never shows.", ("job_id", "check", "rank"), "seconds")(
    lambda s: (((j, c, str(r)), t) for (j, c, r), t in (s.checks.raised_at if s.checks else ())))
def _folded(s: Snapshot):
    v = s.checks
    folded = dict(v.folded) if v else {}
    # 0 for every check with causes and a status, so that increase() sees a job's first fold
    for k in sorted({*folded, *((j, c) for j, c, _ in (v.status if v else ()) if getattr(CHECKS.get(c), "knock_on_of", ()))}):
        yield k, folded.get(k, 0)


metric("findings_folded", "counter", "Findings of each check folded into their cause's finding as knock-ons (knock_on_of, within knock_on_window_s) instead of raised: listed in the cause's details.knock_on, not in findings_total or check_rank_flagged.", ("job_id", "check"))(_folded)
def _active(s: Snapshot):
    v = s.checks
    if not v:
        return
    n = collections.Counter((f.job, f.check) for f in v.active)
    # 0 for every check with a status: "finding" there may be a knock-on folded into its cause's
    for k in sorted({*n, *((j, c) for j, c, _ in v.status)}):
        yield k, float(n.get(k, 0))


metric("check_findings_active", "gauge", "Active findings of each check, knock-ons folded into their cause's finding not counted (check_status says finding for those too): what the job-level alerts read.", ("job_id", "check"))(_active)
metric("check_errors", "counter", "Exceptions raised inside a check (each is isolated; the check is skipped for that event).", ("check",))(
    lambda s: (((c,), n) for c, n in (s.checks.errors if s.checks else ()))
)
metric("check_seconds", "counter", "Time spent evaluating each check.", ("check",), "seconds")(
    lambda s: (((c,), n) for c, n in (s.checks.seconds if s.checks else ()))
)
metric("check_rank_flagged", "gauge", "1 for each rank an active finding names, per check.", ("job_id", "check", "rank"))(
    lambda s: ((((f.job, f.check, str(f.rank)), 1.0) for f in (s.checks.active if s.checks else ()) if f.rank is not None))
)
metric("check_layer_flagged", "gauge", "1 for each layer an active finding names, per check (at most max_layers per check).", ("job_id", "check", "layer"))(
    lambda s: ((((f.job, f.check, f.layer), 1.0) for f in (s.checks.active if s.checks else ()) if f.layer is not None))
)

#: most characters of a frame in ``finding_stack_info``'s label (a path's tail is kept)
FRAME_LABEL_MAX = 200


def _frame_label(f: dict) -> str:
    where = f"{f.get('file', '')}:{f.get('line', 0)} {f.get('function', '')}"
    return where if len(where) <= FRAME_LABEL_MAX else "..." + where[-(FRAME_LABEL_MAX - 3):]


def _stack_info(s: Snapshot):
    for f in (s.checks.active if s.checks else ()):
        stuck = (f.details.get("stacks") or {}).get("stuck") if f.rank is not None else None
        if stuck and stuck.get("frames"):
            yield (f.job, f.check, str(f.rank), _frame_label(stuck["frames"][-1])), 1.0


metric("finding_stack_info", "gauge", "1 for each active finding whose rank the aggregator asked where it is stuck (training_stalled, straggler, rank_silent) and that answered, the frame label the innermost Python frame of that rank's training thread (file:line function); the alerts quote it.", ("job_id", "check", "rank", "frame"))(_stack_info)


#: what the control room counts (:meth:`.control.Control.view`), each shown from the start
CONTROL_COUNTS = ("requests", "commands", "sent", "dropped", "answers", "answers_rejected", "refused", "throttled", "halts",
                  "halts_withheld")


def _control(s: Snapshot):
    counts = dict(s.control)
    return (((k,), counts.get(k, 0)) for k in CONTROL_COUNTS)


metric("control", "counter", "The control channel (docs/control.md), by what: requests made (on demand and for findings), commands queued to agents, sent, dropped (queue full, connection gone or full), answers taken, answers rejected (from a rank not asked, on another connection, too late), commands refused by agents, requests over a job's rate, halts sent, halts withheld (a rank's identity unsettled: claimed by another process, or back alone under a new boot, within 30 s).", ("what",))(_control)


def _check_value(short: str):
    def fn(s: Snapshot):
        v = s.checks
        return v.values.get(short, {}).items() if v else ()

    return fn


def _register_check_metrics() -> None:
    from .checks import load_all

    for cls in load_all().values():
        for short, (help_, labels, unit) in cls.metrics.items():
            if PREFIX + short not in METRICS:
                metric(short, "gauge", f"{help_} (check: {cls.name})", ("job_id", *labels), unit)(_check_value(short))


_register_check_metrics()

def _dedupe(samples):
    """Keep the first sample of each label set: a duplicate would make the exposition invalid."""
    seen = set()
    for labels, value in samples:
        if labels not in seen:
            seen.add(labels)
            yield labels, value

class SnapshotCollector(Collector):
    """Yields every registered metric from ``get_snapshot()`` at scrape time.

    Args:
        get_snapshot: returns the latest published snapshot.
        layer_depth: merge per-layer series into module-path prefixes of this many components
            (0: one series per layer; see :func:`~.reconcile.group_layers`).
        rank_detail_max: in jobs with more ranks, per-rank series other than
            :data:`ESSENTIAL_RANK_METRICS` are exported only for the ranks an active finding names
            (None: for every rank). Both bound the series count (case C34).
        rank_series_max: in jobs with more ranks, every per-rank series is exported only for the
            ranks an active finding names, and the job-level ``bounded`` families stand in for
            the rest (None: never; see docs/operations.md: Scale).
        max_series_total: most samples a scrape holds, every family together (None: no cap):
            past it the jobs of the most ranks are shown by the ``bounded`` families
            instead (their per-rank series kept for :data:`NAMED_RANKS_MAX` ranks a finding
            names), then the newest jobs' per-layer series go, then the newest jobs (:meth:`.SeriesCap.plan`);
            the samples left out are counted in ``gradwatch_series_left_out``.
    """

    def __init__(self, get_snapshot: Callable[[], Snapshot], layer_depth: int = 0, rank_detail_max: int | None = None,
                 rank_series_max: int | None = None, max_series_total: int | None = None):
        self._get = get_snapshot
        self.layer_depth = layer_depth
        self.cap = SeriesCap(rank_detail_max, rank_series_max, max_series_total)
        self._grouped: dict = {}  # job -> (its latest RoundResult, grouped)

    def _group(self, snap: Snapshot) -> Snapshot:
        jobs, cache = [], {}
        for j in snap.jobs:
            rr = j.last_round
            if rr is not None:
                src, grouped = self._grouped.get(j.job, (None, None))
                if rr.grouped is not None and rr.grouped.group_depth == self.layer_depth:
                    grouped = rr.grouped  # merged with the round, on the writer (RoundResult.grouped)
                elif src is not rr:
                    grouped = group_layers(rr, self.layer_depth)
                cache[j.job] = (rr, grouped)
                j = replace(j, last_round=grouped)
            jobs.append(j)
        self._grouped = cache
        return replace(snap, jobs=tuple(jobs))
    def collect(self):
        snap = self._get()
        if self.layer_depth > 0:
            snap = self._group(snap)
        kinds = {name: kind_of(d) for name, d in METRICS.items()}
        # every family but the per-rank and per-layer ones, as they are: the plan counts them
        held = {name: list(_dedupe(d.samples(snap))) for name, d in METRICS.items()
                if kinds[name] not in ("rank", "layer") and name != LEFT_OUT}
        plan = self.cap.plan(snap, held)
        held[LEFT_OUT] = [((k,), float(n)) for k, n in plan.left_out.items()]
        few = snap  # per-rank families read the ranks kept only, of the reduced jobs
        if plan.reduced:
            kept = {job: frozenset(ranks) for job, ranks in plan.reduced.items()}
            few = replace(snap, jobs=tuple(
                replace(j, ranks=tuple(r for r in j.ranks if r.rank in kept[j.job]), reporting=j.n_ranks,
                        only=kept[j.job]) if j.job in kept else j
                for j in snap.jobs))
        for name, d in METRICS.items():
            kind = kinds[name]
            if kind == "bounded":  # job-level stand-ins: only for the jobs that need them, else no family
                samples = [(lv, v) for lv, v in held[name] if lv[0] in plan.reduced]
                if not samples:
                    continue
            elif kind == "finding":
                samples = self.cap.findings_kept(name, d, plan, held[name])
            elif name in held:
                samples = held[name]
            else:
                samples = d.samples(few if kind == "rank" else snap)
            samples = self.cap.keep(snap, d, kind, plan, samples)
            if d.kind == "gauge":
                fam = GaugeMetricFamily(d.name, d.help, labels=d.labels, unit=d.unit)
                for labels, value in _dedupe(samples):
                    fam.add_metric(labels, float(value))
            else:
                fam = CounterMetricFamily(d.name, d.help, labels=d.labels, unit=d.unit)
                for labels, value in _dedupe(samples):
                    v = float(value)
                    if math.isfinite(v):  # case C36: a counter never carries NaN/Inf
                        fam.add_metric(labels, v)
            yield fam
        yield SummaryMetricFamily(
            PREFIX + "decode_seconds", "Time spent decoding and applying messages.",
            count_value=snap.decode_count, sum_value=snap.decode_seconds, unit="seconds",
        )
