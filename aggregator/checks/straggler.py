"""Stragglers: a rank whose own work per step is persistently slower than its peers'.

In synchronous data parallelism every rank waits for the slowest one in each all-reduce, so one
slow rank (a throttled or faulty device, a noisy neighbour, a slow input pipeline on one host)
slows the whole job while every rank's *step* time looks the same. This check therefore times
what each rank does on its own: ``Report.compute_time``, from the end of its previous optimizer
step until its first gradient bucket is handed to all-reduce — forward, most of backward and data
loading, but no waiting for peers. Ranks whose agent cannot measure it (no DDP communication hook;
NaN) are timed by their step time instead. Step 0 (start-up) is left out.

Scores follow NVIDIA's resiliency extension (nvidia-resiliency-ext, straggler detection), with
every rank's times in windows of ``straggler_window`` steps summarised by their median and no
collective needed (the aggregator sees every rank):

* relative score = the fastest rank's current window median / this rank's current window median,
  in (0, 1], 1 for the fastest rank;
* individual score = this rank's best (smallest) window median so far / its current one, in
  (0, 1], below 1 when the rank got slower than it used to be.

A rank straggles when its relative score is below ``straggler_score`` and its median exceeds the
fastest rank's by at least ``straggler_min_s`` (so scheduler jitter on very short steps is not a
straggler) for ``straggler_windows`` consecutive windows of its own: one slow window (a checkpoint,
a garbage collection) is not enough. The finding resolves at its first window back in line. The
individual score is exported only: when every rank slows down together the job got slower (input
pipeline, thermal limits), which is not a straggler. Fewer than two ranks with a complete window:
no data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from pydantic import Field

from . import Check, Evaluation, Finding, register


@dataclass
class _Times:
    boot: str
    buf: list = field(default_factory=list)
    current: float = math.nan  # median of the latest complete window, seconds
    best: float = math.nan  # smallest window median so far, seconds
    windows: int = 0
    below: int = 0  # consecutive windows straggling
    source: str = "compute_time"
    step: int = -1  # last step of the latest complete window


@register
class Straggler(Check):
    name = "straggler"
    severity = "warning"
    description = (
        "Times each rank's own work per step (compute time: until its first gradient bucket is ready, "
        "without waiting for peers) in windows of straggler_window steps; scores each rank's window "
        "median against the fastest rank's (relative) and its own best (individual), as NVIDIA's "
        "resiliency extension does, with no collective. Names a rank whose relative score stays below "
        "straggler_score for straggler_windows windows."
    )
    dashboard = "rank_health"

    class Thresholds(Check.Thresholds):
        straggler_score: float = Field(0.7, gt=0, lt=1, description="Straggler score (0-1, 1 = as fast as the reference) below which a rank straggles.")
        straggler_window: int = Field(16, ge=2, description="Steps per window of the straggler medians.")
        straggler_windows: int = Field(2, ge=1, description="Consecutive windows a rank must straggle before it is named.")
        straggler_min_s: float = Field(0.01, ge=0, description="Seconds per step by which a rank's median must exceed the fastest rank's before it can straggle, so scheduling jitter on very short steps is not named.")

    metrics = {
        "rank_straggler_relative_score": (
            "Fastest rank's median compute time per step over the latest window divided by this rank's "
            "(0-1, 1 = as fast as the fastest rank).", ("rank",), "",
        ),
        "rank_straggler_individual_score": (
            "The rank's best window median compute time per step divided by its latest (0-1, 1 = as fast "
            "as it has ever been).", ("rank",), "",
        ),
    }

    def __init__(self, t):
        super().__init__(t)
        self._jobs: dict[str, dict[int, _Times]] = {}

    def on_report(self, job, rank, m):
        if m.step <= 0:
            return None
        ranks = self._jobs.setdefault(job.job, {})
        t = ranks.get(rank.rank)
        if t is None or t.boot != rank.boot:  # a restarted rank starts over
            t = ranks[rank.rank] = _Times(rank.boot)
        if math.isfinite(m.compute_time) and m.compute_time >= 0:
            x, t.source = m.compute_time, "compute_time"
        elif math.isfinite(m.step_time) and m.step_time >= 0:
            x, t.source = m.step_time, "step_time"
        else:
            return None
        t.buf.append(x)
        if len(t.buf) < self.t.straggler_window:
            return None
        t.current = float(np.median(t.buf))
        if math.isnan(t.best) or t.current < t.best:
            t.best = t.current
        t.windows += 1
        t.step = m.step
        t.buf.clear()
        return self._evaluate(job, done=rank.rank)

    def _live(self, job) -> dict[int, _Times]:
        ranks = self._jobs.get(job.job, {})
        for k in [k for k in ranks if k not in job.ranks]:
            del ranks[k]
        return {k: t for k, t in ranks.items() if t.windows and not job.ranks[k].closing}

    def _evaluate(self, job, done: int):
        live = self._live(job)
        if len(live) < 2:
            return Evaluation.no_data()
        fastest_rank = min(live, key=lambda k: live[k].current)
        fastest = live[fastest_rank].current
        t = live.get(done)
        if t is not None:
            slow = (fastest / t.current < self.t.straggler_score if t.current > 0 else False) and (
                t.current - fastest >= self.t.straggler_min_s
            )
            t.below = t.below + 1 if slow else 0
        findings = []
        for k, t in sorted(live.items()):
            if t.below < self.t.straggler_windows:
                continue
            rel = fastest / t.current
            findings.append(Finding(
                self.name, job.job, t.step,
                f"rank {k} straggles: its median {t.source.replace('_', ' ')} per step is {t.current * 1e3:.1f} ms "
                f"against {fastest * 1e3:.1f} ms on the fastest rank ({fastest_rank}), relative score "
                f"{rel:.2f} for {t.below} windows of {self.t.straggler_window} steps (step {t.step})",
                rank=k,
                details={
                    "relative_score": rel, "individual_score": t.best / t.current, "median_s": t.current,
                    "fastest_median_s": fastest, "fastest_rank": fastest_rank, "best_median_s": t.best,
                    "windows": t.below, "source": t.source,
                    "medians_s": {str(r): x.current for r, x in sorted(live.items())},
                },
            ))
        return Evaluation.found(*findings)

    def values(self, job_id):
        ranks = {k: t for k, t in self._jobs.get(job_id, {}).items() if t.windows and t.current > 0}
        if not ranks:
            return {}
        fastest = min(t.current for t in ranks.values())
        return {
            "rank_straggler_relative_score": {(str(k),): fastest / t.current for k, t in ranks.items()},
            "rank_straggler_individual_score": {(str(k),): t.best / t.current for k, t in ranks.items()},
        }

    def forget(self, job_id):
        self._jobs.pop(job_id, None)
