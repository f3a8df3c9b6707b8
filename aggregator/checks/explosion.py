"""Exploding, vanishing and spiking gradients: global and per-layer gradient norms against absolute
thresholds and against their own rolling median.

Global, every step. Every rank reports the global gradient norm after all-reduce, the same value
on every rank; the step is evaluated once, when every rank has reported it (see :mod:`..steps`),
with the median over the ranks' finite values. It is

* *exploding* above ``explode_above``,
* *vanishing* below ``vanish_below``,
* *spiking* above ``spike_factor`` times the median of the previous ``spike_window`` steps' norms
  (judged once ``spike_min_history`` steps are known; a median of 0 judges nothing).

Local, every step. Gradient clipping (``clip_grad_norm_`` between backward and the optimizer step,
in most training loops) caps the global norm the agent measures at the step, so a blow-up would
read as a norm at the clip: the local norms, taken in the DDP communication hook during backward,
are before any clipping. Their mean over the reporting ranks' finite values, every step, is also
*spiking* above ``spike_factor`` times the median of its previous ``spike_window`` steps (judged
once ``spike_min_history`` are known). Only relative: a local norm holds the batch's noise, and a
training loop may rescale gradients after backward (by tokens), so ``explode_above`` is the global
norm's alone. For DDP with mean all-reduce the global gradient is the ranks' mean, so one rank's
blow-up by F moves the mean local norm by F / world, as it moves the global norm before clipping.

An exploding or spiking step names the rank with the largest *local* gradient norm (before
all-reduce, from the DDP communication hook) as the likely source: after all-reduce every rank
holds the same gradient, only the local norms tell which rank's batch produced it. Without local
norms (no DDP hook) no rank is named, except in a world of one. A vanishing norm names no rank.

Per layer, every probed step: each module's parameter-gradient norm (after all-reduce; median
over ranks) against ``explode_above`` and against the median of that module's previous
``spike_window`` probed norms. At most ``max_layers`` layers are listed, the worst first (largest
ratio of norm to its threshold).

Non-finite norms (NaN, Inf) are left to the ``nonfinite`` check: they are not judged here and
never enter a rolling median (case C36).

One fault, one finding. A job has at most one episode at a time: it opens at the first bad step
(global or a layer's) and lasts until ``spike_window`` steps pass without any bad step, global or
per layer (each recurrence extends it), then resolves. Everything bad within it is its evidence,
updated while it lasts: the kinds (explode, spike), the layers (the worst ``max_layers``, each
with its first step and largest norm), the ranks that held the largest local norm at a bad global
step, the first and the latest bad step. The finding names the rank of its *first* bad global
step, or, when a layer's spike came first, that layer; what follows within the episode (the same
explosion seen in five layers at the probe, a knock-on spike a few steps later while the weights
recover, with another rank's local norm largest) is folded into it and never attributed to
another rank. One injected explosion thus gives one finding, not one per layer and per
recurrence, and a persistent explosion stays one finding.

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
from typing import ClassVar, Optional

import numpy as np
from pydantic import Field

from gradwatch import columns

from ..reductions import finite_median
from . import Check, Evaluation, Finding, register


#: the row of a layer's gradient norm aggregated over ranks that holds their median
_MEDIAN = columns.named("grad_norm").aggs.index("median")


@dataclass
class _Episode:
    rank: Optional[int]  # the source rank of its first bad global step; never changes
    layer: Optional[str]  # the worst layer when a layer opened it (no global trouble yet); never changes
    step: int  # first bad step
    until: int  # resolves once a step >= until is evaluated without trouble
    last: int = -1  # latest bad step
    kinds: dict = field(default_factory=dict)  # global kind -> {"step", "grad_norm", "median", ...}, latest
    details: dict = field(default_factory=dict)  # the first bad global step's norms and local norms
    layers: dict = field(default_factory=dict)  # layer -> {"step", "last_step", "grad_norm", "score", "kinds"}
    sources: dict = field(default_factory=dict)  # rank -> first bad global step it held the largest local norm


class _LayerNorms:
    """Each module's latest ``window`` probed gradient norms (finite, observed ones only), one
    row per module ever seen: a deque per module, as arrays, so that a round is judged with a few
    numpy calls whatever its modules.

    Attributes:
        rows: module name -> its row.
        ring: float64 [n_rows, window]: the latest values in arrival order modulo ``window``, NaN
            where fewer arrived.
        count: int64 [n_rows]: values appended so far.
    """

    def __init__(self, window: int):
        self.window = window
        self.rows: dict[str, int] = {}
        self.ring = np.full((0, window), np.nan)
        self.count = np.zeros(0, np.int64)
        self._modules: tuple = ()  # the latest round's modules and their rows (a job's rarely change)
        self._at = np.zeros(0, np.int64)

    def at(self, modules: tuple[str, ...]) -> np.ndarray:
        """int64 [len(modules)]: the rows of ``modules``, new ones added (empty)."""
        if modules is not self._modules and modules != self._modules:
            at = np.array([self.rows.setdefault(m, len(self.rows)) for m in modules], np.int64)
            grow = len(self.rows) - len(self.count)
            if grow > 0:
                self.ring = np.concatenate([self.ring, np.full((grow, self.window), np.nan)])
                self.count = np.concatenate([self.count, np.zeros(grow, np.int64)])
            self._modules, self._at = modules, at
        return self._at

    def medians(self, rows: np.ndarray, need: int) -> np.ndarray:
        """float64 [len(rows)]: the median of each row's values as ``statistics.median`` gives it
        (the middle value, or the mean of the two middle ones), NaN for fewer than ``need``."""
        n = np.minimum(self.count[rows], self.window)
        s = np.sort(self.ring[rows], axis=1)  # empty slots (NaN) last
        k = np.arange(len(rows))
        lo, hi = s[k, np.maximum(n - 1, 0) // 2], s[k, n // 2 % self.window]
        with np.errstate(invalid="ignore", over="ignore"):
            med = np.where(n % 2 == 1, hi, (lo + hi) / 2)
        return np.where(n >= need, med, np.nan)

    def append(self, rows: np.ndarray, values: np.ndarray) -> None:
        """Append ``values[i]`` to row ``rows[i]`` (distinct rows), the oldest beyond ``window`` out."""
        self.ring[rows, self.count[rows] % self.window] = values
        self.count[rows] += 1


@dataclass
class _Job:
    norms: collections.deque
    local_norms: collections.deque  # each step's mean local norm over ranks (finite ones)
    layer_norms: Optional[_LayerNorms] = None  # every module's probed norms
    episode: Optional[_Episode] = None
    last_step: int = -1  # latest step evaluated (globally or by a round)
    last_round: int = -1
    evaluated: bool = False


def _fmt(x) -> str:
    return f"{x:.3g}"


class NormThresholds(Check.Thresholds):
    """The thresholds every gradient-norm check reads (:class:`GradientNorms`), declared here for
    the explosion check, which owns them."""

    explode_above: float = Field(1e3, gt=0, description="Gradient norm (global, or a layer's) above which gradients are exploding.")
    spike_factor: float = Field(10.0, gt=1, description="A gradient norm above this multiple of its rolling median is a spike.")
    spike_window: int = Field(20, ge=3, description="Steps in the rolling median the spike check compares against.")
    spike_min_history: int = Field(5, ge=1, description="Values the rolling median needs (steps for the global gradient norm, probed steps for a layer's) before a spike can be judged.")


class GradientNorms(Check):
    """What the gradient-norm checks share (module docstring): every released step's global norm,
    and its ranks' local norms, judged against :class:`NormThresholds` and their rolling medians;
    one episode per fault, lasting ``spike_window`` steps past its last bad step, one finding per
    episode. A check built on it says which :attr:`kinds` of trouble it judges (and is registered;
    this base is not)."""

    dashboard = "gradient_flow"
    Thresholds = NormThresholds
    #: kinds of trouble the check judges: ``explode``, ``spike``, ``vanish``
    kinds: ClassVar[frozenset] = frozenset()

    def new_state(self) -> _Job:
        return _Job(collections.deque(maxlen=self.t.spike_window), collections.deque(maxlen=self.t.spike_window))

    @property
    def _min_history(self) -> int:
        return min(self.t.spike_min_history, self.t.spike_window)

    def on_steps(self, job, views):
        st = self.state(job.job)
        evs = self._globals(job.job, st, views, job.world)
        ev = self._evaluation(job.job, st)
        return evs + [ev] if evs and ev is not None else evs or ev

    # --- judging --------------------------------------------------------------------------------

    def _judge(self, norm: float, median: float, global_: bool) -> tuple[dict, float]:
        """Kinds of trouble ``norm`` shows against the thresholds and its rolling ``median`` (NaN:
        not enough history); and a score, the largest ratio of norm to a threshold it crossed."""
        t = self.t
        kinds: dict = {}
        score = 0.0
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

    def _globals(self, job_id: str, st: _Job, views, world: int) -> list:
        """Judge released steps (:class:`~..steps.StepView`, ascending) by their global gradient
        norms: each the median over the reporting ranks' finite norms (after all-reduce they are
        equal), against the thresholds and the rolling median of the steps before it. Vectorised
        over the steps; the few bad ones go on to :meth:`_bad`. Returns the evaluations after each
        bad step (and after an episode resolved before one), in order."""
        g = _medians([v.grad_norm for v in views])
        ok = ~np.isnan(g)  # non-finite (or no gradients) everywhere: the nonfinite check's business
        if not ok.any():
            st.last_step = max(st.last_step, views[-1].step)
            return []
        st.evaluated = True
        idx, gs = np.flatnonzero(ok), g[ok]
        hist = np.asarray(st.norms, np.float64)
        medians = _rolling_medians(hist, gs, self.t.spike_window, self._min_history)
        t = self.t
        with np.errstate(invalid="ignore"):
            bad = (gs > t.explode_above) | ((medians > 0) & (gs > t.spike_factor * medians))
            if "vanish" in self.kinds:
                bad |= gs < t.vanish_below
        trouble = {int(idx[i]): self._judge(float(gs[i]), float(medians[i]), global_=True)[0]
                   for i in np.flatnonzero(bad).tolist()}
        if "spike" in self.kinds:  # the local norms' spikes (module docstring), where the global norm shows none
            loc = _means([v.local_grad_norm for v in views])
            lok = ok & np.isfinite(loc)
            lidx, ls = np.flatnonzero(lok), loc[lok]
            lmed = _rolling_medians(np.asarray(st.local_norms, np.float64), ls, t.spike_window, self._min_history)
            with np.errstate(invalid="ignore"):
                lbad = (lmed > 0) & (ls > t.spike_factor * lmed)
            for i in np.flatnonzero(lbad).tolist():
                kinds = trouble.setdefault(int(lidx[i]), {})
                if "spike" not in kinds:
                    kinds["spike"] = {"median": float(lmed[i]), "factor": float(ls[i] / lmed[i]), "local": float(ls[i])}
            st.local_norms.extend(ls.tolist())
        evs = []
        for j, kinds in sorted(trouble.items()):
            i = int(np.searchsorted(idx, j))
            if not kinds:
                continue
            if j and st.episode is not None:  # the steps judged before this one may have ended the episode
                st.last_step = max(st.last_step, views[j - 1].step)
                if self._evaluation(job_id, st) is not None and st.episode is None:
                    evs.append(Evaluation.healthy())
            self._bad(st, views[j], float(gs[i]), kinds, world)
            st.last_step = max(st.last_step, views[j].step)
            evs.append(self._evaluation(job_id, st))
        st.last_step = max(st.last_step, views[-1].step)
        st.norms.extend(gs.tolist())
        return evs

    def _bad(self, st: _Job, v, g: float, kinds: dict, world: int) -> None:
        """A step whose global norm ``g`` shows ``kinds`` of trouble: opens or extends the episode."""
        step = v.step
        local = dict(zip(v.ranks.tolist(), v.local_grad_norm.tolist()))
        finite = {k: x for k, x in local.items() if math.isfinite(x)}
        if finite:
            source = max(finite, key=lambda k: (finite[k], -k))
        else:
            source = int(v.ranks[0]) if world == 1 else None
        details = {"grad_norm": g, "local_grad_norms": local, "ranks_reporting": len(v)}
        if "vanish" in kinds:  # names no rank
            source = None
        else:
            details["source_rank"] = source
        e = self._open(st, step, source, None)
        if not e.details:
            e.details = details
        if source is not None:
            e.sources.setdefault(source, step)
        for k, info in kinds.items():
            e.kinds[k] = dict(info, step=step, grad_norm=g)

    def _open(self, st: _Job, step: int, rank, layer) -> _Episode:
        """The job's episode, opened at ``step`` naming ``rank`` or ``layer`` unless one is active;
        either way extended to ``spike_window`` steps past ``step``."""
        e = st.episode
        if e is None:
            e = st.episode = _Episode(rank, layer, step, 0)
        e.last = max(e.last, step)
        e.until = max(e.until, step + self.t.spike_window)
        return e

    # --- findings -------------------------------------------------------------------------------

    def _evaluation(self, job_id: str, st: _Job) -> Optional[Evaluation]:
        if st.episode is not None and st.last_step >= st.episode.until:
            st.episode = None
        if not st.evaluated:
            return None
        return Evaluation.found(*([self._finding(job_id, st.episode)] if st.episode is not None else []))

    def _finding(self, job_id: str, e: _Episode) -> Finding:  # noqa: C901 (one sentence per kind)
        parts = []
        for kind in ("explode", "vanish", "spike"):
            k = e.kinds.get(kind)
            if k is None:
                continue
            if kind == "explode":
                parts.append(f"gradient norm {_fmt(k['grad_norm'])} above {_fmt(k['threshold'])} (exploding, step {k['step']})")
            elif kind == "vanish":
                parts.append(f"gradient norm {_fmt(k['grad_norm'])} below {_fmt(k['threshold'])} (vanishing, step {k['step']})")
            elif "local" in k:
                parts.append(
                    f"gradient norm {_fmt(k['grad_norm'])} (clipped?), but the ranks' local norms before all-reduce "
                    f"{_fmt(k['local'])} (mean), {_fmt(k['factor'])}x their rolling median {_fmt(k['median'])} "
                    f"(spike, step {k['step']})"
                )
            else:
                parts.append(
                    f"gradient norm {_fmt(k['grad_norm'])}, {_fmt(k['factor'])}x its rolling median {_fmt(k['median'])} "
                    f"(spike, step {k['step']})"
                )
        def layer(name: str) -> str:
            v = e.layers.get(name)
            return f"{name} ({_fmt(v['grad_norm'])}, {'/'.join(v['kinds'])} from step {v['step']})" if v else name

        layers = [layer(n) for n in e.layers if n != e.layer]
        if e.layer is not None:
            summary = f"layer {layer(e.layer)}"
            if parts:
                summary += "; then global " + "; ".join(parts)
        else:
            summary = "global " + "; ".join(parts)
            if e.rank is not None:
                local = e.details.get("local_grad_norms", {}).get(e.rank, math.nan)
                summary += f"; largest local gradient norm on rank {e.rank} ({_fmt(local)}), the likely source"
            elif "vanish" not in e.kinds:
                summary += "; no local gradient norms to name the source rank"
        if layers:
            summary += "; layers " + ", ".join(layers)
        if e.last > e.step:
            summary += f"; bad again up to step {e.last} (one episode)"
        kinds = set(e.kinds).union(*(v["kinds"] for v in e.layers.values()))
        details = dict(
            e.details, kinds=sorted(kinds), episode={k: dict(v) for k, v in e.kinds.items()},
            layers={k: dict(v) for k, v in e.layers.items()}, source_ranks={str(k): v for k, v in e.sources.items()},
            first_step=e.step, last_bad_step=e.last, active_until_step=e.until,
        )
        return Finding(self.name, job_id, e.step, summary, rank=e.rank, layer=e.layer, details=details)


@register
class Explosion(GradientNorms):
    name = "explosion"
    severity = "critical"
    description = (
        "Global gradient norm every step, and each layer's at probed steps, against explode_above "
        "and against spike_factor times its rolling median over spike_window steps; the ranks' local "
        "(pre-all-reduce, so pre-clipping) norms' mean every step against spike_factor times its rolling "
        "median, which finds a blow-up that gradient clipping hides from the global norm. Names "
        "the rank with the largest local (pre-all-reduce) gradient norm at the first bad step as the likely source. One "
        "finding per fault: later bad steps and layers (at most max_layers) within spike_window steps of the last "
        "bad one are folded into it as evidence. Non-finite norms "
        "are left to the nonfinite check; steps AMP's loss scaler skipped are not reported by the agent."
    )
    metrics = {
        "job_grad_norm_median": (
            "Rolling median of the global gradient norm (after all-reduce) over the last spike_window steps, "
            "finite values only; the spike reference.", (), "",
        ),
    }
    kinds = frozenset({"explode", "spike"})

    def on_round(self, job, r):
        st = self.state(job.job)
        if r.step <= st.last_round:
            return None  # a straggling older round: its layers' history has moved on
        st.last_round = r.step
        values, observed = r.agg["grad_norm"]
        if st.layer_norms is None:
            st.layer_norms = _LayerNorms(self.t.spike_window)
        hist = st.layer_norms
        v = values[_MEDIAN]  # the median over ranks
        judged = np.flatnonzero(observed & np.isfinite(v))
        rows, v = hist.at(r.modules)[judged], v[judged]
        medians = hist.medians(rows, self._min_history)
        t = self.t
        with np.errstate(invalid="ignore"):
            suspect = (v > t.explode_above) | ((medians > 0) & (v > t.spike_factor * medians))
        bad = []
        for j in np.flatnonzero(suspect).tolist():  # _judge() has the last word on the few
            kinds, score = self._judge(float(v[j]), float(medians[j]), global_=False)
            if kinds:
                i = int(judged[j])
                bad.append((score, i, r.modules[i], float(v[j]), kinds))
        hist.append(rows, v)
        bad.sort(key=lambda x: (-x[0], x[1]))
        if bad:
            e = self._open(st, r.step, None, bad[0][2])
            for score, _, module, v, kinds in bad:
                ev = e.layers.setdefault(module, {"step": r.step, "grad_norm": v, "score": score, "kinds": []})
                ev.update(last_step=r.step, grad_norm=max(ev["grad_norm"], v), score=max(ev["score"], score),
                          kinds=sorted(set(ev["kinds"]) | set(kinds)))
            # the worst max_layers layers of the episode, this round's and earlier ones
            worst = sorted(e.layers.items(), key=lambda kv: -kv[1]["score"])[: self.t.max_layers]
            e.layers = dict(worst)
        st.last_step = max(st.last_step, r.step)
        st.evaluated = True
        return self._evaluation(job.job, st)

    def values(self, job_id):
        st = self.kept(job_id)
        if st is None or not st.norms:
            return {}
        return {"job_grad_norm_median": {(): float(np.median(st.norms))}}

def _medians(rows: list) -> np.ndarray:
    """float64 [len(rows)]: the median of each row's finite values (NaN for a row without any),
    as ``np.median`` of them gives it; rows of one length at once."""
    if len(rows) == 1 and len(rows[0]) and np.isfinite(rows[0]).all():  # one step, every norm finite
        return np.array([finite_median(np.asarray(rows[0], np.float64))])
    if len({len(r) for r in rows}) == 1 and len(rows[0]):
        m = np.stack(rows)
        fin = np.isfinite(m)
        if fin.all():
            return np.median(m, axis=1)
        out = np.full(len(rows), np.nan)
        some = fin.any(axis=1)
        if some.any():
            with np.errstate(invalid="ignore"):
                out[some] = np.nanmedian(np.where(fin[some], m[some], np.nan), axis=1)
        return out
    out = np.full(len(rows), np.nan)
    for i, r in enumerate(rows):
        f = r[np.isfinite(r)]
        if len(f):
            out[i] = np.median(f)
    return out


def _means(rows: list) -> np.ndarray:
    """float64 [len(rows)]: the mean of each row's finite values (NaN for a row without any)."""
    out = np.full(len(rows), np.nan)
    for i, r in enumerate(rows):
        f = np.asarray(r, np.float64)
        f = f[np.isfinite(f)]
        if len(f):
            out[i] = f.mean()
    return out


def _rolling_medians(hist: np.ndarray, new: np.ndarray, window: int, need: int) -> np.ndarray:
    """For each of ``new``, the median of the ``window`` values before it in ``hist`` then ``new``
    (fewer at the start), NaN while fewer than ``need`` precede it."""
    h = min(len(hist), window)
    if len(new) == 1:  # one step: the median of the window before it
        return np.array([finite_median(hist[-window:]) if h >= min(need, window) else np.nan])
    seq = np.concatenate([hist[-window:], new])
    out = np.full(len(new), np.nan)
    full = [i for i in range(len(new)) if h + i >= window]
    for i in range(len(new)):  # the first window of a job: fewer values before it
        if h + i >= window:
            break
        if h + i >= need:
            out[i] = np.median(seq[: h + i])
    if full:
        a = full[0]
        win = np.lib.stride_tricks.sliding_window_view(seq[h + a - window: h + len(new) - 1], window)
        out[a:] = np.median(win, axis=1)
    return out
