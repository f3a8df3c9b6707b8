"""Outlier rank: one rank's own statistics stand apart from its peers' for several probed steps.

Every rank of a data-parallel job computes the same model on different samples, so the statistics
it measures *before* all-reduce — its local gradient norm, the scale of its activations, how many
non-finite values it produced — agree across ranks up to sampling noise. A rank whose statistics
sit far from the others' for ``outlier_probes`` consecutive probed steps is likely fed different
data (a broken shard, a wrong normalisation), runs on a faulty device, or holds different
weights. This check names that rank; after all-reduce the damage is spread over every rank.

Ranks are scored only against the peers that run the same part of the model
(``RoundResult.part``, :func:`~..shards.part`): under pipeline parallelism each stage's ranks among
themselves, since a stage's gradient norm and activations are its own (the first stage's local
gradient norm can be many times the last's on a healthy job). Under DDP, FSDP and HSDP every rank
runs the whole model, and all are peers. At each probed step (a reconciled
:class:`~..reconcile.RoundResult`), within each group of at least three peers, it scores every
rank on three statistics with the modified z-score of Iglewicz and Hoaglin (1993),
``0.6745 * (x - median) / MAD`` over ranks:

* ``local_grad_norm``: the rank's global gradient norm before all-reduce (ranks whose agent does
  not know it, NaN, are left out of this statistic);
* ``activation_std``: the median over layers of the rank's activation standard deviation divided
  by the median over ranks of that layer's (1.0 for a typical rank);
* ``nonfinite``: NaN/Inf elements in the rank's activations, output gradients and parameter
  gradients (``RoundResult.rank_totals`` summed).

The MAD is floored at ``outlier_min_mad`` times the median's magnitude (for the counts, at one
element as well), so a MAD of zero — ranks that agree exactly, or only three ranks of which two
agree — does not turn every small difference into an outlier. A rank's score is its largest
absolute z-score over the three statistics; it is an outlier when the score exceeds
``outlier_z``. One-step events (a single spiking batch) are not outliers: the rank must stay out
for ``outlier_probes`` consecutive probed steps, and the finding resolves at the first probed
step where it is back among its peers. With fewer than three ranks there is no majority to stand
apart from: no data (per group: a pipeline stage of two ranks is not scored).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
from pydantic import Field

from gradwatch import columns

from ..reductions import finite_median, nanmedian
from . import Check, Evaluation, Finding, ranks_live, register

_K = 0.6745  # Phi^-1(0.75): makes the MAD a consistent estimate of the standard deviation
_TINY = 1e-12
_ACT = columns.at("act")


def robust_z(x: np.ndarray, min_mad: float, abs_floor: float = 0.0) -> tuple[np.ndarray, float]:
    """Modified z-scores of ``x`` across ranks, and their median.

    Non-finite entries are left out and get NaN; with fewer than three finite entries every score
    is NaN. The MAD is raised to at least ``min_mad * |median|`` and ``abs_floor``.
    """
    x = np.asarray(x, np.float64)
    z = np.full(x.shape, np.nan)
    ok = np.isfinite(x)
    if ok.sum() < 3:
        return z, math.nan
    v = x[ok]
    med = finite_median(v)
    mad = finite_median(np.abs(v - med))
    scale = max(mad, min_mad * abs(med), abs_floor, _TINY)
    z[ok] = _K * (v - med) / scale
    return z, med


def rank_features(r, rows: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The per-rank statistics the check scores, each float64 [len(rows)] (``rows``: int64 indices
    into ``r.ranks`` of one group of peers; None: every rank). Activation scales are relative to
    the group's median."""
    rows = np.arange(len(r.ranks)) if rows is None else rows
    n = len(rows)
    out = {}
    if r.local_grad_norm is not None:
        out["local_grad_norm"] = np.asarray(r.local_grad_norm, np.float64)[rows]
    std = np.asarray(r.act, np.float64)[rows, :, _ACT.std] if r.act is not None and r.act.size else np.zeros((n, 0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN layers and ranks
        std = np.where(np.isfinite(std), std, np.nan)
        per_layer = _nanmedian(std, axis=0) if std.shape[1] else np.zeros(0)
        usable = np.isfinite(per_layer) & (per_layer > 0)
        if usable.any():
            ratio = std[:, usable] / per_layer[usable]
            out["activation_std"] = _nanmedian(ratio, axis=1)
    out["nonfinite"] = np.nansum(np.asarray(r.rank_totals, np.float64)[rows], axis=1)
    return out


def _nanmedian(a: np.ndarray, axis: int) -> np.ndarray:
    """``np.nanmedian(a, axis)`` bit for bit, without numpy's masked-array path for small arrays
    (:func:`..reductions.nanmedian`; its middle of an odd count is ``(x + x) / 2``, which
    overflows only beyond 1e307)."""
    if a.size and np.nanmax(np.abs(a), initial=0.0) > 1e307:
        return np.nanmedian(a, axis=axis)
    return nanmedian(a, axis)


def peer_groups(r) -> list[np.ndarray]:
    """int64 index arrays into ``r.ranks``: the ranks running the same part of the model
    (``r.part``; one group when None), groups in order of their first rank."""
    if r.part is None:
        return [np.arange(len(r.ranks))]
    return [np.flatnonzero(r.part == p) for p in dict.fromkeys(r.part.tolist())]


@dataclass
class _Outliers:
    last_step: Optional[int] = None  # the latest round scored (None: none yet)
    streak: dict = field(default_factory=dict)  # rank -> consecutive outlying probes (> 0 only)
    z: dict = field(default_factory=dict)  # rank -> its score at the latest round that scored it
    why: dict = field(default_factory=dict)  # rank -> what a finding naming it says
    values: Optional[dict] = None  # values() until the next round: read at every publish


@register
class OutlierRank(Check):
    name = "outlier_rank"
    severity = "warning"
    description = (
        "At each probed step scores every rank's local gradient norm (before all-reduce), activation "
        "scale and non-finite count against its peers' (the ranks running the same pipeline stage) with a robust z-score (median and MAD, "
        "Iglewicz and Hoaglin); names a rank beyond outlier_z for outlier_probes consecutive probed "
        "steps (bad data shard, faulty device, diverged weights). Needs at least three peers."
    )
    dashboard = "consistency"

    class Thresholds(Check.Thresholds):
        outlier_z: float = Field(3.5, gt=0, description="Robust z-score (median/MAD across ranks, Iglewicz and Hoaglin 1993) beyond which a rank is an outlier.")
        outlier_probes: int = Field(3, ge=1, description="Consecutive probed steps a rank must be an outlier before it is named.")
        outlier_min_mad: float = Field(0.15, ge=0, description="Smallest spread (MAD) across ranks the outlier check assumes, as a fraction of the median, so that natural rank-to-rank noise is not an outlier (0.15: beyond outlier_z 3.5 a rank must differ from the median by about 78%).")

    metrics = {
        "rank_outlier_zscore": (
            "Largest absolute robust z-score of the rank's local gradient norm, activation scale and "
            "non-finite count against its peers' (the ranks of its pipeline stage) at the latest probed step.", ("rank",), "",
        ),
    }

    per_job = _Outliers

    def on_round(self, job, r):
        jid = job.job
        st = self.state(jid)
        groups = [g for g in peer_groups(r) if len(g) >= 3]
        if not groups:
            # a round too small once rounds were judged (a burst on one rank) changes nothing while
            # the ranks named are live; one gone for good (forgotten, or closed while training goes
            # on) is never scored again: no data, its finding goes
            named = [k for k, n in st.streak.items() if n >= self.t.outlier_probes]
            if st.last_step is not None and ranks_live(job, named):
                return None
            st.streak = {}
            return Evaluation.no_data()
        if r.step <= (st.last_step if st.last_step is not None else -1):
            return None  # an older round closed late: it must not break the consecutive count
        st.last_step = r.step
        R = len(r.ranks)
        scores = np.zeros(R)
        # each rank's worst statistic: (feature, value, the peers' median, z), and its peer group
        worst_feat = np.full(R, -1, np.int64)
        worst_val, worst_med, worst_z = np.zeros(R), np.zeros(R), np.zeros(R)
        group_of = np.full(R, -1, np.int64)
        feats: list[str] = []
        scored = False
        for g, rows in enumerate(groups):
            for feat, x in rank_features(r, rows).items():
                z, med = robust_z(x, self.t.outlier_min_mad, 1.0 if feat == "nonfinite" else 0.0)
                if not np.isfinite(z).any():
                    continue
                scored = True
                group_of[rows] = g
                if feat not in feats:
                    feats.append(feat)
                az = np.abs(z)
                better = np.isfinite(z) & (az > scores[rows])
                ks = rows[better]
                scores[ks], worst_feat[ks] = az[better], feats.index(feat)
                worst_val[ks], worst_med[ks], worst_z[ks] = x[better], med, z[better]
        if not scored:
            return Evaluation.no_data()
        streak, zs, why = st.streak, st.z, st.why
        ranks = np.asarray(r.ranks, np.int64)  # ascending
        scored = group_of >= 0
        for rank in ranks[~scored].tolist():  # fewer than three peers (a small pipeline stage): not scored
            streak.pop(rank, None)
            zs.pop(rank, None)
        zs.update(zip(ranks[scored].tolist(), scores[scored].tolist()))
        out = scored & (scores > self.t.outlier_z)
        # a scored rank back among its peers ends its streak; ranks not in this round keep theirs
        held = np.array(list(streak), np.int64)
        at = np.searchsorted(ranks, held)
        inside = at < len(ranks)
        inside[inside] = ranks[at[inside]] == held[inside]
        for rank in held[inside][~out[at[inside]]].tolist():
            del streak[rank]
            why.pop(rank, None)
        for k in np.flatnonzero(out).tolist():
            rank = r.ranks[k]
            streak[rank] = streak.get(rank, 0) + 1
            if streak[rank] >= self.t.outlier_probes:
                worst = {"statistic": feats[worst_feat[k]], "value": float(worst_val[k]), "median": float(worst_med[k]),
                         "z": float(worst_z[k])} if worst_feat[k] >= 0 else {}
                why[rank] = dict(worst, step=r.step, probes=streak[rank],
                                 peers=[r.ranks[q] for q in groups[group_of[k]]])
        st.values = None
        for rank in zs.keys() - job.ranks.keys():  # forgotten ranks
            streak.pop(rank, None)
            zs.pop(rank, None)
        findings = []
        for rank, n in sorted(streak.items()):
            if n < self.t.outlier_probes:
                why.pop(rank, None)
                continue
            w = why[rank]
            findings.append(Finding(
                self.name, jid, w["step"],
                f"rank {rank} is an outlier among {len(w['peers'])} peer ranks for {n} consecutive probed steps: "
                f"{w['statistic']} {w['value']:.4g} against a median of {w['median']:.4g} "
                f"(robust z {w['z']:+.1f}, step {w['step']})",
                rank=rank,
                details={**w, "ranks": list(r.ranks), "zscores": {str(k): v for k, v in sorted(zs.items())}},
            ))
        return Evaluation.found(*findings)

    def values(self, job_id):
        st = self.kept(job_id)
        if st is None:
            return {"rank_outlier_zscore": {}}
        if st.values is None:
            st.values = {"rank_outlier_zscore": {(str(k),): v for k, v in st.z.items()}}
        return st.values
