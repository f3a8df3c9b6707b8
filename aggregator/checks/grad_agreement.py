"""After all-reduce every rank must hold the same gradient, bit for bit.

Two pieces of evidence, judged with one majority vote (:func:`._fingerprints.minority`) among the
ranks that hold the same bytes of a parameter (DDP replicas; the replicas of one shard across
HSDP's replicate dimension; never the members of one shard group, never two pipeline stages:
:func:`gradwatch.aggregator.shards.holders`):

* every step, each parameter's gradient L2 norm after all-reduce, which the agent measures in the
  optimizer's pre-step hook and sends with every report (wire ``grad_norms``), equal within
  ``norm_rtol``;
* every probed step, each parameter's gradient fingerprint, equal bit for bit.

Local (pre-all-reduce) norms differ between ranks by design and are never compared. Non-finite
norms are left to the ``nonfinite`` check.

One fault, one finding. A finding is keyed by the rank it names (none for a split without a
majority); it opens at the first step where the rank is in the minority, later evidence for the
same key (the fingerprints of that step, a later step) is folded into it (``last_step``,
``evidence``), and it resolves once a later step is judged without it. A perturbed gradient
applied once thus gives one finding, at its step, and the weights it leaves different are
``replica_drift``'s.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
from pydantic import Field

from . import Check, register
from ._fingerprints import Agreement, minority


@register
class GradientAgreement(Agreement):
    name = "grad_agreement"
    severity = "critical"
    description = (
        "Compares each parameter's gradient after all-reduce across the ranks holding the same bytes: its "
        "L2 norm at every step (within norm_rtol) and its fingerprint at every probed step (bit for bit). "
        "Names the rank that differs from the majority and the parameters affected, at the step it "
        "happened (a faulty device, a broken communication hook, a gradient altered after all-reduce). "
        "One finding per fault."
    )
    dashboard = "consistency"

    class Thresholds(Check.Thresholds):
        # Replicas hold the same bits after all-reduce, so the same kernel gives them the same norm
        # and the float32 values on the wire are equal. Only a different reduction order (another
        # device type, another CPU thread count) can make them differ: each norm is within rel 1e-6
        # of its float64 value (agent/stats.py), two replicas' within 2e-6; 1e-5 leaves a
        # 5x margin and still sees a change of 1e-5 in one parameter's gradient norm.
        norm_rtol: float = Field(1e-5, ge=0, le=1e-2, description=(
            "Relative tolerance between two ranks' gradient norms of one parameter after all-reduce "
            "(equal bits give equal norms; this absorbs reduction-order differences, within 2e-6)."))

    def on_steps(self, job, views):
        """Judge each released step's per-parameter gradient norms: the evaluations of the steps
        judged, in order (None when none could be)."""
        st = self.state(job.job)
        evs = []
        for v in views:
            if not v.norms:
                continue
            step = v.step
            same = _all_equal(job.schemas, v.norms)
            if same is not None:  # the healthy case: every rank sent the same bits
                if same:
                    if st.active or not st.norms_judged:
                        evs.append(self._judged(st, step, []))
                    st.norms_judged = True
                continue
            sn = job.step_norms(step, v.norms)
            if sn is None or len(sn.ranks) < 2:
                continue
            seen = np.isfinite(sn.norms)
            if seen.sum(axis=0).max(initial=0) < 2:
                continue
            bad, tied = minority(sn.norms, seen, sn.holders, rtol=self.t.norm_rtol)

            def values(k: int, p: int, sn=sn, seen=seen, bad=bad) -> dict:
                # the majority's value: the median of the holders of the same bytes not in the minority
                peers = seen[:, p] & (sn.holders[:, p] == sn.holders[k, p])
                peers &= ~np.isin(np.arange(len(sn.ranks)), [j for j, ps in bad.items() if p in ps])
                ref = float(np.median(sn.norms[peers, p]))
                x = float(sn.norms[k, p])
                return {"module": sn.params[p].rpartition(".")[0] or sn.params[p], "grad_norm": x,
                        "majority_grad_norm": ref, "rel_diff": abs(x - ref) / ref if ref else float("inf")}

            st.norms_judged = True
            evs.append(self._judged(st, step, self._findings(job.job, step, sn.ranks, sn.params, bad, tied, "grad_norms", values)))
        return evs or None


def _all_equal(schemas: dict, norms: dict) -> "Optional[bool]":
    """Whether every rank's norms of a step (``rank -> (schema hash, float32 row)``) are the same
    bits under one known schema: True (and at least two ranks, some finite value: judged, nothing
    differs), False (nothing to judge: one rank, or no finite value), None (judge them)."""
    hashes = {h for h, _ in norms.values()}
    if len(hashes) != 1:
        return None
    (h,) = hashes
    s = schemas.get(h)
    rows = np.stack([r for _, r in norms.values()])
    if s is None or rows.shape[1] != len(s.params) or (s.mesh is not None and s.shard):
        return None  # left out, or sharded: the holders decide who compares with whom
    bits = rows.view(np.uint32)
    if not (bits == bits[0]).all():
        return None
    return len(rows) >= 2 and bool(np.isfinite(rows[0]).any())
