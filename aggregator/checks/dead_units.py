"""Dead units: an activation layer whose output is (almost) all exact zeros, probe after probe.

A unit is dead when its output is exactly zero for every input *and* its gradient there is zero,
so it never learns its way back. The agent measures each layer's zero ratio: the fraction of
output elements that are exactly 0. The layers judged are the leaf modules whose type produces
exact zeros with a zero gradient over a whole input region:

* ``ReLU``, ``ReLU6``: 0 (gradient 0) for inputs <= 0;
* ``Threshold``: its ``value`` (gradient 0) at or below its threshold: zeros when value is 0,
  otherwise no zeros at all, so the ratio stays low and it is never named;
* ``Hardsigmoid``, ``Hardswish``: 0 (gradient 0) for inputs <= -3;
* ``Hardshrink``, ``Softshrink``: 0 (gradient 0) for inputs within [-lambda, lambda];
* ``GELU``, ``SiLU``, ``Mish`` (the transformers' activations): smooth, but their tails round to
  an exact 0 below an input of about -5.5 (GELU: its gradient there at most 5e-7, exactly 0 below
  about -6.2), -5.06 (GELU with ``approximate="tanh"``), -88.7 (SiLU; -20.3 in float16) and -102.9
  (Mish; -97.5 in bfloat16, -20.3 in float16), the gradient 0 there but in GELU's band; measured
  with torch 2.13 on the CPU. A live layer's inputs rarely reach so far, so its zero ratio stays
  near 0; a bias pushed far negative puts its units there for good. (Adam can amplify the tiny
  gradient of GELU's band, so a unit just inside it may yet recover: the finding says what is
  measured, a layer whose output was all zeros probe after probe.)

Left out: ``LeakyReLU``, ``PReLU``, ``RReLU``, ``ELU``, ``CELU``, ``SELU`` (no exact zeros: a
negative slope or a tail towards a negative constant keeps the output, and the gradient, alive),
``Hardtanh`` (it saturates at ``min_val``, -1 by default, not at 0, so the zero ratio cannot see
it), ``Dropout`` (zeros by design). An activation applied functionally (``F.relu`` inside another
module's forward) has no layer of its own and is not seen.

A layer is named when the median over ranks of its zero ratio exceeds ``dead_ratio`` at
``dead_probes`` consecutive probed steps that observed it (a probe that did not run the layer
neither counts nor breaks the run; a non-finite ratio breaks it). The ratio is per layer, not per
unit: a few dead units among many live ones are invisible; a layer above 0.99 is one whose units
are almost all dead. At most ``max_layers`` layers are named, the highest ratios first. A finding
resolves at the first probe where the layer's ratio is back at or below ``dead_ratio``. No layer of
these types in the model: no data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pydantic import Field

from gradwatch import columns

from . import Check, Evaluation, Finding, register

#: leaf module types that are exactly 0, with a zero gradient, over a whole input region
PIECEWISE_TYPES = ("ReLU", "ReLU6", "Threshold", "Hardsigmoid", "Hardswish", "Hardshrink", "Softshrink")
#: smooth activations whose tails round to exact zeros (see the module docstring)
TAIL_TYPES = ("GELU", "SiLU", "Mish")
#: the leaf module types judged
DEAD_TYPES = frozenset(PIECEWISE_TYPES + TAIL_TYPES)

_ACT = columns.at("act")
#: the row of the zero ratio aggregated over ranks that holds their median
_MEDIAN = columns.named("activation_zero_ratio").aggs.index("median")


@dataclass
class _Dead:
    streak: dict = field(default_factory=dict)  # layer -> (consecutive probes above, first step of the run)
    last_step: int = -1


@register
class DeadUnits(Check):
    name = "dead_units"
    severity = "warning"
    description = (
        f"Zero ratio of activation layer outputs ({', '.join(PIECEWISE_TYPES)}, and {', '.join(TAIL_TYPES)}, "
        "whose tails round to exact zeros: exact zeros with zero gradient), median over ranks, above dead_ratio for "
        "dead_probes consecutive probed steps: the layer's units are dead. Names at most max_layers layers."
    )
    dashboard = "gradient_flow"

    class Thresholds(Check.Thresholds):
        dead_ratio: float = Field(0.99, gt=0, le=1, description="Zero ratio of an activation layer's output (of the types judged) above which its units are dead.")
        dead_probes: int = Field(3, ge=1, description="Consecutive probed steps a layer must look dead before it is named.")

    per_job = _Dead

    def on_round(self, job, r):
        st = self.state(job.job)
        if r.step <= st.last_step:
            return None
        st.last_step = r.step
        values, observed = r.agg["activation_zero_ratio"]
        judged = False
        dead = []
        for i, (layer, typ) in enumerate(zip(r.layers, r.layer_types)):
            if typ not in DEAD_TYPES:
                continue
            judged = True
            if not observed[i]:
                continue
            ratio = float(values[_MEDIAN, i])
            if math.isfinite(ratio) and ratio > self.t.dead_ratio:
                n, first = st.streak.get(layer, (0, r.step))
                st.streak[layer] = (n + 1, first)
                if n + 1 >= self.t.dead_probes:
                    dead.append((ratio, i, layer, typ, n + 1, first))
            else:
                st.streak.pop(layer, None)
        if not judged:
            return Evaluation.no_data()
        dead.sort(key=lambda x: (-x[0], x[1]))
        findings = []
        for ratio, i, layer, typ, n, first in dead[: self.t.max_layers]:
            per_rank = {rk: float(r.act[k, i, _ACT.zero_ratio]) for k, rk in enumerate(r.ranks)}
            findings.append(Finding(
                self.name, job.job, first,
                f"layer {layer} ({typ}) looks dead: {ratio:.1%} of its outputs are exactly zero (median over ranks) "
                f"at {n} consecutive probed steps since step {first}",
                layer=layer,
                details={"zero_ratio": ratio, "zero_ratio_per_rank": per_rank, "probes": n, "type": typ,
                         "probed_step": r.step, "layers_dead": len(dead)},
            ))
        return Evaluation.found(*findings)
