"""The agent's NaN guard (``nan_guard``): at unprobed steps, the first module whose output held a
NaN or an Inf, in the order the step's forward passes called them (wire ``nonfinite_slot``).

Real parts: real models and hooks, a real ZeroMQ socket receiving the reports, the real schedule
judging the guard's cost.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

from gradwatch import agent
from gradwatch.agent.hooks import ProbeRecorder
from gradwatch.agent.schedule import GUARD_SHARE, GUARD_STEPS, WARMUP_STEPS, ProbeSchedule
from gradwatch.agent.stats import Reducer


class Pair(nn.Module):
    """A leaf module with a tuple output: (x, 2x)."""

    def forward(self, x):
        return x, 2 * x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.pair, self.fc2 = nn.Linear(4, 8), nn.ReLU(), Pair(), nn.Linear(8, 1)

    def forward(self, x):
        a, b = self.pair(self.act(self.fc1(x)))
        return self.fc2(a + b)


def slot_of(collector, reports, module: str, output: str = "") -> int:
    schema = collector.schema(reports[0].schema)
    return [(s[0], s[1]) for s in schema.slots].index((module, output))


def nan_at(module: nn.Module, where=None):
    """A forward hook that runs before the agent's and makes the output (or its element ``where``
    of a tuple) NaN, as the fault injector does."""

    def hook(m, args, out):
        if where is None:
            return out * float("nan")
        out = list(out)
        out[where] = out[where] * float("nan")
        return tuple(out)

    return module.register_forward_hook(hook, prepend=True)


@pytest.mark.parametrize("target", ["fc1", "pair[1]"])
def test_the_guard_names_the_first_module_whose_output_went_non_finite_at_an_unprobed_step(collector, target):
    """every=10, NaN made at step 13 (unprobed) in fc1's output or in the second element of pair's
    tuple: that step's record names the slot, earlier unprobed steps say -1 (watched, nothing),
    probed steps carry no verdict (their activation records say more); after the NaN reached the
    weights, the first module (fc1) goes non-finite at step 14 (for pair's NaN: news) and from then
    on nothing goes non-finite that was not already."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    monitor = agent.attach(model, opt, endpoint=collector.endpoint, job="guard", every=10, nan_guard="on")
    module, where = ("fc1", None) if target == "fc1" else ("pair", 1)
    for step in range(16):
        h = nan_at(getattr(model, module), where) if step == 13 else None
        model(torch.randn(4, 4)).square().sum().backward()
        if h is not None:
            h.remove()
        opt.step()
        opt.zero_grad()
    collector.drain(monitor)
    monitor.close()
    reps = collector.wait_steps(16, job="guard")
    want = slot_of(collector, reps, module, "" if where is None else f"[{where}]")
    fc1 = slot_of(collector, reps, "fc1")
    expected = [None] + [-1] * 9 + [None] + [-1] * 2 + [want] + [-1 if want == fc1 else fc1, -1]
    # after step 13's NaN the sender asks for a burst of probes, a step or two later (no host sync)
    probed = [s for s in range(14, 16) if reps[s].probe]
    for s in probed:
        expected[s] = None
    if 14 in probed and want != fc1:
        expected[15] = fc1 if 15 not in probed else None  # the weights' NaN is news at the next guarded step
    assert [reps[s].nonfinite_slot for s in range(16)] == expected
    assert reps[13].grad_nonfinite > 0 and not monitor.errors


def test_the_guard_first_in_call_order_over_micro_steps(collector):
    """Gradient accumulation: the guard's verdict is the first non-finite output over all the
    step's forward passes, in call order (here the second micro-step's fc2, not its fc1)."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    monitor = agent.attach(model, opt, endpoint=collector.endpoint, job="micro", every=10, nan_guard="on")
    for step in range(3):
        for micro in range(3):
            h = nan_at(model.fc2) if (step, micro) == (1, 1) else None
            model(torch.randn(4, 4)).square().sum().backward()
            if h is not None:
                h.remove()
        opt.step()
        opt.zero_grad()
    collector.drain(monitor)
    monitor.close()
    reps = collector.wait_steps(3, job="micro")
    assert reps[1].nonfinite_slot == slot_of(collector, reps, "fc2")
    assert reps[2].nonfinite_slot == (None if reps[2].probe else 0)  # a burst's probe says it in its own way


def test_the_guard_steps_aside_for_evaluation_forwards(collector):
    """With the guard on, unprobed training forwards run with the agent's module hooks and
    evaluation forwards (no grad) without any: no hook may change which kernels they run."""
    seen = []

    class Probe(nn.Linear):
        def forward(self, x):
            seen.append((torch.is_grad_enabled(), len(self._forward_hooks)))
            return super().forward(x)

    torch.manual_seed(0)
    model = nn.Sequential(Probe(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with agent.attach(model, opt, endpoint=collector.endpoint, job="eval", every=100, nan_guard="on"):
        for step in range(4):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                model(torch.randn(2, 4))
    assert seen == [(True, 1), (False, 0)] * 4


def _judged(guard_share_of_budget: float, caplog) -> bool:
    """Whether an ``auto`` guard stays on when it costs ``guard_share_of_budget`` of a 1 % budget
    of 10 ms steps, measured over GUARD_STEPS unprobed steps by the real schedule."""
    torch.manual_seed(0)
    model = Net()
    rec = ProbeRecorder(Reducer("off"), lambda *a: None, model)
    s = ProbeSchedule(None, 0, 10.0, rec, lambda *a: None, budget=0.01, guard="auto")
    assert not rec.guard and not model.fc1._forward_hooks  # until the monitor's first advance
    step_s, sentinel_s = 0.010, 0.00002
    guard_s = guard_share_of_budget * 0.01 * step_s
    with caplog.at_level(logging.INFO, "gradwatch.agent"):
        for step in range(WARMUP_STEPS + GUARD_STEPS + 8):
            s.advance(step)
            assert rec.guard == bool(model.fc1._forward_hooks) or s.is_probe(step)
            if s.is_probe(step):
                s.account(step, True, 0.0005, step_s)
                continue
            s.account(step, False, sentinel_s + guard_s, step_s, guard_s)
    return rec.guard


def test_auto_keeps_the_guard_where_it_costs_little_and_drops_it_for_good_where_not(caplog):
    assert _judged(GUARD_SHARE / 2, caplog) and not caplog.records
    assert not _judged(GUARD_SHARE * 2, caplog)
    (r,) = caplog.records
    assert "NaN guard off" in r.getMessage() and "nan_guard='on' keeps it" in r.getMessage()


def test_off_means_no_hooks_between_probes_and_on_survives_the_probes(collector):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with agent.attach(model, opt, endpoint=collector.endpoint, job="off", every=2, nan_guard="off") as m:
        assert not m.recorder.guard
        for step in range(4):
            model(torch.randn(4, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            assert bool(model.fc1._forward_hooks) == (m.step % 2 == 0), m.step  # the next step is probed
    assert not model.fc1._forward_hooks and not model._forward_pre_hooks


def test_an_auto_guard_that_goes_off_raises_no_over_budget_warning_and_leaves_no_cost_behind(recwarn):
    """A guard costing 5 % of the step (5 budgets) on a job whose sentinel alone is cheap: while
    the auto guard is judged nothing is over budget, it goes off, and the agent measured afresh
    without it is within the budget (no warning, no over_budget)."""
    torch.manual_seed(0)
    rec = ProbeRecorder(Reducer("off"), lambda *a: None, Net())
    s = ProbeSchedule(None, 0, 10.0, rec, lambda *a: None, budget=0.01, max_interval_s=0.1, guard="auto")
    step_s, sentinel_s, guard_s = 0.010, 0.00002, 0.0005
    for step in range(WARMUP_STEPS + GUARD_STEPS + 200):
        s.advance(step)
        g = guard_s if rec.guard else 0.0
        if s.is_probe(step):
            s.account(step, True, 0.0002 + g, step_s)
        else:
            s.account(step, False, sentinel_s + g, step_s, g)
    assert not rec.guard and not s.over_budget and s.guard_s == guard_s
    assert s.cost.sentinel_s == sentinel_s and s.fraction < 0.01
    assert not [w for w in recwarn if "budget" in str(w.message)]


def test_a_slot_non_finite_at_every_step_does_not_hide_the_one_a_nan_comes_from(collector):
    """An output that holds -inf at every step (a mask) is first in call order: it is news at the
    first guarded step only, and a NaN made later in fc2's output is still named at its step."""

    class Masked(Net):
        def forward(self, x):
            return super().forward(x + self.mask(x))

    class Mask(nn.Module):
        def forward(self, x):
            return torch.where(x > 100, 0.0, float("-inf")) * 0  # -inf * 0: NaN, never used below

    torch.manual_seed(0)
    model = Masked()
    model.mask = Mask()

    def fwd(x):
        model.mask(x)  # called, its output unused: non-finite at every step, harmless
        return Net.forward(model, x)

    model.forward = fwd
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    monitor = agent.attach(model, opt, endpoint=collector.endpoint, job="mask", every=10, nan_guard="on")
    for step in range(8):
        h = nan_at(model.fc2) if step == 6 else None
        model(torch.randn(4, 4)).square().sum().backward()
        if h is not None:
            h.remove()
        opt.step()
        opt.zero_grad()
    collector.drain(monitor)
    monitor.close()
    reps = collector.wait_steps(8, job="mask")
    mask, fc1, fc2 = (slot_of(collector, reps, m) for m in ("mask", "fc1", "fc2"))
    assert mask == 0  # first in call order
    assert [reps[s].nonfinite_slot for s in range(8)] == [None, mask, -1, -1, -1, -1, fc2, None if reps[7].probe else fc1]


class NoDetach(torch.Tensor):
    """An output the guard cannot summarise: ``detach`` raises (everything else as a plain tensor)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.detach:
            raise RuntimeError("no detach here")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def test_a_guard_that_keeps_failing_is_switched_off_and_takes_its_hooks_away(collector):
    """A sum that fails is counted; after PART_ERRORS failures the guard goes off at the next step
    boundary, its hooks with it, and training and the rest of the agent go on."""
    from gradwatch.agent.failures import PART_ERRORS

    class Odd(nn.Linear):
        def forward(self, x):
            return super().forward(x).as_subclass(NoDetach)

    torch.manual_seed(0)
    model = nn.Sequential(Odd(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with pytest.warns(RuntimeWarning) as warned:
        with agent.attach(model, opt, endpoint=collector.endpoint, job="fail", every=100, nan_guard="on") as m:
            for step in range(PART_ERRORS + 3):
                model(torch.randn(4, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
            assert "guard" in m.disabled and not m.recorder.guard and not model[2]._forward_hooks
            # the probe of step 0 fails once too (its own part, "forward")
            assert m.active and m.step == PART_ERRORS + 3 and m.errors == PART_ERRORS + 1
            collector.drain(m)
    assert any("guard:0 failed" in str(w.message) for w in warned) and any("guard keeps failing" in str(w.message) for w in warned)
    assert sorted(collector.wait_steps(PART_ERRORS + 3, job="fail")) == list(range(PART_ERRORS + 3))  # every step reported
