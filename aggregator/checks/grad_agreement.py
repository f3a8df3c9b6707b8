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

from dataclasses import dataclass, field, replace
from typing import Optional
import numpy as np
from pydantic import Field

from ..reconcile import step_norms
from . import Check, Evaluation, Finding, ranks_live, register
from ._fingerprints import minority


@dataclass
class _State:
    active: dict = field(default_factory=dict)  # finding key -> Finding (its first step's)
    last_bad: dict = field(default_factory=dict)  # finding key -> latest step that found it
    norms_judged: bool = False  # a step's gradient norms were judged: that path speaks for the check
    judged: bool = False  # a round was judged: a later round too small to judge changes nothing


def _named_live(job, st: _State) -> bool:
    """The ranks ``st``'s active findings are about are live (:func:`..checks.ranks_live`): the
    rank each names, or for one naming none (a tie) the ranks it was between (``candidates``, else
    the round's ``ranks``), so such a finding resolves too once one of them is gone for good."""
    return ranks_live(job, (k for f in st.active.values()
                            for k in ((f.rank,) if f.rank is not None else f.details.get("candidates", f.details.get("ranks", ())))))


class _Agreement(Check):
    """Majority vote over fingerprints at probed steps, one finding per fault (module docstring)."""

    #: the RoundResult attributes compared: fingerprints uint64 [R, P] and which exist, bool [R, P]
    fingerprints: tuple[str, str] = ("fp_grad", "fp_grad_seen")
    what = "gradients"

    def __init__(self, t):
        super().__init__(t)
        self._jobs: dict[str, _State] = {}

    def _state(self, job) -> _State:
        return self._jobs.setdefault(job.job, _State())

    def forget(self, job_id: str) -> None:
        self._jobs.pop(job_id, None)

    def _too_small(self, job, st: _State, fp) -> Optional[Evaluation]:
        """A round too small to judge (no fingerprints, or fewer than two of a parameter): None
        while its findings stand (the norm path speaks for the check, or a burst of probes on the
        one rank whose own norm spiked made a round of one, and the ranks the findings are about
        are live: no_data would drop them and the next full round raise the same fault again),
        else no data, and the findings go with it."""
        if st.norms_judged or (st.judged and fp is not None and _named_live(job, st)):
            return None
        st.active.clear(), st.last_bad.clear()  # no data: the runner drops the findings too
        return Evaluation.no_data()

    def on_round(self, job, r):
        fp, seen = getattr(r, self.fingerprints[0]), getattr(r, self.fingerprints[1])
        st = self._state(job)
        if fp is None or len(r.ranks) < 2 or seen.sum(axis=0).max(initial=0) < 2:
            return self._too_small(job, st, fp)
        st.judged = True
        bad, tied = minority(fp, seen, getattr(r, "holders", None))
        found = self._findings(job.job, r.step, r.ranks, r.params, bad, tied, "fingerprints")
        return self._judged(st, r.step, found)

    def _findings(self, job_id: str, step: int, ranks, params, bad: dict, tied: list, evidence: str,
                  values=None) -> list[Finding]:
        """One finding per rank in the minority, and one for the parameters without a majority."""
        out = []
        for k, ps in sorted(bad.items()):
            names = [params[p] for p in ps]
            extra = values(k, ps[0]) if values is not None else {}
            norm = (f": norm {extra['grad_norm']:.7g}, majority {extra['majority_grad_norm']:.7g}"
                    if "grad_norm" in extra else "")
            out.append(Finding(
                self.name, job_id, step,
                f"rank {ranks[k]}'s {self.what} differ from the majority of ranks in {len(ps)} parameter(s), "
                f"first {names[0]}{norm} (step {step}, {evidence})",
                rank=ranks[k],
                details={"params": names[:50], "n_params": len(ps), "ranks": list(ranks), "evidence": [evidence],
                         "last_step": step, **extra},
            ))
        if tied:
            names = [params[p] for p in tied]
            out.append(Finding(
                self.name, job_id, step,
                f"ranks disagree on the {self.what} of {len(tied)} parameter(s) with no majority, first {names[0]} "
                f"(step {step}, {evidence}; with 2 ranks the faulty one cannot be told apart)",
                details={"params": names[:50], "n_params": len(tied), "ranks": list(ranks), "evidence": [evidence],
                         "last_step": step},
            ))
        return out

    @staticmethod
    def _judged(st: _State, step: int, found: list[Finding]) -> Evaluation:
        """Fold one judged step's findings into the job's active ones; a finding not seen again at
        a later step resolves."""
        for f in found:
            old = st.active.get(f.key)
            if old is None:
                st.active[f.key] = f
            else:  # the same fault seen again: evidence for the finding already raised
                ev = sorted(set(old.details.get("evidence", [])) | set(f.details["evidence"]))
                st.active[f.key] = replace(old, details={**old.details, "evidence": ev,
                                                         "last_step": max(old.details.get("last_step", old.step), step)})
            st.last_bad[f.key] = max(st.last_bad.get(f.key, step), step)
        keys = {f.key for f in found}
        for key in [k for k in st.active if k not in keys and st.last_bad[k] < step]:
            del st.active[key], st.last_bad[key]
        return Evaluation.found(*st.active.values())


@register
class GradientAgreement(_Agreement):
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
        # of its float64 value (agent/stats.py, issue 11), two replicas' within 2e-6; 1e-5 leaves a
        # 5x margin and still sees a change of 1e-5 in one parameter's gradient norm.
        norm_rtol: float = Field(1e-5, ge=0, le=1e-2, description=(
            "Relative tolerance between two ranks' gradient norms of one parameter after all-reduce "
            "(equal bits give equal norms; this absorbs reduction-order differences, within 2e-6)."))

    def on_steps(self, job, views):
        """Judge each released step's per-parameter gradient norms: the evaluations of the steps
        judged, in order (None when none could be)."""
        st = self._state(job)
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
            sn = step_norms(job.schemas, step, v.norms)
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
