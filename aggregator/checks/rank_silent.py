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
"""

from __future__ import annotations

import numpy as np
from pydantic import Field

from . import Check, Evaluation, Finding, register


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
        # the ranks the loop below may name: stopped behind their peers, or silent
        maybe = (c.closing & (lead - c.step > self.t.skew_steps)) | (~c.closing & ~heard & (c.last_seen < unsure_from))
        order = job.in_order()
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
