"""Silent rank: a rank the aggregator stopped hearing from without a goodbye.

Every agent sends a heartbeat each ``heartbeat_s`` (1 s by default) from its own thread, even while
its training thread is stuck, and says goodbye (a heartbeat with ``closing``) when it shuts down
normally. A rank that has sent nothing at all for ``silent_after_s`` seconds and did not say
goodbye has died (killed by the OOM killer or a signal, a crashed host), lost its network, or
hangs with its agent in the same interpreter lock. Its peers typically wait for it in their next
collective: see ``training_stalled``. The finding names the rank and resolves when it is heard
again (a restarted rank is heard under a new boot id) or is forgotten after ``rank_ttl_s``.

A goodbye is believed only while the job ends with it: a rank whose agent said goodbye (closed,
switched off after repeated errors, ...: the heartbeat's ``reason``) while the steps of its peers
that are still heard pass its last step by more than ``skew_steps`` is named too. Its training
goes on without monitoring, which is as blind as a silent rank.

While the aggregator's intake is dropping this job's frames (overload: counted as
``gradwatch_messages_rejected_total{reason="overload"}``), and for ``silent_after_s`` after, silence
may be the aggregator's own: nothing new is named then (what was named stays named). A job that
ends in an overload (the end of a 16,384-rank job is one burst of final reports and goodbyes, some
dropped) is not made silent by its lost goodbyes: when some of its ranks said goodbye within
``silent_after_s`` of the job's latest drop, a rank last heard within ``silent_after_s`` before
that drop, or after it, is not named (one silent since earlier still is, and stays named).

A job-wide silence is one finding. When at least half of the job's ranks, and at least 2, fall
silent within ``job_wide_window_s`` of each other (a crash, the job killed without goodbyes, a
partition), the check raises one job-level finding (no rank) whose details give their ``count``
and the first :data:`RankSilent.LISTED` of them (``ranks``, sorted), and names none of them on its
own; a rank silent since before (a fault of its own) is still named. Ranks go silent over about a
heartbeat, so while such a group has fallen quiet (past half of ``silent_after_s``) but fewer than
half of the ranks are silent yet, the check waits, for ``silent_after_s`` at most, instead of
naming the first ones. A rank heard again leaves the group; the finding resolves once fewer than
half are left (the rest are then named each).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
from pydantic import Field

from . import Check, Evaluation, Finding, register


@dataclass
class _Silence:
    hold: Optional[float] = None  # since when a group that fell quiet together is waited for


@register
class RankSilent(Check):
    name = "rank_silent"
    severity = "critical"
    description = (
        "Names a rank that has sent no message (not even a heartbeat, which the agent sends from its "
        "own thread after a second without other messages) for silent_after_s seconds without saying goodbye: the process died, "
        "its host or network failed, or it hangs holding the interpreter lock. Also a rank whose agent said "
        "goodbye (closed, disabled after errors) while its live peers' steps pass its own by more than skew_steps."
    )
    dashboard = "rank_health"
    judges_silence = True  # a rank unheard while the intake drops frames may have spoken
    uses = ("skew_steps",)  # a stopped agent is left behind by the same margin as a skewed rank

    class Thresholds(Check.Thresholds):
        silent_after_s: float = Field(2.5, gt=0, description="Seconds without any message after which a rank is silent; keep it above the agents' heartbeat_s (1 s) plus scheduling delays.")
        job_wide_window_s: float = Field(30.0, gt=0, description="Seconds within which at least half of a job's ranks (and at least 2) falling silent are one job-wide event: one job-level finding with their count and the first 16 ranks, instead of one finding per rank.")

    #: ranks a job-wide finding lists (``details["ranks"]``); ``details["count"]`` counts them all
    LISTED = 16

    per_job = _Silence

    def _job_wide(self, job_id: str, c, silent: np.ndarray, now: float, unsure_from: float):
        """The ranks (a mask over ``c``) of a job-wide silence (module docstring), None when there
        is none, or ``False`` while a group falling quiet together is waited for."""
        st = self.state(job_id)
        n = len(c.closing)
        need = max(2, math.ceil(n / 2))
        quiet = ~c.closing & (now - c.last_seen > self.t.silent_after_s / 2) & (c.last_seen < unsure_from)
        if quiet.sum() >= need:
            # the largest group of quiet ranks last heard within job_wide_window_s of each other
            t = np.sort(c.last_seen[quiet])
            ends = np.searchsorted(t, t + self.t.job_wide_window_s, side="right")
            first = int(np.argmax(ends - np.arange(len(t))))
            group = quiet & (c.last_seen >= t[first]) & (c.last_seen <= t[first] + self.t.job_wide_window_s)
            if group.sum() >= need:
                if (group & silent).sum() >= need:
                    st.hold = None
                    return group & silent
                if st.hold is None:
                    st.hold = now
                if now - st.hold < self.t.silent_after_s:
                    return False
                return None
        st.hold = None
        return None

    def on_tick(self, job, now):
        if not job.ranks:
            return Evaluation.no_data()
        findings = []
        c = job.columns()
        heard = now - c.last_seen <= self.t.silent_after_s
        live = c.step[~c.closing & heard]
        lead = int(live.max()) if len(live) else -1
        # the job ended while the intake dropped its frames: a rank whose last message came shortly
        # before a drop, or after, may have said goodbye unheard
        ended = job.ended_in_overload(self.t.silent_after_s)
        unsure_from = ended - self.t.silent_after_s if ended is not None else float("inf")
        silent = ~c.closing & ~heard & (c.last_seen < unsure_from)
        wide = self._job_wide(job.job, c, silent, now, unsure_from)
        if wide is False:
            return None  # a group going silent together: named as one once half of the ranks are
        order = job.in_order()
        if wide is not None:
            ranks = [order[i].rank for i in np.flatnonzero(wide).tolist()]  # ascending, as in_order
            age = float(now - c.last_seen[wide].min())
            steps = c.step[wide]
            findings.append(Finding(
                self.name, job.job, int(steps.max()),
                f"{len(ranks)} of {len(order)} ranks went silent together (for up to {age:.0f} s; ranks "
                f"{', '.join(map(str, ranks[:3]))}{', ...' if len(ranks) > 3 else ''}; last steps {int(steps.min())}-"
                f"{int(steps.max())}) without saying goodbye: the job crashed or was killed, or lost its network",
                details={"count": len(ranks), "ranks": ranks[: self.LISTED], "of": len(order), "silent_s": age,
                         "last_step_min": int(steps.min()), "last_step_max": int(steps.max())},
            ))
            silent = silent & ~wide
        # the ranks the loop below may name: stopped behind their peers, or silent
        maybe = (c.closing & (lead - c.step > self.t.skew_steps)) | silent
        for r in (order[i] for i in np.flatnonzero(maybe).tolist()):
            k = r.rank
            age = now - r.last_seen
            if r.closing and lead - r.step > self.t.skew_steps:
                why = getattr(r, "close_reason", "") or "no reason given"
                findings.append(Finding(
                    self.name, job.job, r.step,
                    f"rank {k}'s agent stopped at step {r.step} ({why}) while its peers went on to step {lead}: "
                    f"the rank trains unmonitored",
                    rank=k,
                    details={"stopped": True, "reason": why, "last_step": r.step, "peers_step": lead,
                             "host": r.host, "local_rank": r.local_rank},
                ))
                continue
            if r.closing or age <= self.t.silent_after_s or r.last_seen >= unsure_from:
                continue
            findings.append(Finding(
                self.name, job.job, r.step,
                f"rank {k} has been silent for {age:.0f} s (no heartbeat, no report; last step {r.step}) "
                f"and did not say goodbye",
                rank=k,
                details={"silent_s": age, "last_step": r.step, "host": r.host, "local_rank": r.local_rank},
            ))
        return Evaluation.found(*findings)
