"""Vanishing gradients: the global gradient norm below ``vanish_below``.

The gradient-norm checks' machinery (:class:`.explosion.GradientNorms`: steps lined up across
ranks, findings that last ``spike_window`` steps past the last bad step) judging one kind of
trouble, so alerts and dashboards can tell a vanishing job from an exploding one by the check's
name alone. Per-layer norms are judged for explosion only.
"""

from __future__ import annotations

from pydantic import Field

from . import register
from .explosion import GradientNorms, NormThresholds


@register
class Vanishing(GradientNorms):
    name = "vanishing"
    severity = "warning"
    description = (
        "Global gradient norm (after all-reduce) every step against vanish_below: the model has stopped "
        "learning (a learning rate at zero, a frozen model, a loss that no longer depends on the "
        "parameters, saturated activations). Names no rank. A finding lasts spike_window steps past the "
        "last step below the threshold."
    )

    class Thresholds(NormThresholds):
        vanish_below: float = Field(1e-8, ge=0, description="Global gradient norm below which gradients are vanishing.")

    kinds = frozenset({"vanish"})
