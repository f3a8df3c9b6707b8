"""Training stalled: no rank completes a step, although the ranks are alive and heard.

The agents keep heartbeating from their own thread while training is stuck, so the aggregator can
tell a stalled job (heartbeats, no steps) from a dead one (silence, see ``rank_silent``). When no
rank that has not said goodbye has reported a completed step for ``max(stall_after_s, stall_steps x
the median step time)`` seconds and at least one of them was heard within ``silent_after_s``,
training has stalled. The median is over the job's recent reported step times (the agents' wall
time per step), so a job of 10 s steps is not judged by a 3 s clock while one of 20 ms steps is
named within seconds; load that slows every step lengthens the bound with it.

A pause outside any collective (no heard rank waits in all-reduce: an evaluation pass, a checkpoint
save, data loading) is normal in many jobs, so that case is judged against the longer
``stall_outside_after_s`` instead. So is a rank not waiting whose training thread keeps running or
waiting for a CPU (``runnable`` share of its latest heartbeat interval at least ``RUNNABLE``, from
the heartbeats' ``run_s``): it is slow, or starved of CPUs on a loaded host, where a hung one is
blocked (a sleep, a lock, I/O, a dead data loader) and adds nothing. A rank spinning in a loop
looks busy too, and is named after ``stall_outside_after_s``.

A stall is judged only while the job is heard: nothing at all from it for ``DARK_S`` (a partition,
a stopped aggregator; every agent sends something at least every second) is no data, and the stall clock starts over
when it is heard again (agents send a heartbeat before the reports they held back): steps nobody
could see are not a stall.

A rank whose heartbeat says it has been in its current step for less time (``in_step_s``, plus
the heartbeat's age) than no step was reported, by more than ``PROGRESS_S``, completed a step the
aggregator has not heard of yet (the report follows its heartbeat, coalesced): it is not named;
if no rank is left to name, the job has moved on and the check is healthy. At the end of a hang
the peers so start their next step before the step that freed them is reported.

Each heartbeat says whether the rank has handed its first gradient bucket of the current step to
all-reduce and, where the agent times it (CPU buckets), that backward pass has not ended yet
(``waiting``: it waits on its peers). A rank that is *not* waiting while its peers are
is where the job is stuck: its peers wait for it in the collective. A silent rank while its peers
wait is the same case. The check raises one finding per such rank (naming it, so
``gradwatch_check_rank_flagged`` shows it); when no rank can be told apart (every rank waits: a
deadlock inside the collective or the network; or none does: every rank stuck in data loading,
checkpointing or the host) it raises one job-level finding instead. Details carry every rank's
waiting flag and seconds since its latest step. Training before its first completed step is not
judged (start-up, compilation and data loading may take long): no data. The finding resolves at
the next completed step, or when every rank has said goodbye.

While the aggregator's intake drops this job's frames (overload), and for ``silent_after_s`` after,
this check names nobody new: what the aggregator missed is not the ranks' doing.

A stall while ``rank_silent`` names a rank of the job (or named one within ``knock_on_window_s``)
is that rank's knock-on (``knock_on_of``): the runner folds the new finding into the silent rank's
(``details["knock_on"]``) instead of raising it, so one stopped rank is one finding, and no peer is
named as hung for waiting on it. This check's status still says ``finding``. A stall with no
silent rank is raised as always.

A stall that would name at least half of the job's ranks (and at least 2) is one job-wide event:
one job-level finding (``reason`` ``job_wide``) whose details give the ``count`` of those ranks and
the first :data:`TrainingStalled.LISTED` of them (``ranks``, sorted), not one finding per rank.
"""

from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass, field
from typing import Optional

from pydantic import Field

from . import Check, Evaluation, Finding, register


def _ranks(rs) -> str:
    return ", ".join(str(r.rank) for r in rs)


@dataclass
class _Stall:
    #: recent step times the median is taken over (reports of every rank)
    times: collections.deque = field(default_factory=lambda: collections.deque(maxlen=TrainingStalled.WINDOW))
    idle: Optional[float] = None  # seconds since any rank completed a step, at the latest tick that knew
    heard: Optional[float] = None  # the job's latest message's time at the previous tick
    since: Optional[float] = None  # when the aggregator heard the job again after a dark gap
    named: Optional[tuple] = None  # (last step, findings naming ranks) of its stall


@register
class TrainingStalled(Check):
    name = "training_stalled"
    severity = "critical"
    description = (
        "Raised when no rank completes a step for max(stall_after_s, stall_steps median step times) while "
        "the aggregator still hears the ranks' heartbeats (stall_outside_after_s when no rank waits in "
        "all-reduce: evaluation, checkpointing). Names the ranks not waiting in all-reduce (or silent) while their "
        "peers wait there, the likely hung ones; job-level when no rank can be told apart."
    )
    dashboard = "rank_health"
    judges_silence = True  # steps the intake dropped are not missing steps
    knock_on_of = ("rank_silent",)  # a silent rank's peers wait for it: its fault, not a second one
    uses = ("silent_after_s",)

    class Thresholds(Check.Thresholds):
        stall_after_s: float = Field(2.5, gt=0, description="Seconds without any rank completing a step after which training has stalled (at least; see stall_steps), while some rank waits in all-reduce or is silent.")
        stall_steps: float = Field(3.0, ge=0, description="Median step times without any rank completing a step after which training has stalled, when longer than stall_after_s (slow steps are not stalls).")
        stall_outside_after_s: float = Field(30.0, gt=0, description="Seconds without a completed step after which training has stalled when no rank waits in all-reduce (evaluation, checkpointing and data loading pause outside collectives).")

    metrics = {
        "job_step_age_seconds": (
            "Seconds since any rank of the job (that has not said goodbye) last reported a completed step.",
            (), "seconds",
        ),
    }

    #: recent step times per job the median is taken over (reports of every rank)
    WINDOW = 64
    #: share of a heartbeat interval a training thread ran or waited for a CPU above which it is busy
    RUNNABLE = 0.5
    #: seconds by which a rank's time in its step (its heartbeat's ``in_step_s`` plus the heartbeat's
    #: age) must fall short of the stall for the rank to have completed a step not yet reported
    PROGRESS_S = 1.0
    #: seconds without any message from the job (every agent sends something at least every second) after which the
    #: aggregator was blind to it and the stall clock starts over
    DARK_S = 2.0
    #: ranks a job-wide finding lists (``details["ranks"]``); ``details["count"]`` counts them all
    LISTED = 16

    per_job = _Stall

    def on_steps(self, job, views):
        times = self.state(job.job).times
        for v in views:
            times.extend(v.step_time[v.step_time > 0].tolist())  # NaN (not measured) fails this too
        return None

    def bound(self, job_id: str) -> float:
        """Seconds without a completed step after which the job has stalled (some rank waiting)."""
        st = self.kept(job_id)
        times = st.times if st is not None else None
        median = statistics.median(times) if times else 0.0
        return max(self.t.stall_after_s, self.t.stall_steps * median)

    def on_tick(self, job, now):
        st = self.state(job.job)
        c = job.columns()
        open_ = ~c.closing
        if not open_.any():
            st.idle = None
            return Evaluation.healthy() if job.ranks else Evaluation.no_data()  # all said goodbye
        reported = open_ & (c.steps > 0)
        last = float(c.last_report_at[reported].max()) if reported.any() else None
        heard_at = float(c.last_seen[open_].max())
        if heard_at - (st.heard if st.heard is not None else heard_at) > self.DARK_S:
            st.since = heard_at
        st.heard = heard_at
        if last is None or now - heard_at > self.DARK_S:
            return Evaluation.no_data()
        idle = st.idle = now - max(last, st.since if st.since is not None else last)
        bound = self.bound(job.job)
        if idle < bound:
            st.named = None
            return Evaluation.healthy()
        live = [r for r in job.in_order() if not r.closing]
        heard = [r for r in live if now - r.last_seen <= self.t.silent_after_s]
        if not heard:
            return Evaluation.no_data()  # everyone is silent: the job died, not stalled (rank_silent)
        silent = [r for r in live if r not in heard]
        # a rank in its step for less time than nothing was reported completed a step since: its
        # report is on its way (coalesced, or behind its heartbeat), and it is not hung. At the end
        # of a hang the peers have moved on before the aggregator hears of the step that freed them
        # (0: an agent that does not say)
        moved = {r.rank for r in heard if 0 < r.in_step_s and r.in_step_s + (now - r.last_seen) < idle - self.PROGRESS_S}
        waiting = [r for r in heard if r.waiting]
        busy = [r for r in heard if not r.waiting and r.rank not in moved]
        if moved and not busy and not silent:
            return Evaluation.healthy()  # the job moved on: the step that ended the stall is on its way
        outside = idle >= max(bound, self.t.stall_outside_after_s)
        if not waiting and not silent and not outside:
            return Evaluation.healthy()  # a pause outside collectives: evaluation, a checkpoint
        running = [r for r in busy if r.runnable >= self.RUNNABLE]  # slow or starved, not blocked
        if waiting and not silent and busy and len(running) == len(busy) and not outside:
            return Evaluation.healthy()  # its peers wait for a rank that is still computing
        if not outside:
            busy = [r for r in busy if r not in running]
        step = max(r.step for r in live)
        details = {
            "stalled_s": idle, "bound_s": bound, "last_step": step,
            "waiting": [r.rank for r in waiting], "not_waiting": [r.rank for r in busy],
            "silent": [r.rank for r in silent],
            "in_step_s": {str(r.rank): r.in_step_s for r in heard},
            "runnable": {str(r.rank): r.runnable for r in heard},
        }
        head = f"training stalled: no rank completed a step for {idle:.0f} s (last step {step})"
        if waiting and (busy or silent):
            findings = [
                Finding(
                    self.name, job.job, step,
                    f"{head}; rank {r.rank} is not waiting in all-reduce while rank(s) {_ranks(waiting)} "
                    f"wait there: likely hung (in its step for {r.in_step_s:.0f} s)",
                    rank=r.rank, details={**details, "reason": "not_waiting"},
                )
                for r in busy
            ] + [
                Finding(
                    self.name, job.job, step,
                    f"{head}; rank {r.rank} is silent while rank(s) {_ranks(waiting)} wait in all-reduce",
                    rank=r.rank, details={**details, "reason": "silent"},
                )
                for r in silent
            ]
            findings = sorted(findings, key=lambda f: f.rank)
            if len(findings) >= max(2, -(-len(job.ranks) // 2)):  # half of the job's ranks: one event
                ranks = [f.rank for f in findings]
                findings = [Finding(
                    self.name, job.job, step,
                    f"{head}; {len(ranks)} of {len(job.ranks)} ranks are not waiting in all-reduce or are silent while "
                    f"rank(s) {_ranks(waiting[:3])}{', ...' if len(waiting) > 3 else ''} wait there",
                    details={"stalled_s": idle, "bound_s": bound, "last_step": step, "reason": "job_wide",
                             "count": len(ranks), "ranks": ranks[: self.LISTED],
                             # each list and map bounded: a job of 16,384 ranks gives one finding of a few kB
                             "waiting": [r.rank for r in waiting][: self.LISTED],
                             "not_waiting": [r.rank for r in busy][: self.LISTED],
                             "silent": [r.rank for r in silent][: self.LISTED],
                             "in_step_s": {str(k): details["in_step_s"][str(k)] for k in ranks[: self.LISTED]
                                           if str(k) in details["in_step_s"]}},
                )]
            st.named = (step, tuple(findings))
            return Evaluation.found(*findings)
        named = st.named
        if named is not None and named[0] == step:
            # the stall whose rank was named goes on at the same step with every rank waiting: the
            # hung rank woke and joined the all-reduce that the others wait in (one fault, one
            # finding: it stays the named rank's until a step completes)
            return Evaluation.found(*named[1])
        why = (
            "every heard rank waits in all-reduce (a deadlock in the collective or the network)" if waiting
            else "no rank waits in all-reduce (stuck in data loading, checkpointing or the host)"
        )
        return Evaluation.found(Finding(self.name, job.job, step, f"{head}; {why}", details=details))

    def values(self, job_id):
        st = self.kept(job_id)
        return {"job_step_age_seconds": {(): st.idle}} if st is not None and st.idle is not None else {}
