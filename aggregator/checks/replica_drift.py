"""Replicas must stay identical: each parameter's weights after the optimizer step, bit for bit."""

from __future__ import annotations

from . import register
from .grad_agreement import _Agreement


@register
class ReplicaDrift(_Agreement):
    name = "replica_drift"
    severity = "critical"
    description = (
        "Compares each parameter's weight fingerprint across ranks after the optimizer step at every "
        "probed step (Megatron-LM does this with SHA-1 on the CPU every 20,000 iterations). Names the "
        "replica that drifted from the majority and its parameters (silent data corruption, a "
        "non-deterministic optimizer, a missed broadcast)."
    )
    dashboard = "consistency"
    fingerprints = ("fp_weight", "fp_weight_seen")
    what = "weights"
