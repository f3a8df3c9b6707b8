"""Gradient noise scale B_simple (McCandlish et al. 2018, "An Empirical Model of Large-Batch
Training", appendix A), from what data parallelism measures anyway.

At a probed step each of the W ranks reports its local gradient norm |G_small| over its own batch
b (before all-reduce) and the global norm |G_big| after all-reduce, over B = b * W samples. With
|G_small|^2 averaged over the ranks, the unbiased estimators (appendix A, eq. A.2) are

    |G|^2  = (B |G_big|^2 - b |G_small|^2) / (B - b)
    tr(S)  = (|G_small|^2 - |G_big|^2) / (1/b - 1/B)

where S is the per-sample covariance of the gradient. Each is smoothed by an exponential moving
average (weight ``noise_ema`` on the past; the first value starts it) before dividing, because
single estimates are noisy and the ratio of noisy estimates is biased:

    B_simple = EMA[tr(S)] / EMA[|G|^2]     (samples)

b is the rank's ``batch`` (samples this step, summed over gradient-accumulation micro-steps; the
agent infers it from the model input's first dimension unless ``batch_size`` is set), so a rank's
local gradient is over b samples whatever the accumulation. Scaling the loss (e.g. by 1/micro-
steps) scales both estimates alike and leaves B_simple unchanged. A round is used when the world
has at least two ranks, every reporting rank has the same known batch, and every norm is finite
(case C36); B = b * world size (the all-reduce averaged every rank of the world, reporting or not).
Under pipeline parallelism (ranks running different parts, ``RoundResult.part``) a rank's local
norm covers its stage only and the world is not the data-parallel degree: no data.
Never a finding: the outcome is healthy with a value once
``noise_min_rounds`` rounds were used and the smoothed |G|^2 is positive, else no data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from pydantic import Field

from . import Check, Evaluation, register


@dataclass
class _Noise:
    g2: float = math.nan  # EMA of the |G|^2 estimates
    trace: float = math.nan  # EMA of the tr(S) estimates
    rounds: int = 0
    last_step: int = -1


def estimates(local_sq_mean: float, global_sq: float, b: float, big: float) -> tuple[float, float]:
    """Unbiased (|G|^2, tr S) from the mean local squared norm over batches of ``b`` samples and
    the squared norm of their average over ``big`` samples (McCandlish et al. 2018, eq. A.2)."""
    g2 = (big * global_sq - b * local_sq_mean) / (big - b)
    trace = (local_sq_mean - global_sq) / (1.0 / b - 1.0 / big)
    return g2, trace


@register
class NoiseScale(Check):
    name = "noise_scale"
    severity = "info"
    description = (
        "Gradient noise scale B_simple = tr(Sigma) / |G|^2 (McCandlish et al. 2018, appendix A) from the ranks' "
        "local gradient norms (batch b each) and the all-reduced one (batch b x world size) at probed steps, "
        "both estimates smoothed by an EMA (noise_ema). A batch size far above B_simple wastes compute, far "
        "below wastes steps. Never a finding."
    )
    dashboard = "gradient_flow"

    class Thresholds(Check.Thresholds):
        noise_ema: float = Field(0.9, ge=0, lt=1, description="Smoothing of the exponential moving averages in the gradient noise scale.")
        noise_min_rounds: int = Field(5, ge=1, description="Probed steps before the gradient noise scale is reported.")

    metrics = {
        "job_gradient_noise_scale": ("Gradient noise scale B_simple, samples: EMA of tr(Sigma) over EMA of |G|^2.", (), ""),
        "job_gradient_noise_g2": ("EMA of the unbiased estimate of the squared norm of the true gradient, |G|^2.", (), ""),
        "job_gradient_noise_trace": ("EMA of the unbiased estimate of the trace of the per-sample gradient covariance, tr(Sigma).", (), ""),
    }

    per_job = _Noise

    def on_round(self, job, r):
        st = self.state(job.job)
        if r.step <= st.last_step:
            return None
        st.last_step = r.step
        part = getattr(r, "part", None)
        if part is not None and len(part) and (part != part[0]).any():
            return Evaluation.no_data()  # pipeline stages: not every rank is a replica of the whole model
        batch = np.asarray(r.batch)
        local = np.asarray(r.local_grad_norm, np.float64)
        glob = np.asarray(r.grad_norm, np.float64)
        if job.world >= 2 and len(batch) > 0 and batch[0] > 0 and (batch == batch[0]).all():
            b = float(batch[0])
            with np.errstate(over="ignore", invalid="ignore"):  # a norm past 1.3e154 squares to Inf: no estimate
                g2, trace = estimates(float(np.mean(local**2)), float(np.median(glob) ** 2), b, b * job.world)
            if math.isfinite(g2) and math.isfinite(trace):  # a NaN or Inf norm never enters an EMA (C36)
                a = self.t.noise_ema
                st.g2 = g2 if st.rounds == 0 else a * st.g2 + (1 - a) * g2
                st.trace = trace if st.rounds == 0 else a * st.trace + (1 - a) * trace
                st.rounds += 1
        return Evaluation.healthy() if self._scale(st) is not None else Evaluation.no_data()

    def _scale(self, st: _Noise):
        if st.rounds < self.t.noise_min_rounds or not st.g2 > 0:
            return None
        return st.trace / st.g2

    def values(self, job_id):
        st = self.kept(job_id)
        if st is None or st.rounds < self.t.noise_min_rounds:
            return {}
        out = {"job_gradient_noise_g2": {(): st.g2}, "job_gradient_noise_trace": {(): st.trace}}
        s = self._scale(st)
        if s is not None:
            out["job_gradient_noise_scale"] = {(): s}
        return out
