"""What scrapes read: an immutable :class:`Snapshot` of the state, published by the writer.

The writer thread copies what the exporter and the HTTP API need out of the state
(:func:`snapshot`) at most every ``publish_interval_s``; the HTTP server's threads only read the
latest one. It holds the proven jobs only (:mod:`.admission`): a job not proven shows in no
series and no API answer, only in the counts of jobs by stage and of jobs not admitted. A job of more than ``rank_view_max`` ranks keeps views only of the ranks an active
finding names, and columns of every rank's fields for its job-level series.
"""

from __future__ import annotations

import collections
import math
import operator
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

from .jobs import COUNTER_FIELDS, counters_of, read_columns
from .reconcile import RoundResult

class RankView(NamedTuple):
    """One rank as the exporter sees it (a named tuple: a snapshot of a 16,384-rank job builds
    16,384 of them, a few times a second; a tuple is built 4x faster than a frozen dataclass)."""

    rank: int
    host: str
    local_rank: int
    step: int
    step_time: float
    grad_norm: float
    grad_nonfinite: int
    steps: int
    probes: int
    nonfinite_steps: int
    received: int
    lost: int
    restarts: int
    last_seen: float  # wall clock, seconds since the epoch
    agent_drops: int
    agent_errors: int
    local_grad_norm: float = math.nan
    compute_time: float = math.nan
    closing: bool = False
    loss: float = math.nan
    loss_scale: float = math.nan
    skipped_steps: int = 0
    agent_cost: float = math.nan
    probe_interval: int = 0
    over_budget: bool = False
    nonfinite_skipped: int = 0  # steps the agent's breaker skipped (on_nonfinite="skip")


@dataclass(frozen=True)
class JobView:
    job: str
    world: int
    ranks: tuple[RankView, ...]
    last_round: Optional[RoundResult]
    rounds_complete: int
    rounds_incomplete: int
    restarts: int = 0
    series_dropped: int = 0  # per-layer series of last_round over the job's cap (series.cap_series)
    #: counters summed over the job's ranks, forgotten ones included: ((name, total), ...)
    totals: tuple = ()
    #: the exporter's view of a job above rank_series_max: the ranks whose series it exports
    only: Optional[frozenset] = None
    #: ranks heard from (None: ``len(ranks)``); a job above the state's ``rank_view_max`` ranks
    #: keeps in ``ranks`` only those an active finding names (:func:`snapshot`)
    reporting: Optional[int] = None
    #: for such a job, the RankView fields its job-level series read, over every rank heard from:
    #: ``{"step": float64 [reporting], "last_seen": float64 [reporting]}`` (None: read ``ranks``)
    rank_columns: Optional[dict] = None
    ended: bool = False  # every rank said goodbye as its process ended (jobs.JobState.ended)
    rounds_partial: int = 0  # jobs.JobState.rounds_partial

    @property
    def n_ranks(self) -> int:
        """Ranks heard from."""
        return len(self.ranks) if self.reporting is None else self.reporting


@dataclass(frozen=True)
class Snapshot:
    jobs: tuple[JobView, ...] = ()
    checks: Any = None  # runner.RunnerView
    received: tuple[tuple[str, int], ...] = ()
    rejected: tuple[tuple[str, int], ...] = ()
    decode_seconds: float = 0.0
    decode_count: int = 0
    jobs_evicted: int = 0  # pending jobs evicted (State.max_pending_jobs)
    probes_shed: int = 0  # probe reports kept as their step's record alone (intake.Intake.shed)
    #: admission (State.admission_counts): the latest jobs not admitted ((label, reason), ...),
    #: identities refused, unproven jobs evicted for a slot, jobs held by stage ((stage, n), ...)
    not_admitted: tuple = ()
    jobs_refused: int = 0
    unproven_evicted: int = 0
    stages: tuple = ()
    control: tuple = ()  # ((what, count), ...) of the control room (control.Control.view)


#: the RankView fields worked out from other RankState fields; every other field is the RankState
#: attribute of its name
_DERIVED = ("last_seen", "agent_drops", "agent_errors")
#: reads every RankView field of a RankState at once, in order (a derived field reads ``rank`` as
#: a stand-in, replaced by :func:`rank_view`)
_READ = operator.attrgetter(*(f if f not in _DERIVED else "rank" for f in RankView._fields))
_SEEN, _DROPS, _ERRORS = (RankView._fields.index(f) for f in _DERIVED)


def rank_view(r, wall_now: float, mono_now: float) -> RankView:
    """The exporter's view of a ``jobs.RankState``: its fields by name, its last heard time on the
    wall clock (``wall_now`` and ``mono_now``: the same moment on both clocks), its agent's
    counters totalled over its boots."""
    v = list(_READ(r))
    v[_SEEN] = wall_now - (mono_now - r.last_seen)
    v[_DROPS] = r.drops_base + r.agent_drops
    v[_ERRORS] = r.errors_base + r.agent_errors
    return RankView._make(v)


def snapshot(state, wall_now: float) -> Snapshot:
    """Copy what the exporter needs out of ``state`` (called by the writer thread only).

    A job of more than ``state.rank_view_max`` ranks (the exporter's ``--rank-series-max``: it
    exports per-rank series only for the ranks a finding names) gets :class:`RankView` objects
    only for those ranks, and columns for its job-level series: 16,384 views would take ~40 ms of the
    writer per snapshot, making snapshots, and so the metrics' freshness, 4x rarer."""
    mono_now = state.clock()
    limit = state.limits.rank_view_max
    proven = [j for j in state.jobs.values() if j.proven]
    huge = {j.job for j in proven if limit is not None and max(j.world, len(j.ranks)) > limit}
    named = state.runner.named_ranks(huge) if state.runner is not None else dict.fromkeys(huge, set())
    checks = state.runner.view(named or None) if state.runner is not None else None
    jobs = []
    for job in proven:
        order = job.in_order()
        big = job.job in huge
        # every rank's fields in one pass, as float64: the counters' totals, and a huge job's columns
        fields = ("step", "last_seen", *COUNTER_FIELDS) if big else COUNTER_FIELDS
        col = dict(zip(fields, read_columns(order, fields)))
        totals = collections.Counter(job.forgotten)
        totals.update(counters_of(col))
        totals = tuple(sorted(totals.items()))
        if big:
            ranks = tuple(rank_view(job.ranks[k], wall_now, mono_now) for k in sorted(named[job.job]) if k in job.ranks)
            columns = {"step": col["step"], "last_seen": wall_now - (mono_now - col["last_seen"])}
            jobs.append(JobView(job.job, job.world, ranks, job.last_round, job.rounds_complete, job.rounds_incomplete,
                                job.restarts, job.series_dropped, totals, reporting=len(order), rank_columns=columns,
                                ended=job.ended, rounds_partial=job.rounds_partial))
            continue
        ranks = tuple(rank_view(r, wall_now, mono_now) for r in order)
        jobs.append(JobView(job.job, job.world, ranks, job.last_round, job.rounds_complete, job.rounds_incomplete,
                            job.restarts, job.series_dropped, totals, ended=job.ended, rounds_partial=job.rounds_partial))
    return Snapshot(
        tuple(jobs),
        checks,
        tuple(sorted(state.received.items())),
        tuple(sorted(state.rejected.items())),
        state.decode_seconds,
        state.decode_count,
        getattr(state, "jobs_evicted", 0),
        state.probes_shed,
        **_admission(state),
    )


def _admission(state) -> dict:
    got = getattr(state, "admission_counts", None)
    if got is None:
        return {}
    return {"not_admitted": got["not_admitted"], "jobs_refused": got["refused"],
            "unproven_evicted": got["unproven_evicted"], "stages": got["stages"]}

