"""Step skew: the ranks of one job are at steps too far apart.

Synchronous data parallelism keeps ranks within a step of each other (each all-reduce waits for
all of them), so a growing gap between the most and the least advanced rank means ranks no longer
train together: a rank restarted from an older checkpoint, ranks that belong to different
incarnations of the job, collectives that were skipped on some ranks, or pipeline stages drifting
apart. The check compares the latest step each rank reported, over ranks that have not said
goodbye and were heard within ``silent_after_s`` (a silent rank's stale step is ``rank_silent``'s
business), and names the most-behind rank (the lowest rank number among ties) when the gap has
exceeded ``skew_steps`` for ``skew_for_s``: reports of fast steps arrive in batches, so for a moment
one rank's latest *reported* step can trail another's by many steps while training is in lockstep.
Fewer than two such ranks with a step: no data.

While the aggregator's intake drops this job's frames (overload), and for ``silent_after_s`` after,
this check names nobody new: what the aggregator missed is not the ranks' doing.
"""

from __future__ import annotations

import numpy as np
from dataclasses import dataclass
from typing import Optional

from pydantic import Field

from . import Check, Evaluation, Finding, register


@dataclass
class _Skew:
    skew: Optional[int] = None  # the latest skew, None while fewer than two live ranks have a step
    since: Optional[float] = None  # when the gap last went over skew_steps (None: it is within)


@register
class StepSkew(Check):
    name = "step_skew"
    severity = "warning"
    description = (
        "Names the most-behind rank when the latest steps of a job's live ranks differ by more than "
        "skew_steps for skew_for_s (a rank restarted from an older checkpoint, skipped collectives, ranks of "
        "different job incarnations)."
    )
    dashboard = "rank_health"
    judges_silence = True  # a rank may only look behind while its reports are dropped
    uses = ("silent_after_s",)

    class Thresholds(Check.Thresholds):
        skew_steps: int = Field(5, ge=1, description="Steps between the most and least advanced rank beyond which ranks are skewed.")
        skew_for_s: float = Field(10.0, ge=0, description="Seconds the step skew must last before a rank is named (reports of fast steps arrive in batches).")

    metrics = {
        "job_step_skew": ("Latest step of the most advanced live rank minus that of the least advanced.", (), ""),
    }

    per_job = _Skew

    def on_tick(self, job, now):
        st = self.state(job.job)
        c = job.columns()
        live = np.flatnonzero(~c.closing & (c.step >= 0) & (now - c.last_seen <= self.t.silent_after_s))
        if len(live) < 2:
            st.skew = None
            return Evaluation.no_data()
        order = job.in_order()
        # the lowest rank among the least and among the most advanced (argmin/argmax take the first)
        behind, ahead = order[live[np.argmin(c.step[live])]], order[live[np.argmax(c.step[live])]]
        skew = st.skew = ahead.step - behind.step
        if skew <= self.t.skew_steps:
            st.since = None
            return Evaluation.healthy()
        if st.since is None:
            st.since = now
        if now - st.since < self.t.skew_for_s:
            return None  # not yet held long enough to tell from reporting jitter
        live = [order[i] for i in live.tolist()]
        lagging = [r.rank for r in live if ahead.step - r.step > self.t.skew_steps]
        return Evaluation.found(Finding(
            self.name, job.job, behind.step,
            f"rank {behind.rank} is {skew} steps behind rank {ahead.rank} (step {behind.step} against "
            f"{ahead.step}; more than {self.t.skew_steps} apart)",
            rank=behind.rank,
            details={"skew": skew, "ahead_rank": ahead.rank, "lagging": lagging,
                     "steps": {str(r.rank): r.step for r in live}},
        ))

    def values(self, job_id):
        st = self.kept(job_id)
        return {"job_step_skew": {(): st.skew}} if st is not None and st.skew is not None else {}
