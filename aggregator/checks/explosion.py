"""Exploding, vanishing and spiking gradients: global and per-layer gradient norms against absolute
thresholds and against their own rolling median.

Global, every step. Every rank reports the global gradient norm after all-reduce, the same value
on every rank; the step is evaluated once, when every rank has reported it (see :mod:`._steps`),
with the median over the ranks' finite values. It is

* *exploding* above ``explode_above``,
* *vanishing* below ``vanish_below``,
* *spiking* above ``spike_factor`` times the median of the previous ``spike_window`` steps' norms
  (judged once ``spike_min_history`` steps are known; a median of 0 judges nothing).

An exploding or spiking step names the rank with the largest *local* gradient norm (before
all-reduce, from the DDP communication hook) as the likely source: after all-reduce every rank
holds the same gradient, only the local norms tell which rank's batch produced it. Without local
norms (no DDP hook) no rank is named, except in a world of one. A vanishing norm names no rank.

Per layer, every probed step: each module's parameter-gradient norm (after all-reduce; median
over ranks) against ``explode_above`` and against the median of that module's previous
``spike_window`` probed norms. At most ``max_layers`` layers are named, the worst first (largest
ratio of norm to its threshold).

Non-finite norms (NaN, Inf) are left to the ``nonfinite`` check: they are not judged here and
never enter a rolling median (case C36).

Lifetimes. A finding is keyed by the rank it names (global) or the layer (per layer); explode and
spike at the same step on the same rank are one finding listing both kinds. It is raised at the
first step showing the condition and stays active until ``spike_window`` steps pass without the
condition recurring (each recurrence extends it), then resolves. One bad step thus gives one
finding that lasts a window, instead of flapping with every step, and a persistent explosion
stays one finding.

Case C10 (mixed precision): steps that AMP's ``GradScaler`` skips because of an overflow send no
report (the agent, given the scaler, discards their statistics and counts them in the next
report's ``skipped``, exported as ``gradwatch_rank_skipped_steps_total``), so they are never
judged here. Gradients the agent does see were unscaled before ``optimizer.step()``, and local
norms are divided by the loss scale, so the scale does not inflate the norms judged here.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
from pydantic import Field

from . import Check, Evaluation, Finding, register
from ._steps import Steps


@dataclass
class _Episode:
    rank: Optional[int]
    layer: Optional[str]
    step: int  # first step of the episode
    until: int  # resolves once a step >= until is evaluated without the condition
    score: float  # how far past its threshold (1 = at it); bounds the layers named
    kinds: dict = field(default_factory=dict)  # kind -> {"step", "grad_norm", "median"}
    details: dict = field(default_factory=dict)


@dataclass
class _Job:
    steps: Steps
    norms: collections.deque
    layer_norms: dict = field(default_factory=dict)  # module -> deque of probed norms
    episodes: dict = field(default_factory=dict)  # (rank, layer) -> _Episode
    last_step: int = -1  # latest step evaluated (globally or by a round)
    last_round: int = -1
    evaluated: bool = False


def _fmt(x) -> str:
    return f"{x:.3g}"


@register
class Explosion(Check):
    name = "explosion"
    severity = "critical"
    description = (
        "Global gradient norm every step, and each layer's at probed steps, against explode_above "
        "and against spike_factor times its rolling median over spike_window steps. Names "
        "the rank with the largest local (pre-all-reduce) gradient norm as the likely source, and at most "
        "max_layers layers. A finding lasts spike_window steps past its last bad step. Non-finite norms "
        "are left to the nonfinite check; steps AMP's loss scaler skipped are not reported by the agent "
        "(case C10)."
    )
    dashboard = "gradient_flow"

    class Thresholds(Check.Thresholds):
        explode_above: float = Field(1e3, gt=0, description="Gradient norm (global, or a layer's) above which gradients are exploding.")
        spike_factor: float = Field(10.0, gt=1, description="A gradient norm above this multiple of its rolling median is a spike.")
        spike_window: int = Field(20, ge=3, description="Steps in the rolling median the spike check compares against.")
        spike_min_history: int = Field(5, ge=1, description="Values the rolling median needs (steps for the global gradient norm, probed steps for a layer's) before a spike can be judged.")

    metrics = {
        "job_grad_norm_median": (
            "Rolling median of the global gradient norm (after all-reduce) over the last spike_window steps, "
            "finite values only; the spike reference.", (), "",
        ),
    }

    #: kinds of trouble this check judges; the vanishing check is this one judging "vanish" alone
    kinds = frozenset({"explode", "spike"})

    def __init__(self, t):
        super().__init__(t)
        self._jobs: dict[str, _Job] = {}

    def _job(self, job) -> _Job:
        st = self._jobs.get(job.job)
        if st is None or st.steps.world != job.world:
            st = self._jobs[job.job] = _Job(Steps(job.world), collections.deque(maxlen=self.t.spike_window))
        return st

    @property
    def _min_history(self) -> int:
        return min(self.t.spike_min_history, self.t.spike_window)

    # --- events ---------------------------------------------------------------------------------

    def on_report(self, job, rank, report):
        st = self._job(job)
        return self._steps(job.job, st, st.steps.add(rank.rank, report))

    def on_tick(self, job, now):
        st = self._jobs.get(job.job)
        if st is None:
            return None
        return self._steps(job.job, st, st.steps.tick(now))

    def on_round(self, job, r):
        st = self._job(job)
        if r.step <= st.last_round:
            return None  # a straggling older round: its layers' history has moved on
        st.last_round = r.step
        values, observed = r.agg["grad_norm"]
        bad = []
        for i, module in enumerate(r.modules):
            v = float(values[1, i])
            if not observed[i] or not math.isfinite(v):
                continue
            hist = st.layer_norms.setdefault(module, collections.deque(maxlen=self.t.spike_window))
            kinds, score = self._judge(v, hist, global_=False)
            hist.append(v)
            if kinds:
                bad.append((score, i, module, v, kinds))
        for score, _, module, v, kinds in sorted(bad, key=lambda x: (-x[0], x[1])):
            self._episode(st, r.step, None, module, score, kinds, {"grad_norm": v, "probed_step": r.step})
        # the worst max_layers layers over the episodes still active, this round's and earlier ones
        layers = sorted((e for e in st.episodes.values() if e.layer is not None), key=lambda e: -e.score)
        for e in layers[self.t.max_layers :]:
            del st.episodes[(e.rank, e.layer)]
        st.last_step = max(st.last_step, r.step)
        st.evaluated = True
        return self._evaluation(job.job, st)

    def values(self, job_id):
        st = self._jobs.get(job_id)
        if st is None or not st.norms:
            return {}
        return {"job_grad_norm_median": {(): float(np.median(st.norms))}}

    def forget(self, job_id):
        self._jobs.pop(job_id, None)

    # --- judging --------------------------------------------------------------------------------

    def _judge(self, norm: float, hist, global_: bool) -> tuple[dict, float]:
        """Kinds of trouble ``norm`` shows against the thresholds and the median of ``hist``;
        and a score, the largest ratio of norm to a threshold it crossed."""
        t = self.t
        kinds: dict = {}
        score = 0.0
        median = float(np.median(hist)) if len(hist) >= self._min_history else math.nan
        if norm > t.explode_above:
            kinds["explode"] = {"threshold": t.explode_above}
            score = max(score, norm / t.explode_above)
        if global_ and "vanish" in self.kinds and norm < t.vanish_below:
            kinds["vanish"] = {"threshold": t.vanish_below}
            score = max(score, 1.0)
        if median > 0 and norm > t.spike_factor * median:
            kinds["spike"] = {"median": median, "factor": norm / median}
            score = max(score, norm / (t.spike_factor * median))
        kinds = {k: v for k, v in kinds.items() if k in self.kinds}
        return kinds, score if kinds else 0.0

    def _steps(self, job_id: str, st: _Job, released) -> Optional[Evaluation]:
        if not released:
            return None
        for step, reports in released:
            self._global(st, step, reports)
        return self._evaluation(job_id, st)

    def _global(self, st: _Job, step: int, reports: dict) -> None:
        st.last_step = max(st.last_step, step)
        norms = [r.grad_norm for r in reports.values() if math.isfinite(r.grad_norm)]
        if not norms:
            return  # non-finite (or no gradients): the nonfinite check's business
        st.evaluated = True
        g = float(np.median(norms))
        kinds, score = self._judge(g, st.norms, global_=True)
        st.norms.append(g)
        if not kinds:
            return
        local = {k: r.local_grad_norm for k, r in sorted(reports.items())}
        finite = {k: v for k, v in local.items() if math.isfinite(v)}
        if finite:
            source = max(finite, key=lambda k: (finite[k], -k))
        else:
            source = next(iter(reports)) if st.steps.world == 1 else None
        details = {"grad_norm": g, "local_grad_norms": local, "ranks_reporting": len(reports)}
        if "vanish" in kinds:
            self._episode(st, step, None, None, score, {"vanish": kinds.pop("vanish")}, details)
        if kinds:
            self._episode(st, step, source, None, score, kinds, dict(details, source_rank=source))

    def _episode(self, st: _Job, step: int, rank, layer, score: float, kinds: dict, details: dict) -> None:
        e = st.episodes.get((rank, layer))
        if e is None:
            e = st.episodes[(rank, layer)] = _Episode(rank, layer, step, 0, score)
        e.until = step + self.t.spike_window
        e.score = max(e.score, score)
        for k, info in kinds.items():
            e.kinds[k] = dict(info, step=step, grad_norm=details["grad_norm"])
        e.details = details

    # --- findings -------------------------------------------------------------------------------

    def _evaluation(self, job_id: str, st: _Job) -> Optional[Evaluation]:
        for key in [k for k, e in st.episodes.items() if st.last_step >= e.until]:
            del st.episodes[key]
        if not st.evaluated:
            return None
        return Evaluation.found(*(self._finding(job_id, e) for e in st.episodes.values()))

    def _finding(self, job_id: str, e: _Episode) -> Finding:
        parts = []
        for kind in ("explode", "vanish", "spike"):
            k = e.kinds.get(kind)
            if k is None:
                continue
            if kind == "explode":
                parts.append(f"gradient norm {_fmt(k['grad_norm'])} above {_fmt(k['threshold'])} (exploding, step {k['step']})")
            elif kind == "vanish":
                parts.append(f"gradient norm {_fmt(k['grad_norm'])} below {_fmt(k['threshold'])} (vanishing, step {k['step']})")
            else:
                parts.append(
                    f"gradient norm {_fmt(k['grad_norm'])}, {_fmt(k['factor'])}x its rolling median {_fmt(k['median'])} "
                    f"(spike, step {k['step']})"
                )
        what = f"layer {e.layer}: " if e.layer is not None else "global "
        summary = what + "; ".join(parts)
        if e.layer is None and e.rank is not None:
            local = e.details["local_grad_norms"].get(e.rank, math.nan)
            summary += f"; largest local gradient norm on rank {e.rank} ({_fmt(local)}), the likely source"
        elif e.layer is None and "vanish" not in e.kinds:
            summary += "; no local gradient norms to name the source rank"
        details = dict(e.details, kinds=sorted(e.kinds), episode={k: dict(v) for k, v in e.kinds.items()},
                       active_until_step=e.until)
        return Finding(self.name, job_id, e.step, summary, rank=e.rank, layer=e.layer, details=details)
