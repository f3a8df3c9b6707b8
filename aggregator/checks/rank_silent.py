"""Silent rank: a rank the aggregator stopped hearing from without a goodbye.

Every agent sends a heartbeat each ``heartbeat_s`` (1 s by default) from its own thread, even while
its training thread is stuck, and says goodbye (a heartbeat with ``closing``) when it shuts down
normally. A rank that has sent nothing at all for ``silent_after_s`` seconds and did not say
goodbye has died (killed by the OOM killer or a signal, a crashed host), lost its network, or
hangs with its agent in the same interpreter lock. Its peers typically wait for it in their next
collective: see ``training_stalled``. The finding names the rank and resolves when it is heard
again (a restarted rank is heard under a new boot id) or is forgotten after ``rank_ttl_s``.
"""

from __future__ import annotations

from pydantic import Field

from . import Check, Evaluation, Finding, register


@register
class RankSilent(Check):
    name = "rank_silent"
    severity = "critical"
    description = (
        "Names a rank that has sent no message (not even a heartbeat, which the agent sends from its "
        "own thread every second) for silent_after_s seconds without saying goodbye: the process died, "
        "its host or network failed, or it hangs holding the interpreter lock."
    )
    dashboard = "rank_health"

    class Thresholds(Check.Thresholds):
        silent_after_s: float = Field(15.0, gt=0, description="Seconds without any message after which a rank is silent.")

    def on_tick(self, job, now):
        if not job.ranks:
            return Evaluation.no_data()
        findings = []
        for k, r in sorted(job.ranks.items()):
            age = now - r.last_seen
            if r.closing or age <= self.t.silent_after_s:
                continue
            findings.append(Finding(
                self.name, job.job, r.step,
                f"rank {k} has been silent for {age:.0f} s (no heartbeat, no report; last step {r.step}) "
                f"and did not say goodbye",
                rank=k,
                details={"silent_s": age, "last_step": r.step, "host": r.host, "local_rank": r.local_rank},
            ))
        return Evaluation.found(*findings)
