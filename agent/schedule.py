"""The probe schedule: which steps are probed, and the bursts a suspicious gradient norm asks for.

Two ways to pick probed steps:

* **budget** (the default, ``every`` unset): the agent measures its own cost (:meth:`ProbeSchedule.account`)
  and probes every ``interval``-th step, the interval chosen so that its average cost stays within
  ``budget`` (a fraction of the step time). ``interval`` is a power of two and a probed step is
  one with ``step % interval == 0``: ranks that measure slightly different costs still all probe
  the steps of the larger interval, so those rounds are complete; the steps only the ranks of a
  smaller interval probe are rounds the aggregator counts as partial (by schedule), not incomplete.
  ``max_interval_s`` bounds the interval in seconds (detection latency); when even that ceiling
  costs more than :data:`OVER_BUDGET` times the budget, ``over_budget`` is set and one warning says so.
* **fixed** (``every=N``): every N-th step.

When the sender thread sees a non-finite gradient norm, or one above ``spike_factor`` times the
median of the recent finite ones, it asks for a *burst*: the next ``burst`` steps are probed
regardless of cadence. Bursts are outside the budget. The request is a plain integer the training
thread reads at its next step boundary, so it arrives a step or two after the faulty step and
never costs a host synchronisation.

The aggregator's commands (:mod:`.control`, on the sender thread) change the schedule for a
bounded time only: a probe *window* (:meth:`ProbeSchedule.window`) probes the steps ``[start,
start + steps)`` whatever the cadence or the budget says, like a burst, optionally only the leaf
modules whose path matches given fnmatch patterns (:meth:`.hooks.ProbeRecorder.only`), and ends
:data:`WINDOW_S` after it was asked for at the latest; a budget *override*
(:meth:`ProbeSchedule.override`) replaces the budget for some seconds, then the agent's own is back.
Both are one tuple the training thread reads at its step boundaries.

At each step boundary :meth:`ProbeSchedule.advance` switches the recorder's module hooks on or off,
so hooks exist only while a probed step runs, unless the NaN guard keeps them (:mod:`.hooks`).
The guard's cost is part of the every-step cost the budget sees; with ``nan_guard="auto"`` it is
first judged on its own: once :data:`GUARD_STEPS` unprobed steps are measured, the guard stays on
only if the median of its host time per step is at most :data:`GUARD_SHARE` of the budget of a
training step, else it goes off for the rest of the run (one log line says so). While it is
judged its time is left out of the budget's samples, so a guard about to go cannot make the agent
look over budget.
"""

from __future__ import annotations

import collections
import logging
import math
import statistics
import time
from typing import Callable, Optional

from gradwatch.errors import warn_user

from .hooks import ProbeRecorder

PART = "schedule"

START_INTERVAL = 8  # budget mode, until the first probe has been measured
WARMUP_STEPS = 3  # steps whose cost is not measured (first-call allocations, lazy imports, the schema)
OVER_BUDGET = 3.0  # at the ceiling, a cost above this many budgets is flagged
HYSTERESIS = 1.25  # the ideal interval must move this far past a power of two to change the interval
STEP_WINDOW = 64  # unprobed steps behind the step and sentinel medians
PROBE_WINDOW = 9  # probed steps behind the probe medians
REFRESH = 16  # unprobed samples between two recomputations of their medians (a sort costs the training thread)
CLIP = 4.0  # a probed step's wall-time excess counts as at most this many times its own agent host time
# (or 1% of a step): a pause in a probed step (evaluation, a checkpoint, the OS preempting the
# process on a busy machine) is not the agent's cost
GUARD_SHARE = 0.25  # nan_guard="auto": the guard stays on while it costs at most this share of the budget
GUARD_STEPS = 32  # nan_guard="auto": unprobed steps measured before the guard is judged
WINDOW_S = 600.0  # a probe window asked for by the aggregator ends this long after it was asked for, at the latest

log = logging.getLogger("gradwatch.agent")


def _pow2_at_least(x: float) -> int:
    return 1 if x <= 1 else 1 << math.ceil(math.log2(x))


def _pow2_at_most(x: float) -> int:
    return 1 if x < 2 else 1 << math.floor(math.log2(x))


class Cost:
    """The agent's measured cost (seconds), as medians of recent samples.

    Medians, not running means: a pause (evaluation, a checkpoint, the OS preempting the process)
    is one sample among many and moves a median not at all, and nothing ratchets: a median never
    leaves the range of its window. A probed step's wall time is also clipped, per sample, at the
    unprobed median plus :data:`CLIP` times that step's own extra agent host time, so pauses that
    fall on every probed step (a benchmark's interleaving, evaluation aligned with the cadence)
    overstate a probe at most :data:`CLIP`-fold. Medians of unprobed steps are recomputed every
    :data:`REFRESH` samples (and on each of the first), of probed steps on every sample.

    Attributes:
        sentinel_s: agent host time on an unprobed step (sentinel, DDP bucket observation,
            step hooks, pack, submit).
        step_s: wall time of an unprobed step, agent included.
        probe_host_s: agent host time on a probed step (module and tensor hooks included).
        probe_step_s: wall time of a probed step.
        probes, steps: samples behind the probe and the unprobed figures.
    """

    def __init__(self):
        self.sentinel_s = self.step_s = self.probe_host_s = self.probe_step_s = math.nan
        self.probes = self.steps = 0
        self._sentinel: collections.deque = collections.deque(maxlen=STEP_WINDOW)
        self._step: collections.deque = collections.deque(maxlen=STEP_WINDOW)
        self._probe_host: collections.deque = collections.deque(maxlen=PROBE_WINDOW)
        self._probe_step: collections.deque = collections.deque(maxlen=PROBE_WINDOW)

    def add(self, probed: bool, agent_s: float, step_s: float) -> bool:
        """One step's agent host time and wall time, seconds; non-finite or negative samples are
        ignored. Returns whether a median changed (was recomputed): what depends on them only
        needs working out again then."""
        if not (math.isfinite(agent_s) and math.isfinite(step_s)) or agent_s < 0 or step_s <= 0:
            return False
        if probed:
            if self.steps:
                own = max(agent_s - self.sentinel_s, 0.01 * self.step_s)
                step_s = min(step_s, self.step_s + CLIP * own)
            self._probe_host.append(agent_s)
            self._probe_step.append(step_s)
            self.probe_host_s = statistics.median(self._probe_host)
            self.probe_step_s = statistics.median(self._probe_step)
            self.probes += 1
            return True
        self._sentinel.append(agent_s)
        self._step.append(step_s)
        self.steps += 1
        if self.steps <= REFRESH or self.steps % REFRESH == 0:
            self.sentinel_s = statistics.median(self._sentinel)
            self.step_s = statistics.median(self._step)
            return True
        return False

    @property
    def probe_extra_s(self) -> float:
        """What a probe adds to a step: the larger of the extra agent host time and the extra wall
        time of a probed step over an unprobed one (the latter also sees device time and what
        hooks cost autograd). NaN before both kinds of step were measured."""
        if not (self.probes and self.steps):
            return math.nan
        return max(self.probe_host_s - self.sentinel_s, self.probe_step_s - self.step_s, 0.0)

    @property
    def train_s(self) -> float:
        """The training step without the agent: unprobed step time less the sentinel's cost."""
        return max(self.step_s - self.sentinel_s, 1e-9)

    def fraction(self, interval: int) -> float:
        """Average agent cost per step over the training step alone, probing every ``interval``-th
        step: (sentinel + probe extra / interval) / training step. NaN until measured."""
        return (self.sentinel_s + self.probe_extra_s / interval) / self.train_s


class ProbeSchedule:
    """Cadence and bursts of probed steps for one monitor.

    Args:
        every: fixed probe cadence in steps (>= 1), or None for the budget.
        burst: steps probed after a suspicious gradient norm (0: never).
        spike_factor: a gradient norm above this times the median of the recent ones is a spike.
        recorder: whose hooks :meth:`advance` installs and removes.
        on_error: called as ``on_error("schedule", exc)`` when switching hooks fails.
        history: finite gradient norms kept for the median.
        budget: budget mode: the agent's average cost as a fraction of the training step time.
        max_interval_s: budget mode: the longest interval between probes, seconds of step time.
        guard: the NaN guard, ``"on"``, ``"off"`` or ``"auto"`` (on while it costs at most
            :data:`GUARD_SHARE` of the budget, module docstring; with a fixed ``every`` too, against
            ``budget``); switched on the recorder by :meth:`advance`, off when its part failed.
        clock: monotonic clock, seconds (a window's and an override's end).

    Attributes:
        interval: the probe interval in use, steps.
        cost: the measured :class:`Cost`.
        over_budget: at the ceiling, the agent costs more than ``OVER_BUDGET * budget``.
        guard_s: ``"auto"``: the guard's median host time per unprobed step once judged, seconds
            (NaN before).
    """

    def __init__(self, every: Optional[int], burst: int, spike_factor: float, recorder: ProbeRecorder,
                 on_error: Callable[[str, BaseException], None], history: int = 32, *,
                 budget: float = 0.01, max_interval_s: float = 60.0, guard: str = "off",
                 clock: Callable[[], float] = time.monotonic):
        self.every = every
        self.burst = burst
        self.spike_factor = spike_factor
        self.recorder = recorder
        self.on_error = on_error
        self.own_budget = budget
        self.clock = clock
        # the aggregator's (the sender thread writes each as one tuple, the training thread reads it)
        self._window: Optional[tuple] = None  # (first, end, layers, until clock) of a probe window
        self._override: Optional[tuple] = None  # (budget, until clock)
        self._next = 0  # the step advance() last prepared (the training thread's)
        self._dirty = False  # the budget changed: choose the interval again at the next step
        self.max_interval_s = max_interval_s
        self.interval = every if every is not None else START_INTERVAL
        self.cost = Cost()
        self.over_budget = False
        self._warned = False
        self._burst_until = 0  # written by the sender thread, read at step boundaries
        self._recent: collections.deque = collections.deque(maxlen=history)  # sender thread only
        self.guard = guard != "off"  # the monitor switches it on at the end of attach (advance(0))
        self._judge_guard = guard == "auto"
        self._guard_costs: list[float] = []
        self.guard_s = math.nan

    @property
    def fixed(self) -> bool:
        return self.every is not None

    @property
    def budget(self) -> float:
        """The budget in use: the aggregator's override while it lasts, else the agent's own."""
        o = self._override
        return o[0] if o is not None and self.clock() < o[1] else self.own_budget

    def override(self, budget: float, for_s: float) -> Optional[int]:
        """Sender thread: use ``budget`` for ``for_s`` seconds (the aggregator's ``budget``
        command); returns the step it takes effect at (the next one the training thread
        prepares), or None with a fixed ``every`` (no budget to replace)."""
        if self.fixed:
            return None
        self._override = (budget, self.clock() + for_s)
        self._dirty = True
        return self._next + 1

    def window(self, start: int, steps: int, layers: tuple = ()) -> Optional[int]:
        """Sender thread: probe steps ``[start, start + steps)`` whatever cadence and budget say
        (the aggregator's ``probe`` command), only the leaf modules matching ``layers`` (fnmatch
        patterns; none: every one) at the steps only the window probes; the window ends
        :data:`WINDOW_S` from now at the latest and replaces an earlier one. Returns the first
        step it covers (the steps the training thread has prepared are past), or None when the
        whole window is past."""
        first = max(start, self._next + 1)
        end = start + steps
        if first >= end:
            return None
        self._window = (first, end, tuple(layers), self.clock() + WINDOW_S)
        return first

    def _in_window(self, step: int) -> Optional[tuple]:
        w = self._window
        if w is None or not w[0] <= step < w[1]:
            return None
        if self.clock() >= w[3]:
            self._window = None
            return None
        return w

    def is_probe(self, step: int) -> bool:
        return step % self.interval == 0 or step < self._burst_until or self._in_window(step) is not None

    def on_cadence(self, step: int) -> bool:
        """``step`` is probed for the cadence, not (only) for a burst."""
        return step % self.interval == 0

    @property
    def fraction(self) -> float:
        """Measured average agent cost over the training step time at the interval in use (NaN
        until measured; bursts not included)."""
        return self.cost.fraction(self.interval)

    def ceiling(self) -> int:
        """Longest interval, steps: ``max_interval_s`` over the measured step time, as a power of
        two (>= 1)."""
        if not self.cost.steps:
            return max(self.interval, START_INTERVAL)
        return _pow2_at_most(self.max_interval_s / self.cost.step_s)

    def account(self, step: int, probed: bool, agent_s: float, step_s: float, guard_s: float = 0.0) -> None:
        """Training thread, after ``step``: record its agent time and wall time (seconds; ``guard_s``
        the NaN guard's part of the agent time), judge an ``"auto"`` guard and, in budget mode,
        choose the interval.

        The ideal interval is probe extra / (budget * training step - sentinel), the interval at
        which the average cost is the budget; the interval in use is the power of two at or above
        it (changed only when the ideal moves :data:`HYSTERESIS` past it), at most :meth:`ceiling`.
        Never raises.
        """
        try:
            if step < WARMUP_STEPS:
                return
            # the choice below is a function of the medians alone (and idempotent): between two
            # recomputations of them it would choose the same again, at a cost every step
            judging = self._judge_guard and not probed and math.isfinite(guard_s)
            # an "auto" guard being judged is not yet the agent's cost: the budget (and its
            # over-budget warning) sees it only once it stays
            changed = self.cost.add(probed, agent_s - guard_s if judging else agent_s, step_s)
            if judging:
                self._guard_costs.append(guard_s)
                if len(self._guard_costs) >= GUARD_STEPS:
                    self._judge()
            if self._override is not None and self.clock() >= self._override[1]:
                self._override, self._dirty = None, True  # the agent's own budget is back
            if self._dirty:
                changed, self._dirty = True, False
            if not changed or self.fixed:
                return
            c = self.cost
            extra = c.probe_extra_s
            cur = self.interval
            if not math.isnan(extra):
                room = self.budget * c.train_s - c.sentinel_s
                ideal = extra / room if room > 0 else math.inf
                if ideal > cur * HYSTERESIS:
                    cur = _pow2_at_least(ideal) if math.isfinite(ideal) else 1 << 62
                elif _pow2_at_least(ideal * HYSTERESIS) < cur:
                    cur = _pow2_at_least(ideal * HYSTERESIS)
            top = self.ceiling()
            self.interval = max(1, min(cur, top))
            if math.isnan(extra):
                return
            self.over_budget = self.interval == top and c.fraction(top) > OVER_BUDGET * self.budget
            if self.over_budget and not self._warned:
                self._warned = True
                warn_user(
                    f"gradwatch: the agent costs {c.fraction(top):.1%} of the step time even at its longest probe "
                    f"interval (max_probe_interval_s={self.max_interval_s:g}: every {top} steps at the step time "
                    f"measured now; gradwatch_rank_probe_interval_steps follows it), over {OVER_BUDGET:g}x the budget "
                    f"of {self.budget:.1%} (sentinel {c.sentinel_s * 1e3:.3g} ms, probe {extra * 1e3:.3g} ms, "
                    f"step {c.train_s * 1e3:.3g} ms)")
        except Exception as e:
            self.on_error(PART, e)

    def _judge(self) -> None:
        """``"auto"``: the guard stays on or goes off for good (module docstring)."""
        self._judge_guard = False
        self.guard_s = statistics.median(self._guard_costs)
        self._guard_costs = []
        allowed = GUARD_SHARE * self.budget * self.cost.train_s
        if self.guard_s > allowed:
            self.guard = False
            self.recorder.set_guard(False)
            log.info("gradwatch: NaN guard off (nan_guard='auto'): it costs %.3g ms a step, over %g of the %.1f%% "
                     "budget (%.3g ms of a %.3g ms step); nan_guard='on' keeps it", self.guard_s * 1e3, GUARD_SHARE,
                     self.budget * 100, allowed * 1e3, self.cost.train_s * 1e3)

    def advance(self, step: int) -> None:
        """Training thread, before ``step`` runs: module hooks on for a probed step, off otherwise
        (but for the NaN guard's: on while it is, off once it failed too often)."""
        try:
            self._next = step
            if self.guard and "guard" in self.recorder.disabled:
                self.guard = False
            if self.recorder.guard != self.guard:
                self.recorder.set_guard(self.guard)
            want = self.is_probe(step)
            only = None  # the window's layers, at the steps only it probes
            if self._window is not None:
                w = self._in_window(step)
                if w is not None and w[2] and not (self.on_cadence(step) or step < self._burst_until):
                    only = w[2]
            if only != self.recorder.only_layers:
                self.recorder.only(only)
            if want and not self.recorder.probing:
                self.recorder.install()
            elif not want and self.recorder.probing:
                self.recorder.remove()
        except Exception as e:
            self.on_error(PART, e)

    def watch(self, step: int, grad_norm: float, grad_nonfinite: int, scheduled: int) -> bool:
        """Sender thread: ask for a burst after a non-finite or spiking gradient norm of ``step``.

        ``scheduled`` is the training thread's current step count; a NaN norm with no non-finite
        parameter means "no gradients", not a fault. Returns whether the norm was non-finite or a
        spike (burst or not: the sender then sends the step's record at once). Raises only what
        ``statistics`` would; the sender counts it in its errors.
        """
        recent = self._recent
        spike = len(recent) >= 4 and grad_norm > self.spike_factor * statistics.median(recent)
        anomaly = grad_nonfinite > 0 or math.isinf(grad_norm) or spike
        if self.burst and anomaly:
            # ``burst`` probes from the first step the training thread has not yet scheduled: the
            # request arrives a step or two after the faulty one, and ranks may start one step apart
            self._burst_until = max(self._burst_until, max(step + 1, scheduled + 1) + self.burst)
        if math.isfinite(grad_norm):
            recent.append(grad_norm)
        return anomaly
