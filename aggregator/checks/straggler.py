"""Stragglers: a rank whose own work per step is persistently slower than its peers'.

In synchronous data parallelism every rank waits for the slowest one in each all-reduce, so one
slow rank (a throttled or faulty device, a noisy neighbour, a slow input pipeline on one host)
slows the whole job while every rank's *step* time looks the same. This check therefore times
what each rank does on its own: ``Report.compute_time``, from the end of its previous optimizer
step until its first gradient bucket is handed to all-reduce — forward, most of backward and data
loading — and, where the agent times it (DDP over gloo: on an accelerator DDP's wait returns
before the device is done), from the end of its backward pass (DDP has waited for the
all-reduce) until its optimizer step ends — gradient clipping, logging, the optimizer — but no waiting for peers; less ``Report.compute_wait``, the part of it the rank's
training thread spent waiting for a CPU (Linux run-queue wait: runnable, not running). That wait
is the host starving the rank (another busy process on its core, more threads than cores), not
the rank's own slowness: on a shared host a rank that shares its core with a busy process is
40-70 % slower in wall time for tens of steps, just like a rank whose device or data is slow, and
only the wait tells the two apart. Its *own time* is thus ``compute_time - compute_wait`` (the
wait clipped to the compute time), and the share excluded is exported per rank
(``rank_straggler_cpu_wait_ratio``) so starvation stays visible. At a step where some reporting
rank's agent cannot measure the wait (NaN: an older agent, no ``/proc``) the ranks' compute times
are compared as they are; where some cannot measure the compute time (no DDP communication hook)
their step times. Step 0 (start-up) is left out.

Every comparison is made *within a step*: a step is judged once every rank has reported it (see
:mod:`..steps`), each rank's time against the median of the other ranks' times at that same step.
Load that slows every rank together for a while (a busy host, a garbage collection in every
process) thus cancels out, where comparing windows that close at different moments would not; and
the peers' median is the typical peer, where the fastest rank (NVIDIA's resiliency extension's
reference, straggler detection) is on a loaded host a lucky outlier that makes every other rank
look slow. Per rank, over windows of ``straggler_window`` of its judged steps, and over the
latest ``straggler_windows`` of its windows pooled (its *span*; fewer windows before it has them):

* relative score = min(1, median over the span's steps of (peers' median time at the step /
  this rank's)), in (0, 1], 1 for a rank no slower than its typical peer (NVIDIA's relative
  score, with the peers' median in place of the fastest rank and no collective needed: the
  aggregator sees every rank);
* excess = median over the span's steps of (this rank's time - the peers' median at the step),
  seconds;
* individual score = this rank's best (smallest) window median time so far / its current one, in
  (0, 1], below 1 when the rank got slower than it used to be.

A rank straggles when, at the close of one of its windows, it has ``straggler_windows`` windows,
its relative score is below ``straggler_score`` *and* its excess at least ``straggler_min_s``
(slower than its typical peer by both margins at most of the span's steps), and all but one of the
span's windows pass the same test on their own steps. Descheduling pauses on a loaded host (a few
steps of any rank, heavy-tailed in length) move neither median, and one long pause fills at most
one window, while a persistent shift moves every window. Pooling the span's steps, rather than
asking each window to be slow on its own, shrinks the median's noise against per-step jitter of
some ten percent by about sqrt(3) (3 x 16 steps against 16), so the threshold can sit between a
clean rank (near 1) and a 30 % straggler (about 0.77 before jitter), 0.85, with a margin of several
standard deviations on either side against jitter. The score's default (0.7) stays conservative:
on CPUs shared with other work a rank that shares its core with a busy process is persistently
slower for tens of steps, in wall time just like a slow device, and 0.85 names it. The absolute
floor (3 ms) keeps systematic differences of a few milliseconds on very short steps (one rank
logging) from counting; it was 10 ms, which hid 30 % stragglers on 15-20 ms steps (excess 5-15 ms,
relative scores 0.5-0.67, already below 0.7) once the fault matrix's ranks stopped differing by
their allocators' page faults (glibc returning and refaulting one rank's activations every step:
up to ~45 % and 6 ms more own time, a real slowdown of the whole job, which this check names). Once named, a rank is back in line only when its span's relative score reaches the
midpoint between ``straggler_score`` and 1 or its excess falls below half the floor (hysteresis: a
rank near the threshold is one finding, not several); the finding then resolves, about half a span
after the rank recovers.

The individual score is exported only: when every rank slows down together the job got slower
(input pipeline, thermal limits), which is not a straggler. Fewer than two ranks with a complete
window: no data; fewer than two that have not said goodbye: healthy (the job is ending).

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
from typing import Optional

import numpy as np
from pydantic import Field

from . import Check, Evaluation, Finding, register


@dataclass
class _Rank:
    boot: str
    current: float = math.nan  # median own time over the latest complete window, seconds
    best: float = math.nan  # smallest window median so far, seconds
    relative: float = math.nan  # relative score over the span
    excess_s: float = math.nan  # excess over the span, seconds
    windows: int = 0
    below: int = 0  # windows in the span when the span is slow, else 0
    source: str = "compute_time"
    step: int = -1  # last step of the latest complete window
    wait_share: float = math.nan  # median CPU-wait share of the compute time over the latest window (NaN: unknown)


class _Windows:
    """Every rank's open window and span of one job, as arrays [world, ...] (one numpy operation
    per step for all ranks, not one per rank).

    Attributes:
        times, ratios, excess, shares: float64 [world, window]: the open window's own times (s),
            peers' median / own, own - peers' median (s), CPU wait / compute time (NaN: unknown);
            the first ``fill[k]`` of row k are set.
        span_ratios, span_excess: float64 [world, windows, window]: the span's closed windows,
            oldest first; the first ``spans[k]`` of row k are set.
    """

    def __init__(self, world: int, window: int, windows: int):
        self.times = np.zeros((world, window))
        self.ratios = np.zeros((world, window))
        self.excess = np.zeros((world, window))
        self.shares = np.zeros((world, window))
        self.fill = np.zeros(world, np.int64)
        self.span_ratios = np.zeros((world, windows, window))
        self.span_excess = np.zeros((world, windows, window))
        self.spans = np.zeros(world, np.int64)

    def reset(self, k: int) -> None:
        self.fill[k] = self.spans[k] = 0


@dataclass
class _Job:
    ranks: dict = field(default_factory=dict)  # rank -> _Rank
    w: Optional[_Windows] = None
    epoch: int = -1  # the job epoch that part and groups are of (JobView.epoch)
    part: Optional[np.ndarray] = None  # int64 [world]: per rank its peer group, -1 for a rank not known
    groups: int = 0
    values: Optional[dict] = None  # values() until a window closes: read at every publish


#: what a rank's own time was, by source (findings say it)
SOURCES = {
    "compute_time_less_wait": "compute time less CPU wait",
    "compute_time": "compute time",
    "step_time": "step time",
}


def _times(v, keep: np.ndarray, exclude_wait: bool = True) -> tuple[str, np.ndarray, np.ndarray, np.ndarray]:
    """The step's times to compare, of the ranks ``keep`` selects in view ``v``: ``(source, ranks
    int64 [n], own seconds float64 [n], CPU-wait share of the compute time float64 [n])``:
    compute times less CPU wait when every one of them has both, compute times as they are when
    every one has one (share NaN; as they are too without ``exclude_wait``, the share still
    measured), else step times (share NaN)."""
    ranks = v.ranks[keep]
    compute = v.compute_time[keep]
    if (np.isfinite(compute) & (compute >= 0)).all():
        wait = v.compute_wait[keep]
        if np.isfinite(wait).all():
            wait = np.clip(wait, 0.0, compute)  # a reading's granularity never makes it more than the interval
            with np.errstate(divide="ignore", invalid="ignore"):
                share = np.where(compute > 0, wait / compute, 0.0)
            if exclude_wait:
                return "compute_time_less_wait", ranks, compute - wait, share
            return "compute_time", ranks, compute, share
        return "compute_time", ranks, compute, np.full(len(ranks), np.nan)
    x = v.step_time[keep]
    if (np.isfinite(x) & (x >= 0)).all():
        return "step_time", ranks, x, np.full(len(ranks), np.nan)
    return "", ranks[:0], np.zeros(0), np.zeros(0)


def _peer_medians(times) -> np.ndarray:
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
    return med


@register
class Straggler(Check):
    name = "straggler"
    severity = "warning"
    description = (
        "Times each rank's own work per step (compute time: until its first gradient bucket is ready, "
        "and, for DDP over gloo, from the end of its backward pass to its optimizer step's end, without waiting for peers, less the time its training thread waited for a CPU: a host starving a "
        "rank is not the rank's slowness) against the median of its peers' at the same step, so load slowing every "
        "rank cancels out. Names a rank when, over its latest straggler_windows windows of straggler_window "
        "steps pooled, the median of the per-step ratios (peers' median / own: the relative score, as NVIDIA's "
        "resiliency extension scores against the fastest rank) is below straggler_score and the median excess "
        "over the peers is at least straggler_min_s, and all but one of those windows are slow on their own; "
        "descheduling pauses of a few steps move neither median."
    )
    dashboard = "rank_health"

    class Thresholds(Check.Thresholds):
        straggler_score: float = Field(0.7, gt=0, lt=1, description="Relative straggler score (0-1: median over the latest straggler_windows windows' steps of the peers' median time at the step / the rank's; 1 = no slower than its typical peer) below which a rank straggles. 0.7 is about 43 % slower; a 30 % straggler scores 0.77 and needs 0.85, which on CPUs shared with other work also names ranks that merely got a smaller CPU share (bench/README.md: Detection figures).")
        straggler_window: int = Field(16, ge=2, description="Judged steps per window of the straggler medians.")
        straggler_windows: int = Field(3, ge=1, description="Windows pooled for the relative score and excess (the span), and the windows a rank needs before it can be named.")
        straggler_exclude_wait: bool = Field(True, description="Leave out of each rank's own time the part its training thread waited for a CPU (the agent's compute_wait, Linux run-queue wait), so a rank that a busy host starves of CPU is not named (gradwatch_rank_straggler_cpu_wait_ratio shows it). False compares wall compute times: for hosts where that wait overlaps work elsewhere, such as a GPU-bound rank whose thread yields while waiting for its device on busy CPUs.")
        straggler_min_s: float = Field(0.003, ge=0, description="Seconds by which a rank's time must exceed its peers' median at the same step (median over the span's steps) for it to straggle, so scheduling jitter and systematic differences on very short steps are not named (0.002 suffices against jitter: the medians ignore pauses; 0.01 would hide 30 % stragglers on 15-20 ms steps: bench/README.md, Detection figures).")

    metrics = {
        "rank_straggler_relative_score": (
            "Median over the latest straggler_windows windows' steps of the median of the other ranks' own times at the step "
            "(compute time less CPU wait) divided by this rank's, capped at 1 (0-1, 1 = no slower than its typical peer).", ("rank",), "",
        ),
        "rank_straggler_individual_score": (
            "The rank's best window median own time per step divided by its latest (0-1, 1 = as fast "
            "as it has ever been).", ("rank",), "",
        ),
        "rank_straggler_cpu_wait_ratio": (
            "Median over the rank's latest window of straggler_window steps of the share of its compute time its "
            "training thread spent waiting for a CPU (Linux run-queue wait, 0-1): the host starving the rank, "
            "which straggler leaves out of its own time. Absent where the agent cannot measure it.", ("rank",), "",
        ),
    }

    per_job = _Job

    def on_steps(self, job, views):
        t = self.t
        st = self.state(job.job)
        if st.w is None or len(st.w.fill) != job.world:
            st = self.reset(job.job)
            st.w = _Windows(job.world, t.straggler_window, t.straggler_windows)
        w = st.w
        # which ranks are known, their boots, their peer groups: walked again only once a rank
        # came, went, restarted or moved (16,384 ranks: ~15 ms a step)
        if st.epoch != job.epoch:
            part = np.full(job.world, -1, np.int64)
            groups: dict = {}
            for k, rank in job.ranks.items():
                r = st.ranks.get(k)
                if r is None or r.boot != rank.boot:  # a restarted rank starts over
                    st.ranks[k] = _Rank(rank.boot)
                    w.reset(k)
                    st.values = None
                part[k] = groups.setdefault(job.part_of(k), len(groups))
            st.epoch, st.part, st.groups = job.epoch, part, len(groups)
        part, n_groups = st.part, st.groups
        evs = []  # after each step that closed windows: one release can name a rank and clear it
        for v in views:
            if v.step <= 0:
                continue  # start-up
            keep = part[v.ranks] >= 0  # ranks the job still knows
            source, ranks, x, share = _times(v, keep, t.straggler_exclude_wait)
            if not len(ranks):
                continue
            closed = False
            gid = part[ranks]
            for g in (0,) if n_groups == 1 else np.unique(gid):  # one group of peers: DDP, FSDP
                sel = slice(None) if n_groups == 1 else gid == g
                ks, xs = ranks[sel], x[sel]
                if len(ks) < 2:
                    continue  # no peer at this step
                peer = _peer_medians(xs)
                i = w.fill[ks]
                w.times[ks, i] = xs
                with np.errstate(divide="ignore", invalid="ignore"):
                    w.ratios[ks, i] = np.where(xs > 0, peer / xs, 1.0)
                w.excess[ks, i] = xs - peer
                w.shares[ks, i] = share[sel]
                w.fill[ks] += 1
                full = ks[w.fill[ks] >= t.straggler_window]
                if len(full):
                    self._close(st, full, v.step, source)
                    closed = True
            if closed:
                evs.append(self._evaluate(job, st))
        if evs:
            st.values = None
            return evs
        return Evaluation.no_data() if len(self._timed(job, st)) < 2 else None

    def _close(self, st: _Job, ks: np.ndarray, step: int, source: str) -> None:
        """Close the full windows of ranks ``ks`` (int64 [n]) at ``step``: their medians, spans and verdicts."""
        t, w = self.t, st.w
        n_win = t.straggler_windows
        current = np.median(w.times[ks], axis=1)
        shares = w.shares[ks]
        known = np.isfinite(shares).all(axis=1)  # a window with a step of unknown wait: unknown
        shares = np.where(known, np.median(np.where(np.isfinite(shares), shares, 0.0), axis=1), np.nan)
        # the window joins the span, the oldest leaving once it holds n_win
        shift = ks[w.spans[ks] >= n_win]
        w.span_ratios[shift, :-1] = w.span_ratios[shift, 1:]
        w.span_excess[shift, :-1] = w.span_excess[shift, 1:]
        w.spans[shift] -= 1
        at = w.spans[ks]
        w.span_ratios[ks, at] = w.ratios[ks]
        w.span_excess[ks, at] = w.excess[ks]
        w.spans[ks] += 1
        w.fill[ks] = 0
        for m in np.unique(w.spans[ks]):  # ranks with as many windows in their span at once
            sel = ks[w.spans[ks] == m]
            ratios, excess = w.span_ratios[sel, :m], w.span_excess[sel, :m]
            relative = np.minimum(1.0, np.median(ratios.reshape(len(sel), -1), axis=1))
            excess_s = np.median(excess.reshape(len(sel), -1), axis=1)
            # each window of the span on its own: all but one slow (one long pause is not a persistent shift)
            alone = self._slow(np.minimum(1.0, np.median(ratios, axis=2)), np.median(excess, axis=2)).sum(axis=1)
            for j, k in enumerate(sel.tolist()):
                r = st.ranks[k]
                at_k = np.flatnonzero(ks == k)[0]
                r.current, r.wait_share = float(current[at_k]), float(shares[at_k])
                r.relative, r.excess_s = float(relative[j]), float(excess_s[j])
                if math.isnan(r.best) or r.current < r.best:
                    r.best = r.current
                r.windows += 1
                r.step, r.source = step, source
                if r.below >= n_win:  # named: back in line only past the midpoint to 1, so a rank near the threshold does not flap
                    slow = r.relative < (1 + t.straggler_score) / 2 and r.excess_s >= t.straggler_min_s / 2
                else:
                    slow = bool(self._slow(r.relative, r.excess_s)) and alone[j] >= m - 1
                r.below = int(m) if slow else 0

    def _slow(self, relative, excess_s):
        """Whether a relative score and an excess (floats, or arrays alike) are slow."""
        return (relative < self.t.straggler_score) & (excess_s >= self.t.straggler_min_s)

    def _timed(self, job, st: _Job) -> dict[int, _Rank]:
        """Ranks of the job with a complete window (forgotten ranks dropped)."""
        for k in [k for k in st.ranks if k not in job.ranks]:
            del st.ranks[k]
            st.values = None
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
                f"rank {k} straggles: its {SOURCES.get(r.source, r.source)} per step exceeds its peers' at the same step "
                f"by {r.excess_s * 1e3:.1f} ms (median; {r.current * 1e3:.1f} ms against {fastest * 1e3:.1f} ms on the "
                f"fastest rank, {fastest_rank}), relative score {r.relative:.2f} against the peers' median over {r.below} windows of "
                f"{self.t.straggler_window} steps (step {r.step})"
                + (f"; it waited for a CPU {r.wait_share:.0%} of its compute time"
                   + (", left out" if r.source == "compute_time_less_wait" else "") if r.wait_share > 0 else ""),
                rank=k,
                details={
                    "relative_score": r.relative, "individual_score": r.best / r.current, "median_s": r.current,
                    "excess_s": r.excess_s, "fastest_median_s": fastest, "fastest_rank": fastest_rank,
                    "best_median_s": r.best, "windows": r.below, "source": r.source, "cpu_wait_ratio": r.wait_share,
                    "medians_s": {str(q): x.current for q, x in sorted(live.items())},
                },
            ))
        return Evaluation.found(*findings)

    def values(self, job_id):
        st = self.kept(job_id)
        if st is None:
            return {}
        if st.values is None:
            st.values = self._compute_values(st)
        return st.values

    @staticmethod
    def _compute_values(st: _Job):
        ranks = {k: r for k, r in st.ranks.items() if r.windows and r.current > 0}
        if not ranks:
            return {}
        return {
            "rank_straggler_relative_score": {(str(k),): r.relative for k, r in ranks.items()},
            "rank_straggler_individual_score": {(str(k),): r.best / r.current for k, r in ranks.items()},
            "rank_straggler_cpu_wait_ratio": {(str(k),): r.wait_share for k, r in ranks.items() if r.wait_share == r.wait_share},
        }
