"""After all-reduce every rank must hold the same gradient, bit for bit."""

from __future__ import annotations

from . import Check, Evaluation, Finding, register
from ._fingerprints import minority


@register
class GradientAgreement(Check):
    name = "grad_agreement"
    severity = "critical"
    description = (
        "Compares each parameter's gradient fingerprint across ranks at every probed step; after "
        "all-reduce they must be equal bit for bit. Names the ranks that differ from the majority and "
        "the parameters affected (a faulty device or a broken communication hook)."
    )
    dashboard = "consistency"

    fingerprints = ("fp_grad", "fp_grad_seen")

    def on_round(self, job, r):
        fp, seen = getattr(r, self.fingerprints[0]), getattr(r, self.fingerprints[1])
        if fp is None or len(r.ranks) < 2 or seen.sum(axis=0).max(initial=0) < 2:
            return Evaluation.no_data()
        bad, tied = minority(fp, seen, getattr(r, "holders", None))
        findings = self.minority_findings(job, r, bad)
        if tied:
            names = [r.params[p] for p in tied]
            findings.append(Finding(
                self.name, job.job, r.step,
                f"ranks disagree on the gradients of {len(tied)} parameter(s) with no majority, first {names[0]} "
                f"(step {r.step}; with 2 ranks the faulty one cannot be told apart)",
                details={"params": names[:50], "n_params": len(tied), "ranks": list(r.ranks)},
            ))
        return Evaluation.found(*findings)

    def minority_findings(self, job, r, bad: dict[int, list[int]]) -> list[Finding]:
        """One finding per rank in the minority: ``bad`` maps rank indices to parameter indices
        (:func:`._fingerprints.minority`)."""
        findings = []
        what = "gradients" if self.name == "grad_agreement" else "weights"
        for k, ps in sorted(bad.items()):
            names = [r.params[p] for p in ps]
            findings.append(Finding(
                self.name, job.job, r.step,
                f"rank {r.ranks[k]}'s {what} differ from the majority of ranks in {len(ps)} parameter(s), "
                f"first {names[0]} (step {r.step})",
                rank=r.ranks[k], details={"params": names[:50], "n_params": len(ps), "ranks": list(r.ranks)},
            ))
        return findings
