"""Stragglers: a rank whose own work per step is persistently slower than its peers'.

In synchronous data parallelism every rank waits for the slowest one in each all-reduce, so one
slow rank (a throttled or faulty device, a noisy neighbour, a slow input pipeline on one host)
slows the whole job while every rank's *step* time looks the same. This check therefore times
what each rank does on its own: ``Report.compute_time``, from the end of its previous optimizer
step until its first gradient bucket is handed to all-reduce — forward, most of backward and data
loading, but no waiting for peers. At a step where some reporting rank's agent cannot measure it
(no DDP communication hook; NaN) the ranks are compared by their step times instead. Step 0
(start-up) is left out.

Scores follow NVIDIA's resiliency extension (nvidia-resiliency-ext, straggler detection), with no
collective needed (the aggregator sees every rank), but every comparison is made *within a step*:
a step is judged once every rank has reported it (see :mod:`._steps`), each rank's time against
the fastest rank's time at that same step. Load that slows every rank together for a while (a busy
host, a garbage collection in every process) thus cancels out, where comparing windows that close
at different moments would not. Per rank, over windows of ``straggler_window`` of its judged steps:

* relative score = median over the window's steps of (fastest rank's time at the step / this
  rank's), in (0, 1], 1 for a rank that is the fastest at most steps;
* excess = median over the window's steps of (this rank's time - the median of the other ranks'
  times at the step), seconds: against the typical peer, not the luckiest one;
* individual score = this rank's best (smallest) window median time so far / its current one, in
  (0, 1], below 1 when the rank got slower than it used to be.

A step is slow for a rank when both margins hold at that step: its ratio to the fastest rank is
below ``straggler_score`` *and* it exceeds the other ranks' median by at least ``straggler_min_s``
(so scheduler jitter on very short steps is not a straggler). A window is slow when more than half
of its steps are: a rank descheduled for a few steps on a loaded machine does not make a slow
window, while a rank that is slower at every step does. A rank straggles after
``straggler_windows`` consecutive slow windows: one slow window (a checkpoint) is not enough. The finding resolves at its
first window back in line. The individual score is exported only: when every rank slows down
together the job got slower (input pipeline, thermal limits), which is not a straggler. Fewer than
two ranks with a complete window: no data; fewer than two that have not said goodbye: healthy (the
job is ending).

Under pipeline parallelism a rank is compared only with the ranks of its own stage (its peers,
:func:`~..shards.part`): stages legitimately differ in work (embedding or loss layers, uneven
splits) and in what the compute time includes (a DDP stage's first gradient bucket is ready only
once the later stages' backward has reached it, so the first stage's "own work" includes the
pipeline's bubble), while the ranks of one stage run the same layers on their own micro-batches.
A stage of one rank has no peer and is not judged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from pydantic import Field

from . import Check, Evaluation, Finding, register
from ..shards import part_of
from ._steps import Steps


@dataclass
class _Rank:
    boot: str
    times: list = field(default_factory=list)  # this window: own times, seconds
    ratios: list = field(default_factory=list)  # this window: fastest time at the step / own
    excess: list = field(default_factory=list)  # this window: own time - peers' median at the step, seconds
    slow: list = field(default_factory=list)  # this window: whether the step was slow (both margins)
    current: float = math.nan  # median own time over the latest complete window, seconds
    best: float = math.nan  # smallest window median so far, seconds
    relative: float = math.nan  # relative score of the latest complete window
    excess_s: float = math.nan  # excess of the latest complete window, seconds
    windows: int = 0
    below: int = 0  # consecutive slow windows
    source: str = "compute_time"
    step: int = -1  # last step of the latest complete window


@dataclass
class _Job:
    steps: Steps
    ranks: dict = field(default_factory=dict)  # rank -> _Rank


def _times(reports: dict) -> tuple[str, dict[int, float]]:
    """The step's times to compare: compute times when every reporting rank has one, else step times."""
    for source in ("compute_time", "step_time"):
        times = {k: getattr(r, source) for k, r in reports.items()}
        if all(math.isfinite(x) and x >= 0 for x in times.values()):
            return source, times
    return "", {}


def _peer_medians(times: list[float]) -> list[float]:
    """For each value, the median of all the others (float64, as ``np.median`` of them gives it).

    One sort instead of a median per rank (quadratic: 16,384 ranks made 268M element visits per
    step): removing the value at sorted position ``i`` shifts every later one down by one, so the
    others' middle element(s) are found by index arithmetic."""
    v = np.asarray(times, np.float64)
    n = len(v)
    order = np.argsort(v, kind="stable")
    s = v[order]
    pos = np.empty(n, np.int64)
    pos[order] = np.arange(n)  # sorted position of each value

    def others(j):  # the j-th smallest of the others, for every value at once
        return s[j + (j >= pos)]

    m = n - 1
    if m % 2:
        med = others(np.full(n, m // 2))
    else:  # np.median averages the two middle values as np.mean does: (a + b) / 2
        med = (others(np.full(n, m // 2 - 1)) + others(np.full(n, m // 2))) / 2
    return med.tolist()


@register
class Straggler(Check):
    name = "straggler"
    severity = "warning"
    description = (
        "Times each rank's own work per step (compute time: until its first gradient bucket is ready, "
        "without waiting for peers) against the fastest rank's at the same step, so load slowing every rank "
        "cancels out. A step is slow when the rank's ratio to the fastest (relative score, as NVIDIA's "
        "resiliency extension scores, with no collective) is below straggler_score and it exceeds its peers' "
        "median by straggler_min_s; a window of straggler_window steps is slow when most of its steps are. "
        "Names a rank after straggler_windows consecutive slow windows."
    )
    dashboard = "rank_health"

    class Thresholds(Check.Thresholds):
        straggler_score: float = Field(0.7, gt=0, lt=1, description="Relative straggler score (0-1, 1 = as fast as the fastest rank at the same step) below which a rank's step is slow.")
        straggler_window: int = Field(16, ge=2, description="Judged steps per window of the straggler medians.")
        straggler_windows: int = Field(3, ge=1, description="Consecutive slow windows (most of their steps slow) before a rank is named as a straggler.")
        straggler_min_s: float = Field(0.01, ge=0, description="Seconds by which a rank must exceed the median of its peers at the same step for the step to be slow, so scheduling jitter on very short steps is not named.")

    metrics = {
        "rank_straggler_relative_score": (
            "Median over the latest window's steps of the fastest rank's compute time at the step divided by "
            "this rank's (0-1, 1 = as fast as the fastest rank).", ("rank",), "",
        ),
        "rank_straggler_individual_score": (
            "The rank's best window median compute time per step divided by its latest (0-1, 1 = as fast "
            "as it has ever been).", ("rank",), "",
        ),
    }

    def __init__(self, t):
        super().__init__(t)
        self._jobs: dict[str, _Job] = {}
        self._values: dict[str, dict] = {}  # values() per job until a window closes: read at every publish

    def on_report(self, job, rank, m):
        if m.step <= 0:
            return None
        st = self._jobs.get(job.job)
        if st is None or st.steps.world != job.world:
            st = self._jobs[job.job] = _Job(Steps(job.world))
            self._values.pop(job.job, None)
        r = st.ranks.get(rank.rank)
        if r is None or r.boot != rank.boot:  # a restarted rank starts over
            st.ranks[rank.rank] = _Rank(rank.boot)
            self._values.pop(job.job, None)
        return self._judge(job, st, st.steps.add(rank.rank, m))

    def on_tick(self, job, now):
        st = self._jobs.get(job.job)
        return None if st is None else self._judge(job, st, st.steps.tick(now))

    def _judge(self, job, st: _Job, released):
        if not released:
            return None
        closed = False
        for step, reports in released:
            reports = {k: m for k, m in reports.items() if k in st.ranks and m.header.boot == st.ranks[k].boot}
            source, times = _times(reports)
            for k, x, fastest, peer in self._peers(job, times):
                r = st.ranks[k]
                ratio = fastest / x if x > 0 else 1.0
                excess = x - peer
                r.times.append(x)
                r.ratios.append(ratio)
                r.excess.append(excess)
                r.slow.append(ratio < self.t.straggler_score and excess >= self.t.straggler_min_s)
                if len(r.times) >= self.t.straggler_window:
                    self._close(r, step, source)
                    closed = True
        if closed:
            self._values.pop(job.job, None)
            return self._evaluate(job, st)
        return Evaluation.no_data() if len(self._timed(job, st)) < 2 else None

    @staticmethod
    def _peers(job, times: dict[int, float]):
        """``(rank, time, fastest peer's time, median of the other peers' times)`` of every rank
        with at least one peer at the step (peers: the same :func:`~..shards.part_of`)."""
        groups: dict = {}
        for k, x in times.items():
            groups.setdefault(part_of(job, k), {})[k] = x
        for g in groups.values():
            if len(g) < 2:
                continue
            fastest = min(g.values())
            yield from ((k, x, fastest, peer) for (k, x), peer in zip(g.items(), _peer_medians(list(g.values()))))

    def _close(self, r: _Rank, step: int, source: str) -> None:
        r.current = float(np.median(r.times))
        r.relative = float(np.median(r.ratios))
        r.excess_s = float(np.median(r.excess))
        if math.isnan(r.best) or r.current < r.best:
            r.best = r.current
        r.windows += 1
        r.step, r.source = step, source
        r.below = r.below + 1 if 2 * sum(r.slow) > len(r.slow) else 0
        for buf in (r.times, r.ratios, r.excess, r.slow):
            buf.clear()

    def _timed(self, job, st: _Job) -> dict[int, _Rank]:
        """Ranks of the job with a complete window (forgotten ranks dropped)."""
        for k in [k for k in st.ranks if k not in job.ranks]:
            del st.ranks[k]
            self._values.pop(job.job, None)
        return {k: r for k, r in st.ranks.items() if r.windows}

    def _evaluate(self, job, st: _Job):
        timed = self._timed(job, st)
        if len(timed) < 2:
            return Evaluation.no_data()
        live = {k: r for k, r in timed.items() if not job.ranks[k].closing}
        if len(live) < 2:  # the job is ending: goodbyes arrive while the last reports are in flight
            return Evaluation.healthy()
        fastest_rank = min(live, key=lambda k: (live[k].current, k))
        fastest = live[fastest_rank].current
        findings = []
        for k, r in sorted(live.items()):
            if r.below < self.t.straggler_windows:
                continue
            findings.append(Finding(
                self.name, job.job, r.step,
                f"rank {k} straggles: its {r.source.replace('_', ' ')} per step exceeds its peers' at the same step "
                f"by {r.excess_s * 1e3:.1f} ms (median; {r.current * 1e3:.1f} ms against {fastest * 1e3:.1f} ms on the "
                f"fastest rank, {fastest_rank}), relative score {r.relative:.2f} for {r.below} windows of "
                f"{self.t.straggler_window} steps (step {r.step})",
                rank=k,
                details={
                    "relative_score": r.relative, "individual_score": r.best / r.current, "median_s": r.current,
                    "excess_s": r.excess_s, "fastest_median_s": fastest, "fastest_rank": fastest_rank,
                    "best_median_s": r.best, "windows": r.below, "source": r.source,
                    "medians_s": {str(q): x.current for q, x in sorted(live.items())},
                },
            ))
        return Evaluation.found(*findings)

    def values(self, job_id):
        v = self._values.get(job_id)
        if v is None:
            v = self._values[job_id] = self._compute_values(job_id)
        return v

    def _compute_values(self, job_id):
        st = self._jobs.get(job_id)
        ranks = {k: r for k, r in (st.ranks.items() if st else ()) if r.windows and r.current > 0}
        if not ranks:
            return {}
        return {
            "rank_straggler_relative_score": {(str(k),): r.relative for k, r in ranks.items()},
            "rank_straggler_individual_score": {(str(k),): r.best / r.current for k, r in ranks.items()},
        }

    def forget(self, job_id):
        self._jobs.pop(job_id, None)
        self._values.pop(job_id, None)
