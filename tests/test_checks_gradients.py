"""The gradient checks: explosion (vanishing, spikes), nonfinite (provenance), noise_scale, dead_units.

(a) Each check as a pure function of recorded traffic: wire messages (encoded and decoded, as the
    aggregator receives them) fed into a real :class:`State` with a real checks :class:`Runner`
    on a fake clock.
(b) Fault injection on real gloo DDP jobs (``gradwatch demo``, 3 ranks) against a real aggregator
    process: explode and nan faults give the findings they should, a clean run gives none.
(c) The gradient noise scale of a real 3-rank DDP job with agents, against a brute-force value
    from every per-sample gradient of the dataset.
"""

from __future__ import annotations

from types import SimpleNamespace
import concurrent.futures
import json
import math
import os
import time

import numpy as np
import pytest
import requests

from gradwatch import wire
from gradwatch.aggregator.runner import Event, json_safe
from gradwatch.aggregator.checks.nonfinite import HOLD_S
from gradwatch.aggregator.exporter import SnapshotCollector
from gradwatch.aggregator.snapshot import snapshot

from .conftest import free_port, run_demo, samples, start_aggregator, wait_for
from .fakejob import HEADED, LocalJob, Model

MINE = ("explosion", "vanishing", "nonfinite", "noise_scale", "dead_units")
JOB = "unit"
MODEL = HEADED
PARAMS, SLOTS = MODEL.params, MODEL.slots
LAYERS = ("emb", "fc1", "act", "fc2", "head")  # forward order
PIDX = {p[0]: i for i, p in enumerate(PARAMS)}
NAN, INF = float("nan"), float("inf")


def probe(**rows) -> dict:
    """Healthy probe arrays; ``rows`` overrides, e.g. ``act={"fc1": {5: 3}}`` (layer -> column -> value),
    ``param={"fc1.weight": {0: 5e3}}``."""
    act = np.tile(np.float32([0.0, 1.0, -2.0, 2.0, 0.1, 0.0]), (len(SLOTS), 1))
    act_grad = np.tile(np.float32([1.0, 0.0]), (len(SLOTS), 1))
    param = np.tile(np.float32([1.0, 1.0, 0.0]), (len(PARAMS), 1))
    for name, arr, index in (("act", act, LAYERS), ("act_grad", act_grad, LAYERS), ("param", param, list(PIDX))):
        for row, cols in rows.get(name, {}).items():
            for col, v in cols.items():
                arr[index.index(row), col] = v
    return {"act": act, "act_grad": act_grad, "param": param}


class Job(LocalJob):
    """``world`` fake ranks of job :data:`JOB` reporting to a real State and checks Runner on a
    fake clock (:class:`~tests.fakejob.LocalJob`), every message through ``wire.encode`` and
    ``wire.decode``; each rank has sent its schema (of ``slots``)."""

    def __init__(self, checks=MINE, world: int = 3, slots=SLOTS, **thresholds):
        super().__init__(checks, thresholds, state={"grace_s": 10.0}, job=JOB, world=world, model=Model(PARAMS, slots),
                         every=10, clock=lambda: 0.0, boots=[f"boot{r}" for r in range(world)])
        self.schema()

    def report(self, rank, step, grad_norm=1.0, local=1.0, nonfinite=0, arrays=None, batch=0, norms=None, guard=None):
        extra = {} if guard is None else {"nonfinite_slot": guard}
        if arrays is not None:
            n = len(PARAMS)
            extra = dict(probe=True, fp_grad=np.zeros(n, np.uint64), fp_weight=np.zeros(n, np.uint64), **arrays)
        if norms is not None:  # per-parameter gradient norms (wire grad_norms), PARAMS order
            extra["grad_norms"] = np.asarray(norms, np.float32)
        super().report(rank, step, grad_norm, nonfinite, step_time=0.01, local_grad_norm=local, batch=batch, **extra)

    def step(self, step, grad_norm=1.0, locals=None, nonfinite=0, arrays=None, batch=0, ranks=None, norms=None,
             guards=None):
        """Every rank (or ``ranks``) reports ``step``; ``arrays``: one dict for all or a list per rank;
        ``norms``: every rank's per-parameter gradient norms (the same after all-reduce);
        ``guards``: each rank's NaN guard slot (wire ``nonfinite_slot``, None: no guard)."""
        for r in ranks if ranks is not None else range(self.world):
            a = arrays[r] if isinstance(arrays, list) else arrays
            local = locals[r] if locals is not None else 1.0
            self.report(r, step, grad_norm, local, nonfinite, a, batch, norms, guards[r] if guards is not None else None)

    def tick(self, dt: float = 0.1) -> None:
        super().tick(dt)

    def events(self, check: str) -> list[tuple]:
        assert not self.runner.errors, self.runner.errors  # a check that raised is only counted
        return [(e.event, e.step, e.rank, e.layer) for e in self.runner.events if e.check == check]

    def active(self, check: str) -> list:
        return sorted(self.runner.active.get((JOB, check), {}).values(), key=lambda f: (str(f.rank), str(f.layer)))

    def status(self, check: str) -> str:
        return self.runner.status[(JOB, check)].value


# --- (a) explosion -----------------------------------------------------------------------------------


def test_explosion_global_explode_and_spike_once_per_step_naming_largest_local_norm_then_resolves_after_window():
    job = Job(["explosion"], spike_window=20)
    for s in range(10):
        job.step(s, 1.0 + 0.01 * s, locals=[1.1, 1.2, 1.0])
    job.step(10, 5e3, locals=[2.0, 1.5e4, 3.0], ranks=[0, 1])
    assert job.events("explosion") == []  # the step waits for its third rank
    job.step(10, 5e3, locals=[2.0, 1.5e4, 3.0], ranks=[2])
    assert job.events("explosion") == [("raised", 10, 1, None)]
    (f,) = job.active("explosion")
    assert f.details["kinds"] == ["explode", "spike"]
    assert f.details["episode"]["spike"]["median"] == pytest.approx(1.045)
    assert "rank 1" in f.summary and "5e+03" in f.summary
    assert job.runner.checks["explosion"].values(JOB)["job_grad_norm_median"][()] == pytest.approx(1.05)

    for s in range(11, 30):  # active for spike_window steps after the bad one
        job.step(s, 1.0, locals=[1.0, 1.0, 1.0])
    assert job.events("explosion") == [("raised", 10, 1, None)]
    job.step(30, 1.0, locals=[1.0, 1.0, 1.0])
    assert job.events("explosion") == [("raised", 10, 1, None), ("resolved", 10, 1, None)]
    assert job.status("explosion") == "healthy"


@pytest.mark.parametrize(
    "history, norm, kinds",
    [
        (6, 9.5, None),  # below spike_factor (10) x median 1.0
        (6, 10.5, ["spike"]),  # above it, far below explode_above
        (3, 50.0, None),  # too little history for a median (spike_min_history 5)
        (6, 2e3, ["explode", "spike"]),
    ],
)
def test_explosion_spike_is_a_factor_of_the_rolling_median(history, norm, kinds):
    job = Job(["explosion"])
    for s in range(history):
        job.step(s, 1.0)
    job.step(history, norm, locals=[1.0, 1.0, 5.0])  # the local norms' mean (2.3x) spikes not
    if kinds is None:
        assert job.events("explosion") == []
    else:
        assert job.events("explosion") == [("raised", history, 2, None)]
        assert job.active("explosion")[0].details["kinds"] == kinds


def test_under_gradient_clipping_a_blow_up_is_found_from_the_local_norms_naming_its_rank():
    """clip_grad_norm_ caps the global norm the agent measures at the optimizer step: a rank's 1e6x
    loss blow-up reads as a norm at the clip, and would raise no finding. The local norms,
    taken during backward before any clipping, spike: one finding, naming the rank, from the step
    it happened; a healthy job's local norms, jittering and never clipped, raise none."""
    rng = np.random.default_rng(5)
    job = Job(["explosion", "vanishing"], spike_window=20)
    for s in range(60):  # clipped at 1.0 every step, local norms log-normal around 3 (their batches' noise)
        job.step(s, 1.0, locals=(3.0 * rng.lognormal(0.0, 0.5, 3)).tolist())
    assert job.events("explosion") == [] and job.events("vanishing") == []
    job.step(60, 1.0, locals=[3.1, 2.5e6, 2.9])
    assert job.events("explosion") == [("raised", 60, 1, None)]
    (f,) = job.active("explosion")
    assert f.details["kinds"] == ["spike"] and f.details["source_rank"] == 1
    spike = f.details["episode"]["spike"]
    assert spike["local"] == pytest.approx((3.1 + 2.5e6 + 2.9) / 3) and spike["factor"] > 1e5
    assert "clipped?" in f.summary and "local norms before all-reduce" in f.summary and "rank 1" in f.summary
    for s in range(61, 81):  # the blow-up's step leaves the window's median alone: back in line
        job.step(s, 1.0, locals=(3.0 * rng.lognormal(0.0, 0.5, 3)).tolist())
    assert job.events("explosion") == [("raised", 60, 1, None), ("resolved", 60, 1, None)]
    assert job.events("vanishing") == []  # it judges the global norm alone


def test_local_norms_without_a_global_norm_or_a_history_judge_nothing():
    """Local norms spike only against their own rolling median (spike_min_history steps of it), and
    only at steps the global norm can be judged (a NaN there is the nonfinite check's)."""
    job = Job(["explosion"])
    for s in range(4):  # too little history
        job.step(s, 1.0, locals=[1.0, 1.0, 1.0])
    job.step(4, 1.0, locals=[1.0, 500.0, 1.0])
    job.step(5, float("nan"), locals=[1.0, 500.0, 1.0])
    job.step(6, 1.0, locals=[float("nan")] * 3)  # no local norms (no DDP hook)
    assert job.events("explosion") == []


def test_vanishing_is_its_own_check_and_names_no_rank():
    job = Job(["explosion", "vanishing"])
    for s in range(3):
        job.step(s, 1e-9)
    assert job.events("vanishing") == [("raised", 0, None, None)]
    assert job.active("vanishing")[0].details["kinds"] == ["vanish"]
    assert job.events("explosion") == []  # explosion judges explode and spike only


def test_explosion_lost_report_step_evaluated_after_wait_with_the_ranks_that_reported():
    job = Job(["explosion"])
    for s in range(6):
        job.step(s, 1.0)
    job.step(6, 5e3, locals=[1.0, 9e3, 1.0], ranks=[0, 1])  # rank 2's report is lost
    job.tick(0.1)
    job.tick(1.0)
    assert job.events("explosion") == []
    job.tick(1.5)  # _steps.WAIT_S = 2 s after it was first seen
    assert job.events("explosion") == [("raised", 6, 1, None)]
    assert job.active("explosion")[0].details["ranks_reporting"] == 2


def test_explosion_per_layer_names_at_most_max_layers_worst_layers():
    job = Job(["explosion"], max_layers=2)
    grads = {"emb.weight": {0: 2e3}, "fc1.weight": {0: 8e3}, "fc2.weight": {0: 5e3}, "head.weight": {0: 1.5e3}}
    job.step(0, 1.0, arrays=probe(param=grads))
    # one fault, one finding (not one per layer): named by its worst layer, listing the worst max_layers
    assert job.events("explosion") == [("raised", 0, None, "fc1")]
    (f,) = job.active("explosion")
    assert list(f.details["layers"]) == ["fc1", "fc2"]
    assert f.details["layers"]["fc1"]["grad_norm"] == pytest.approx(math.hypot(8e3, 1.0))  # weight and bias


def test_explosion_one_fault_one_finding_layers_and_knock_on_folded_in_never_another_rank():
    """An explosion on rank 1 at step 10 seen globally and in three layers at the probe, then a
    knock-on spike at step 17 where rank 0's local norm is the largest: one finding naming rank 1,
    carrying the layers, both source ranks and the latest bad step; it resolves spike_window steps
    after the knock-on."""
    job = Job(["explosion"], spike_window=20)
    for s in range(10):
        job.step(s, 1.0, locals=[1.0, 1.1, 0.9], arrays=probe() if s % 5 == 0 else None)
    blown = {"emb.weight": {0: 2e3}, "fc1.weight": {0: 8e3}, "fc2.weight": {0: 5e3}}
    job.step(10, 9e3, locals=[1.0, 2.7e4, 1.0], arrays=probe(param=blown))
    for s in range(11, 17):
        job.step(s, 1.0, locals=[1.0, 1.0, 1.0])
    job.step(17, 30.0, locals=[60.0, 2.0, 1.0])  # knock-on: a spike, rank 0's local norm largest
    assert job.events("explosion") == [("raised", 10, 1, None)]
    (f,) = job.active("explosion")
    d = f.details
    assert (f.rank, f.step, d["first_step"], d["last_bad_step"]) == (1, 10, 10, 17)
    assert set(d["layers"]) == {"emb", "fc1", "fc2"} and d["layers"]["fc1"]["step"] == 10
    assert d["source_ranks"] == {"1": 10, "0": 17} and d["kinds"] == ["explode", "spike"]
    assert d["episode"]["spike"]["step"] == 17 and d["local_grad_norms"][1] == 2.7e4  # the first step's evidence
    assert "rank 1" in f.summary and "rank 0" not in f.summary and "up to step 17" in f.summary
    for s in range(18, 37):
        job.step(s, 1.0, locals=[1.0, 1.0, 1.0])
    assert job.events("explosion") == [("raised", 10, 1, None)]
    job.step(37, 1.0, locals=[1.0, 1.0, 1.0])
    assert job.events("explosion") == [("raised", 10, 1, None), ("resolved", 10, 1, None)]


def test_explosion_per_layer_spike_against_the_layers_own_probed_median():
    job = Job(["explosion"])
    for s in range(0, 60, 10):
        job.step(s, 1.0, arrays=probe())
    job.step(60, 1.0, arrays=probe(param={"fc2.weight": {0: 30.0}}))
    assert job.events("explosion") == [("raised", 60, None, "fc2")]
    assert job.active("explosion")[0].details["kinds"] == ["spike"]


# --- (a) nonfinite provenance ----------------------------------------------------------------------

# step 5 on rank 1: every rank's all-reduced gradient is NaN; only rank 1's local norm is
ALL_GRADS_NAN = {p: {0: NAN, 2: 4} for p in PIDX}
WEIGHTS_NAN = {p: {1: NAN} for p in PIDX}


def _merge(*dicts):
    out = {}
    for d in dicts:
        for k, v in d.items():
            out.setdefault(k, {}).update(v)
    return out


PROVENANCE = {
    # forward: fc1's output is NaN and everything after it; backward and the optimizer follow
    "activation": (
        dict(act={l: {5: 8} for l in LAYERS[1:]}, act_grad={l: {0: NAN, 1: 8} for l in LAYERS},
             param=_merge(ALL_GRADS_NAN, WEIGHTS_NAN)),
        "fc1", "activation",
    ),
    # forward clean; the output gradients of emb, fc1, fc2 are NaN: backward met it first at fc2
    "output_gradient": (
        dict(act_grad={l: {0: NAN, 1: 8} for l in ("emb", "fc1", "fc2")}, param=_merge(ALL_GRADS_NAN, WEIGHTS_NAN)),
        "fc2", "output_gradient",
    ),
    # activations and output gradients clean; fc1's and fc2's parameter gradients are not
    "parameter_gradient": (
        dict(param=_merge({"fc1.weight": {0: NAN, 2: 1}, "fc2.weight": {0: INF, 2: 1}}, WEIGHTS_NAN)),
        "fc2", "parameter_gradient",
    ),
    "weight": (dict(param={"fc2.weight": {1: NAN}}), "fc2", "weight"),
}


@pytest.mark.parametrize("case", PROVENANCE)
def test_nonfinite_provenance_pass_order_on_the_origin_rank_from_local_norms(case):
    rank1, module, pass_ = PROVENANCE[case]
    job = Job(["nonfinite"])
    for s in range(5):
        job.step(s, 1.0, locals=[1.0, 1.1, 0.9])
    others = probe(param=_merge(ALL_GRADS_NAN, WEIGHTS_NAN))
    job.step(5, NAN, locals=[1.0, NAN, 0.9], nonfinite=5, arrays=[others, probe(**rank1), others])
    assert job.events("nonfinite") == [("raised", 5, 1, module)]
    (f,) = job.active("nonfinite")
    assert (f.details["pass"], f.details["module"], f.details["probed_step"]) == (pass_, module, 5)
    assert f.details["origin_ranks"] == [1] and f.details["where"] == "local"
    for s in range(6, 9):  # NaN from now on everywhere: one finding, kept active, no flapping
        job.step(s, NAN, locals=[NAN, NAN, NAN], nonfinite=5, arrays=probe(param=_merge(ALL_GRADS_NAN, WEIGHTS_NAN)))
        job.tick(3.0)
    assert job.events("nonfinite") == [("raised", 5, 1, module)]
    assert job.status("nonfinite") == "finding"
    json.loads(Event("raised", 0, "nonfinite", "critical", JOB, 5, 1, module, f.summary, json_safe(f.details)).to_json())


def test_nonfinite_unprobed_event_then_probe_with_nonfinite_weights_cannot_be_located():
    job = Job(["nonfinite"])
    for s in range(5):
        job.step(s, 1.0, locals=[1.0, 1.1, 0.9])
    job.step(5, NAN, locals=[1.0, NAN, 0.9], nonfinite=5)  # not probed
    job.step(6, NAN, locals=[NAN, NAN, NAN], nonfinite=5)
    assert job.events("nonfinite") == []  # waiting for a probed step to locate it
    everything = probe(act={l: {5: 8} for l in LAYERS}, act_grad={l: {0: NAN, 1: 8} for l in LAYERS},
                       param=_merge(ALL_GRADS_NAN, WEIGHTS_NAN))
    job.step(7, NAN, locals=[NAN, NAN, NAN], nonfinite=5, arrays=everything)  # the burst's first probe
    assert job.events("nonfinite") == [("raised", 5, 1, None)]
    (f,) = job.active("nonfinite")
    assert (f.details["pass"], f.details["module"], f.details["located"]) == ("weight", None, False)
    assert "cannot be located" in f.summary and f.details["probed_step"] == 7


# PARAMS order: emb.weight, fc1.weight, fc1.bias, fc2.weight, head.weight (fc1.bias frozen: NaN, no gradient)
BACKWARD_CASES = {
    # a NaN that came in at fc2's output gradient: fc2 and everything before it, head finite
    "entered at fc2": ([NAN, NAN, NAN, NAN, 0.5], "fc2"),
    # a forward NaN: no gradient stays finite, nothing to tell it by
    "forward": ([NAN, NAN, NAN, NAN, NAN], None),
    # emb stays finite under fc1's NaN: not the modules up to one in forward order (no module rather than a wrong one)
    "not a prefix in forward order": ([0.5, NAN, NAN, 0.5, 0.5], None),
}

# a model that registers fc1 before fc2 but runs fc2 first (forward: emb, fc2, act, fc1, head)
OUT_OF_ORDER = (SLOTS[0], SLOTS[3], SLOTS[2], SLOTS[1], SLOTS[4])
FORWARD_CASES = {
    # came in at fc2, the second module to run: emb and fc2 went, fc1 (registered between) stayed
    "entered at fc2": ([NAN, 1.0, NAN, NAN, 0.5], "fc2", "fc2.weight"),
    # came in at fc1, which runs after fc2: the same norms as fc2 in registration order would give
    "entered at fc1": ([NAN, NAN, NAN, NAN, 0.5], "fc1", "fc1.weight"),
}


@pytest.mark.parametrize("case", BACKWARD_CASES)
def test_nonfinite_unprobed_backward_nan_located_by_the_every_step_gradient_norms(case):
    """At an unprobed event step the per-parameter norms name the module a NaN came in at through
    the backward pass (the last whose gradient went non-finite, those after it finite), at once,
    without waiting for a probe; otherwise the finding waits for one, as without norms."""
    norms_at, module = BACKWARD_CASES[case]
    job = Job(["nonfinite"])
    finite = [1.0, 2.0, NAN, 3.0, 0.5]
    for s in range(5):
        job.step(s, 1.0, locals=[1.0, 1.1, 0.9], norms=finite)
    job.step(5, NAN, locals=[1.0, NAN, 0.9], nonfinite=4, norms=norms_at)  # not probed
    if module is None:
        assert job.events("nonfinite") == []  # waiting for a probed step, as without norms
        job.tick(0.1)
        job.tick(HOLD_S)
        assert job.events("nonfinite") == [("raised", 5, 1, None)]
        return
    assert job.events("nonfinite") == [("raised", 5, 1, module)]
    (f,) = job.active("nonfinite")
    d = f.details
    assert (d["pass"], d["module"], d["located"], d["from"], d["probed_step"]) == ("parameter_gradient", "fc2", True, "grad_norms", None)
    assert d["values"]["param"] == "fc2.weight" and (d["values"]["went_nonfinite"], d["values"]["stayed_finite"]) == (3, 1)
    assert "backward pass at fc2" in f.summary
    job.step(6, NAN, locals=[NAN] * 3, nonfinite=4, arrays=probe(param=_merge(ALL_GRADS_NAN, WEIGHTS_NAN)))
    assert job.events("nonfinite") == [("raised", 5, 1, "fc2")]  # a later probe changes nothing


@pytest.mark.parametrize("case", FORWARD_CASES)
def test_nonfinite_unprobed_backward_nan_located_in_forward_order_not_registration_order(case):
    """The schema's slots give forward order: a model whose modules run in another order than
    they were registered in is located by the order they ran in (registration order would name
    fc2 for a NaN that came in at fc1, and nothing for one at fc2)."""
    norms_at, module, param = FORWARD_CASES[case]
    job = Job(["nonfinite"], slots=OUT_OF_ORDER)
    for s in range(5):
        job.step(s, 1.0, locals=[1.0, 1.1, 0.9], norms=[1.0, 2.0, NAN, 3.0, 0.5])
    job.step(5, NAN, locals=[1.0, NAN, 0.9], nonfinite=4, norms=norms_at)  # not probed
    assert job.events("nonfinite") == [("raised", 5, 1, module)]
    (f,) = job.active("nonfinite")
    assert (f.details["module"], f.details["values"]["param"], f.details["from"]) == (module, param, "grad_norms")


@pytest.mark.parametrize("origin", [True, False], ids=["local-norms", "no-local-norms"])
def test_nonfinite_unprobed_forward_nan_located_by_the_nan_guard_at_its_step(origin):
    """At an unprobed event step the NaN guard's slot names the module whose output first held
    the NaN, pass activation, at once: the origin rank's (rank 2 also saw one, later in forward
    order: the all-reduce is after the forward); without local norms the rank the guard names."""
    job = Job(["nonfinite"])
    healthy = [1.0, 1.1, 0.9] if origin else [NAN] * 3
    for s in range(5):
        job.step(s, 1.0, locals=healthy, guards=[-1, -1, -1])
    all_nan = [NAN] * len(PARAMS)  # a forward NaN: no gradient stays finite, the norms cannot tell
    job.step(5, NAN, locals=[1.0, NAN, 0.9] if origin else [NAN] * 3, nonfinite=4, norms=all_nan,
             guards=[-1, LAYERS.index("fc2"), LAYERS.index("head")])  # not probed
    # rank 1 either way: the origin rank, or without local norms the lowest rank whose guard names a slot
    assert job.events("nonfinite") == [("raised", 5, 1, "fc2")]
    (f,) = job.active("nonfinite")
    d = f.details
    assert (d["pass"], d["module"], d["located"], d["from"], d["probed_step"]) == ("activation", "fc2", True, "guard", None)
    assert d["values"] == {"module": "fc2", "output": "", "slot": 3, "rank": 1}
    assert "made in the forward pass: the output of fc2" in f.summary
    job.step(6, NAN, locals=[NAN] * 3, nonfinite=4, arrays=probe(param=_merge(ALL_GRADS_NAN, WEIGHTS_NAN)))
    assert job.events("nonfinite") == [("raised", 5, 1, "fc2")]  # a later probe changes nothing


def test_nonfinite_the_gradient_norms_locating_a_backward_nan_outrank_the_guard():
    """A guard slot at the event step while some gradients stayed finite: the loss's forward pass
    was finite (a forward NaN on its path leaves no gradient finite), so the non-finite output was
    off that path and the backward NaN the norms locate is named."""
    job = Job(["nonfinite"])
    finite = [1.0, 2.0, NAN, 3.0, 0.5]
    for s in range(5):
        job.step(s, 1.0, locals=[1.0, 1.1, 0.9], norms=finite, guards=[-1] * 3)
    job.step(5, NAN, locals=[1.0, NAN, 0.9], nonfinite=4, norms=[NAN, NAN, NAN, NAN, 0.5],
             guards=[-1, LAYERS.index("emb"), -1])
    assert job.events("nonfinite") == [("raised", 5, 1, "fc2")]
    (f,) = job.active("nonfinite")
    assert (f.details["from"], f.details["pass"]) == ("grad_norms", "parameter_gradient")


def test_nonfinite_a_guard_naming_the_rank_says_so_without_local_norms():
    job = Job(["nonfinite"], world=2)
    for s in range(3):
        job.step(s, 1.0, locals=[NAN, NAN], guards=[-1, -1])
    job.step(3, NAN, locals=[NAN, NAN], nonfinite=4, guards=[-1, LAYERS.index("act")])
    (f,) = job.active("nonfinite")
    assert (f.rank, f.layer) == (1, "act") and "on rank 1 (seen in its NaN guard; no local gradient norms)" in f.summary


def test_nonfinite_guard_slot_outside_the_schema_or_of_an_unknown_schema_is_left_out():
    """A slot the rank's schema does not list, or a schema the aggregator does not hold, names
    nothing: the finding waits for a probed step as without the guard."""
    from gradwatch.aggregator.checks.nonfinite import guarded

    schemas = {"h": SimpleNamespace(slots=SLOTS)}
    assert guarded(schemas, {0: ("h", len(SLOTS))}, []) is None  # past the known schema's slots
    assert guarded(schemas, {0: ("h", -1)}, []) is None
    assert guarded(schemas, {0: ("other", 1)}, []) is None
    assert guarded(schemas, {0: ("other", 1), 2: ("h", 1)}, [0])["rank"] == 2  # the next rank that can tell
    job = Job(["nonfinite"], world=2)
    for s in range(3):
        job.step(s, 1.0, locals=[1.0, 1.0])
    # rank 0 claims a slot its schema does not list (the decoder only bounds it by a known schema)
    job.state.apply(wire.Report(job.header(0), "feedfacefeedface", 3, 0.01, NAN, 4, local_grad_norm=NAN, nonfinite_slot=2))
    job.report(1, 3, NAN, NAN, 4, guard=-1)
    job.tick(0.1)
    assert job.events("nonfinite") == []  # waiting for a probe: nothing the guard said can be named
    job.tick(HOLD_S)
    ((_, step, rank, layer),) = job.events("nonfinite")
    assert (step, layer) == (3, None)


@pytest.mark.parametrize(
    "locals_before, locals_at, grad_norm, rank, where",
    [
        ([NAN] * 3, [NAN] * 3, NAN, None, "unknown"),  # no DDP hook: NaN local norms mean unknown
        ([1.0] * 3, [1.0, 2.0, 1.5], INF, None, "all-reduce"),  # finite locals, infinite reduction
        ([1.0] * 3, [1.0, INF, 1.5], INF, 1, "local"),
        ([1.0] * 3, [1.0, NAN, 1.5], NAN, 1, "local"),  # a NaN local norm that the all-reduce spread
    ],
)
def test_nonfinite_origin_rank_only_from_local_norms_and_raised_after_hold_without_probes(
    locals_before, locals_at, grad_norm, rank, where
):
    job = Job(["nonfinite"])
    for s in range(3):
        job.step(s, 1.0, locals=locals_before)
    job.step(3, grad_norm, locals=locals_at, nonfinite=2)
    job.tick(0.1)
    assert job.events("nonfinite") == []
    job.tick(HOLD_S)
    assert job.events("nonfinite") == [("raised", 3, rank, None)]
    (f,) = job.active("nonfinite")
    assert f.details["where"] == where and f.details["located"] is False
    assert "not located" in f.summary


@pytest.mark.parametrize("local", [NAN, INF])
def test_nonfinite_a_local_norm_beside_a_finite_all_reduced_gradient_is_not_an_event(local):
    """A NaN or Inf spreads through the all-reduce, so a non-finite local norm beside a finite
    all-reduced gradient is no NaN/Inf in the gradients: neither is an event. NaN: a rank's
    communication hook switched off after errors (a sparse bucket it could not read) leaves its
    local norm NaN from then on, after finite ones: not measured. Inf: a GradScaler whose scale grew
    past ~2^60 on gradients that never overflow (bf16 autocast, float32 master gradients): the DDP
    hook's float32 sum of squares of the scaled bucket overflows.
    A real Inf in a rank's gradient still names it (the origin test above)."""
    job = Job(["nonfinite"])
    for s in range(3):
        job.step(s, 1.0, locals=[1.0, 1.2, 0.9])
    for s in range(3, 8):
        job.step(s, 1.0, locals=[local] * 3, nonfinite=0)
    job.tick(0.1)
    job.tick(HOLD_S)
    assert job.events("nonfinite") == [] and job.status("nonfinite") == "healthy"


def test_nonfinite_step_without_gradients_is_not_an_event():
    job = Job(["nonfinite"])
    job.step(0, 1.0)
    job.step(1, NAN, locals=[NAN] * 3, nonfinite=0)  # optimizer.step() with no gradient at all
    job.tick(0.1)
    job.tick(HOLD_S)
    assert job.events("nonfinite") == [] and job.status("nonfinite") == "healthy"


# --- (a) dead units ----------------------------------------------------------------------------------


def test_dead_units_named_after_dead_probes_consecutive_probes_median_over_ranks_only():
    job = Job(["dead_units"], dead_probes=3)
    dead = probe(act={"act": {4: 0.995}, "fc1": {4: 1.0}})  # a Linear's zero ratio is never judged
    alive = probe(act={"act": {4: 0.5}})
    plan = [dead, dead, alive, dead, dead]  # the third probe breaks the run
    for i, arrays in enumerate(plan):
        job.step(10 * i, arrays=arrays)
    assert job.events("dead_units") == []
    assert job.status("dead_units") == "healthy"
    job.step(50, arrays=dead)
    assert job.events("dead_units") == [("raised", 30, None, "act")]
    assert job.active("dead_units")[0].details["probes"] == 3
    # one rank at 1.0, two at 0.2: the median rank is alive
    job.step(60, arrays=[probe(act={"act": {4: 1.0}}), probe(act={"act": {4: 0.2}}), probe(act={"act": {4: 0.2}})])
    assert job.events("dead_units") == [("raised", 30, None, "act"), ("resolved", 30, None, "act")]


@pytest.mark.parametrize("typ,judged", [("GELU", True), ("SiLU", True), ("Mish", True), ("LeakyReLU", False),
                                         ("ELU", False), ("Hardtanh", False), ("Dropout", False)])
def test_dead_units_judges_the_activations_whose_tails_round_to_exact_zeros(typ, judged):
    """GELU, SiLU and Mish round to an exact 0 far in their negative tails (the transformers'
    activations: a dead GELU layer is judged, not no_data); activations with a negative slope or
    constant, Hardtanh and Dropout are not judged."""
    slots = tuple((m, o, typ if t == "ReLU" else t, d) for m, o, t, d in SLOTS)
    job = Job(["dead_units"], slots=slots, dead_probes=1)
    job.step(0, arrays=probe(act={"act": {4: 1.0}}))
    if judged:
        assert job.status("dead_units") == "finding" and job.events("dead_units") == [("raised", 0, None, "act")]
    else:
        assert job.status("dead_units") == "no_data" and job.events("dead_units") == []


def test_the_judged_activations_tails_are_exact_zeros_with_zero_gradient():
    """The premise of the list above, measured from the edge of each tail on: GELU, its tanh form,
    SiLU and Mish give exactly 0 in float32 and bfloat16 (and float16, where it has the range),
    with a gradient of at most 6e-7 (GELU's band down to -6.2) and exactly 0 beyond."""
    import torch

    cases = [(torch.nn.GELU(), 5.6, 6.2), (torch.nn.GELU("tanh"), 5.07, 5.07), (torch.nn.SiLU(), 88.8, 88.8),
             (torch.nn.Mish(), 103.0, 103.0)]
    x = -torch.cat([torch.linspace(5.0, 7.0, 201), torch.tensor([10.0, 50.0, 89.0, 110.0, 1e3])])
    for f, edge, flat in cases:
        for dtype in (torch.float32, torch.bfloat16):
            xx = x[x <= -edge].to(dtype).requires_grad_()
            y = f(xx)
            y.sum().backward()
            assert (y == 0).all() and xx.grad.abs().max().item() <= 6e-7, (f, dtype)
            assert (xx.grad[xx.detach() <= -flat] == 0).all(), (f, dtype)
            assert f(torch.tensor([-1.0], dtype=dtype)).item() != 0  # no zero where a live unit works


# --- (a) noise scale ---------------------------------------------------------------------------------


def test_noise_scale_unbiased_estimators_recover_b_simple_and_skip_nonfinite_rounds():
    g2, trace, b, world = 4.0, 200.0, 8, 4  # B_simple = 50
    local = math.sqrt(g2 + trace / b)  # E|G_small|^2 = |G|^2 + tr(S)/b
    glob = math.sqrt(g2 + trace / (b * world))
    job = Job(["noise_scale"], world=world, noise_min_rounds=5)
    noise = job.runner.checks["noise_scale"]
    for i in range(4):
        job.step(10 * i, glob, locals=[local] * world, arrays=probe(), batch=b)
    assert job.status("noise_scale") == "no_data" and noise.values(JOB) == {}
    job.step(40, glob, locals=[local] * world, arrays=probe(), batch=b)
    assert job.status("noise_scale") == "healthy"
    v = noise.values(JOB)
    assert v["job_gradient_noise_scale"][()] == pytest.approx(50.0, rel=1e-9)
    assert v["job_gradient_noise_g2"][()] == pytest.approx(4.0, rel=1e-9)
    assert v["job_gradient_noise_trace"][()] == pytest.approx(200.0, rel=1e-9)
    # C36: a round with a NaN or Inf norm is skipped, the smoothed estimates stay finite and unchanged
    job.step(50, NAN, locals=[local, NAN, local, local], arrays=probe(), batch=b)
    job.step(60, INF, locals=[local] * world, arrays=probe(), batch=b)
    # finite norms whose squares overflow float64 (past ~1.3e154): skipped too, the check never raises
    job.step(70, 1e200, locals=[1e200] * world, arrays=probe(), batch=b)
    assert noise.values(JOB) == v and job.runner.errors == {}


def test_noise_scale_no_data_without_batch_or_a_second_rank():
    for world, batch in ((3, 0), (1, 8)):
        job = Job(["noise_scale"], world=world, noise_min_rounds=1)
        for i in range(3):
            job.step(10 * i, 1.0, locals=[2.0] * world, arrays=probe(), batch=batch)
        assert job.status("noise_scale") == "no_data"
        assert job.runner.checks["noise_scale"].values(JOB) == {}


# --- (a) C36 ---------------------------------------------------------------------------------------


def test_C36_nan_and_inf_norms_never_reach_counters_or_the_gradient_checks_values():
    job = Job(MINE, noise_min_rounds=2)
    for s in range(8):
        job.step(s, 1.0, locals=[1.0, 1.2, 0.8], arrays=probe() if s % 2 == 0 else None, batch=8)
    medians = job.runner.checks["explosion"].values(JOB)
    bad = probe(act={l: {0: NAN, 1: INF, 5: 3} for l in LAYERS}, param=_merge(ALL_GRADS_NAN, WEIGHTS_NAN))
    for s in range(8, 14):
        job.step(s, NAN if s % 2 else INF, locals=[INF, NAN, 1.0], nonfinite=5, arrays=bad, batch=8)
        job.tick(3.0)
    assert job.runner.checks["explosion"].values(JOB) == medians
    assert job.events("nonfinite") == [("raised", 8, 0, "emb")]
    assert job.events("explosion") == []
    snap = snapshot(job.state, time.time())
    seen = set()
    for fam in SnapshotCollector(lambda: snap).collect():
        for s in fam.samples:
            if fam.type == "counter" or s.name.startswith(("gradwatch_job_grad_norm", "gradwatch_job_gradient_noise")):
                seen.add(s.name)
                assert math.isfinite(s.value), (s.name, s.labels, s.value)
    assert {"gradwatch_job_grad_norm_median", "gradwatch_job_gradient_noise_scale", "gradwatch_rank_nonfinite_steps_total"} <= seen
    for e in job.runner.events:  # the event log and /api/findings take no NaN
        json.loads(e.to_json())


# --- (b) fault injection on real DDP jobs ----------------------------------------------------------

STEPS = 40
DEMOS = {
    "explode": ["explode@23:rank=1"],
    # step 20 is on the probe cadence (every 10): the probe sees the NaN in the forward pass
    "nan": ["nan@20:rank=1"],
    # the loop clips the gradient norm (to 0.5, where the healthy GPT's sits near 1-3): the global
    # norm the agent sees at the step is the clip's, the blow-up only in the local norms
    "clipped": ["explode@23:rank=1"],
    "clean": [],  # clipped too: the local norms' spikes must not fire on a healthy job
}
CLIP = {"clipped": 0.5, "clean": 1.0}

# (c): the noise job's dataset, model, ranks, samples per rank per step, steps, EMA smoothing
N_SAMPLES, D_IN, HIDDEN, D_OUT = 512, 32, 32, 8
NOISE_RANKS, NOISE_BATCH, NOISE_STEPS, NOISE_EMA = 3, 32, 300, 0.98


@pytest.fixture(scope="module")
def agg(tmp_path_factory):
    """One real aggregator process for the module's jobs (each test uses its own job id)."""
    a = start_aggregator(tmp_path_factory.mktemp("agg"), "--round-grace-s", "3", "--publish-interval-s", "0.05",
                         "--checks.noise-ema", str(NOISE_EMA))
    yield a
    a.stop()


@pytest.fixture(scope="module")
def demos(agg):
    """The three 3-rank demo jobs, run side by side against the aggregator."""
    with concurrent.futures.ThreadPoolExecutor(len(DEMOS)) as pool:
        runs = [pool.submit(run_demo, agg.endpoint, ranks=3, steps=STEPS, every=10, inject=spec, job=job,
                            extra=["--clip-grad-norm", str(CLIP[job])] if job in CLIP else [])
                for job, spec in DEMOS.items()]
        for r in runs:
            r.result()

    def all_steps_in():
        counts = samples(agg.scrape(), "gradwatch_rank_steps_total")
        return all(counts.get((("job_id", j), ("rank", str(r)))) == STEPS for j in DEMOS for r in range(3))

    wait_for(all_steps_in, 60, what="every step of every demo job at the aggregator")
    time.sleep(0.3)  # a snapshot or two after the last report, for the findings
    return agg


def raised(agg, job: str, check: str) -> list[dict]:
    return [e for e in agg.findings(job=job) if e["check"] == check and e["event"] == "raised"]


@pytest.mark.ddp
def test_explosion_explode_at_23_on_rank_1_of_3_named_from_local_norms(demos):
    (e,) = wait_for(lambda: raised(demos, "explode", "explosion"), 10, what="an explosion finding")
    assert (e["step"], e["rank"], e["layer"]) == (23, 1, None), e
    assert e["details"]["kinds"] == ["explode", "spike"], e
    local = {int(k): v for k, v in e["details"]["local_grad_norms"].items()}
    assert max(local, key=local.get) == 1 and local[1] > 1e3 * max(local[0], local[2])
    assert raised(demos, "explode", "nonfinite") == []


@pytest.mark.ddp
def test_explosion_under_gradient_clipping_found_from_the_local_norms_naming_rank_1(demos):
    """The same blow-up with the gradient norm clipped before the step: the global norm reads at
    the clip (no finding from it); the local norms, before clipping, name it."""
    (e,) = wait_for(lambda: raised(demos, "clipped", "explosion"), 10, what="an explosion finding under clipping")
    assert (e["step"], e["rank"], e["layer"]) == (23, 1, None), e
    assert e["details"]["kinds"] == ["spike"] and e["details"]["grad_norm"] <= 0.5 * (1 + 1e-5), e
    assert e["details"]["episode"]["spike"]["factor"] > 1e3 and "clipped?" in e["summary"], e
    assert raised(demos, "clipped", "nonfinite") == []


@pytest.mark.ddp
def test_nonfinite_nan_at_20_on_rank_1_located_at_its_probe(demos):
    (e,) = wait_for(lambda: raised(demos, "nan", "nonfinite"), 10, what="a nonfinite finding")
    assert (e["step"], e["rank"]) == (20, 1), e
    d = e["details"]
    assert d["origin_ranks"] == [1] and d["local_grad_norms"]["1"] == "nan" and d["local_grad_norms"]["0"] != "nan"
    # step 20 was probed: the probe saw rank 1's forward pass
    assert (e["layer"], d["module"], d["pass"], d["probed_step"]) == ("blocks.0.mlp.fc",) * 2 + ("activation", 20), e
    assert raised(demos, "nan", "explosion") == []


@pytest.mark.ddp
def test_clean_run_raises_no_finding_from_the_gradient_checks(demos):
    events = [e for e in demos.findings(job="clean") if e["check"] in MINE]
    assert events == []
    errors = samples(demos.scrape(), "gradwatch_check_errors_total")  # over all three jobs
    assert {c: errors.get((("check", c),), 0) for c in MINE} == dict.fromkeys(MINE, 0)
    checks = requests.get(demos.base_url + "/api/checks", timeout=5).json()["checks"]
    status = {(s["job_id"], s["check"]): s["status"] for s in checks}
    assert status[("clean", "explosion")] == "healthy"
    assert status[("clean", "nonfinite")] == "healthy"
    assert status[("clean", "dead_units")] == "healthy"  # the demo's MLP's GELU, alive
    assert status[("clean", "noise_scale")] == "no_data"  # 4 probed steps < noise_min_rounds


# --- (c) gradient noise scale against per-sample gradients ---------------------------------------


def _noise_problem():
    """A fixed regression dataset and a small MLP at a fixed point (the test trains with lr 0)."""
    import torch

    torch.manual_seed(0)
    x = torch.randn(N_SAMPLES, D_IN)
    y = x @ torch.randn(D_IN, D_OUT) + 0.5 * torch.randn(N_SAMPLES, D_OUT)
    model = torch.nn.Sequential(torch.nn.Linear(D_IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, D_OUT))
    return model, x, y


def _noise_rank(rank: int, endpoint: str, master_port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(NOISE_RANKS), LOCAL_RANK=str(rank),
                      TORCHELASTIC_RUN_ID="noise", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port))
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from gradwatch import agent

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=NOISE_RANKS)
    try:
        model, x, y = _noise_problem()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.0)
        with agent.attach(ddp, opt, endpoint=endpoint, every=1, burst=0, queue_size=4096, send_hwm=100_000) as mon:
            for step in range(NOISE_STEPS):
                g = torch.Generator().manual_seed(1_000_003 * rank + step)
                idx = torch.randint(0, N_SAMPLES, (NOISE_BATCH,), generator=g)  # with replacement
                F.mse_loss(ddp(x[idx]), y[idx]).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            # every report built and handed to ZeroMQ (the sender may lag far behind a loaded
            # machine's steps; close() waits only a second), then time to put them on the wire
            deadline = time.monotonic() + 60
            while mon.sender.pending and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.3)
        del ddp, mon  # the DDP freed while its group is registered (see train_rank in commands/demo/run.py)
    finally:
        dist.destroy_process_group()


def per_sample_gradients() -> np.ndarray:
    """float64 [N_SAMPLES, n_params]: the gradient of each sample's loss, in float64."""
    import torch
    from torch.func import functional_call, grad, vmap

    model, x, y = _noise_problem()
    model = model.double()
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xi, yi):
        return torch.nn.functional.mse_loss(functional_call(model, p, (xi[None],)), yi[None])

    per = vmap(grad(loss), in_dims=(None, 0, 0))(params, x.double(), y.double())
    return torch.cat([v.reshape(N_SAMPLES, -1) for v in per.values()], dim=1).numpy()


def replay_noise_scale(g: np.ndarray) -> float:
    """The check's smoothed B_simple, recomputed from the per-sample gradients the ranks drew."""
    import torch

    b, big = NOISE_BATCH, NOISE_BATCH * NOISE_RANKS
    ema = None
    for step in range(NOISE_STEPS):
        idx = [torch.randint(0, N_SAMPLES, (b,), generator=torch.Generator().manual_seed(1_000_003 * r + step)).numpy()
               for r in range(NOISE_RANKS)]
        local = np.stack([g[i].mean(0) for i in idx])
        small, glob = (local**2).sum(1).mean(), np.sum(local.mean(0) ** 2)
        est = np.array([(big * glob - b * small) / (big - b), (small - glob) / (1 / b - 1 / big)])
        ema = est if ema is None else NOISE_EMA * ema + (1 - NOISE_EMA) * est
    return float(ema[1] / ema[0])


@pytest.mark.ddp
def test_noise_scale_of_a_real_ddp_job_within_10_percent_of_per_sample_brute_force(agg):
    """3 gloo ranks with agents, each drawing 32 samples with replacement per step from 512, lr 0
    so every step samples the same gradient distribution; every step probed; EMA 0.98.

    Brute force: B_simple = tr(S) / |G|^2 over all 512 per-sample gradients (G their mean, S their
    covariance: the population the ranks sample from). Tolerance: the same sampling replayed with
    200 other seeds gives a relative error of the smoothed estimate with mean 0.05%, standard
    deviation 1.5% and largest 4.2%; 10% is over six standard deviations, and this run is
    deterministic (fixed seeds, fixed weights), predicted at +0.8%. Without the smoothing (the
    last round's ratio) the error has a standard deviation of 17% and is -16% for these seeds.
    The exported value must also equal, to float32 precision, the estimator replayed here from the
    per-sample gradients of the samples each rank drew: proof that the agent's local and global
    norms and batch sizes reach the check as the estimator needs them."""
    import torch.multiprocessing as mp

    mp.start_processes(_noise_rank, args=(agg.endpoint, free_port()), nprocs=NOISE_RANKS, start_method="spawn")

    def all_rounds():
        text = agg.scrape()
        rounds = samples(text, "gradwatch_rounds_total")
        return text if rounds.get((("job_id", "noise"), ("outcome", "complete"))) == NOISE_STEPS else None

    text = wait_for(all_rounds, 60, what="every probed step of the noise job reconciled")
    got = samples(text, "gradwatch_job_gradient_noise_scale")[(("job_id", "noise"),)]
    g = per_sample_gradients()
    mean = g.mean(0)
    want = float(((g - mean) ** 2).sum(1).mean() / (mean @ mean))
    assert 20 < want < 60  # the regime the tolerance was worked out for
    assert got == pytest.approx(want, rel=0.10), (got, want)
    assert got == pytest.approx(replay_noise_scale(g), rel=1e-3)
