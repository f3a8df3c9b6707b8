"""The probe budget: the agent measures its own cost and picks the probe interval to stay within it.

The schedule's decisions are tested on measured costs fed in directly (no clock, nothing that can
flake); the monitor's own measurement with a real model whose probe is made artificially expensive
(its statistics kernel sleeps), reporting to a real ZeroMQ socket.
"""

from __future__ import annotations

import math
import time
import warnings

import pytest
import torch
import torch.nn as nn

from gradwatch import agent
from gradwatch.agent.hooks import ProbeRecorder
from gradwatch.agent.schedule import CLIP, START_INTERVAL, ProbeSchedule
from gradwatch.agent.stats import Reducer


class Errors(list):
    def __call__(self, where, exc):
        self.append((where, exc))


def schedule(every=None, **kw) -> ProbeSchedule:
    return ProbeSchedule(every, 5, 10.0, ProbeRecorder(Reducer("off"), Errors()), Errors(), **kw)


def run(s: ProbeSchedule, steps: int, train_s: float, sentinel_s: float, probe_s: float) -> list[int]:
    """Drive ``s`` for ``steps`` steps whose costs are exactly these (seconds); the probed steps."""
    probed = []
    for step in range(steps):
        p = s.is_probe(step)
        if p:
            probed.append(step)
        agent_s = sentinel_s + (probe_s if p else 0.0)
        s.account(step, p, agent_s, train_s + agent_s)
    return probed


def test_an_expensive_probe_lowers_the_probe_rate_within_the_budget():
    """Same step and sentinel; a probe 10x dearer is probed 8x less often, and both stay within
    the 1% budget: interval = probe / (budget * step - sentinel) rounded up to a power of two."""
    cheap, dear = schedule(budget=0.01), schedule(budget=0.01)
    probes_cheap = run(cheap, 512, train_s=0.010, sentinel_s=20e-6, probe_s=200e-6)
    probes_dear = run(dear, 512, train_s=0.010, sentinel_s=20e-6, probe_s=2e-3)
    # ideal 200 us / (100 - 20) us = 2.5 -> 4; 2 ms / 80 us = 25 -> 32
    assert (cheap.interval, dear.interval) == (4, 32)
    assert len(probes_dear) * 4 < len(probes_cheap)
    assert probes_dear[-3:] == [416, 448, 480]  # aligned: every rank with this interval probes these
    for s in (cheap, dear):
        assert s.fraction <= 0.01 and not s.over_budget
    assert dear.fraction == pytest.approx((20e-6 + 2e-3 / 32) / 0.010)


def test_the_interval_follows_a_probe_that_gets_cheaper():
    s = schedule(budget=0.01)
    run(s, 300, train_s=0.010, sentinel_s=20e-6, probe_s=2e-3)
    assert s.interval == 32
    run(s, 600, train_s=0.010, sentinel_s=20e-6, probe_s=200e-6)  # the medians forget the dear probes
    assert s.interval == 4


def test_the_ceiling_holds_and_an_unmeetable_budget_warns_once():
    """max_interval_s=0.5 over 10 ms steps: at most 32 steps (the power of two below 50) between
    probes however dear the probe; at 50 ms a probe that costs over 3 budgets is flagged, and the
    warning comes once."""
    s = schedule(budget=0.01, max_interval_s=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        probed = run(s, 400, train_s=0.010, sentinel_s=20e-6, probe_s=0.050)
    assert s.interval == 32 and s.ceiling() == 32
    assert all(b - a <= 32 for a, b in zip(probed, probed[1:]))
    assert s.over_budget and s.fraction > 3 * 0.01
    (said,) = [str(w.message) for w in caught if "budget" in str(w.message)]
    # the interval in steps moves with the step time: the warning says it is the one of now
    assert "every 32 steps at the step time measured now" in said and "gradwatch_rank_probe_interval_steps" in said
    # a probe within 3 budgets at the ceiling is not flagged
    ok = schedule(budget=0.01, max_interval_s=0.5)
    run(ok, 400, train_s=0.010, sentinel_s=20e-6, probe_s=0.005)
    assert ok.interval == 32 and not ok.over_budget


def test_a_sentinel_over_budget_probes_at_the_ceiling():
    s = schedule(budget=0.01, max_interval_s=1.5)
    with pytest.warns(RuntimeWarning, match="over 3x the budget"):
        run(s, 400, train_s=0.010, sentinel_s=0.001, probe_s=1e-4)  # the sentinel alone costs 10%
    assert s.interval == 128 and s.over_budget


def test_every_fixes_the_cadence_whatever_the_cost():
    s = schedule(every=5, budget=0.01)
    probed = run(s, 100, train_s=0.010, sentinel_s=20e-6, probe_s=0.5)
    assert probed == list(range(0, 100, 5)) and s.interval == 5 and not s.over_budget


def test_bursts_stay_outside_the_budget():
    s = schedule(budget=0.01)
    run(s, 300, train_s=0.010, sentinel_s=20e-6, probe_s=2e-3)
    assert s.interval == 32
    s.watch(300, math.inf, 1, scheduled=301)
    assert [k for k in range(302, 330) if s.is_probe(k)] == [302, 303, 304, 305, 306, 320]
    assert not s.on_cadence(303) and s.on_cadence(320)


def test_a_pause_is_not_the_agents_cost():
    """A step that took 100x longer (evaluation, a checkpoint, the OS preempting the process) is
    one sample among many: the medians, and so the interval, do not move."""
    s = schedule(budget=0.01)
    run(s, 300, train_s=0.010, sentinel_s=20e-6, probe_s=200e-6)
    assert s.interval == 4
    before = s.fraction
    s.account(300, True, 1.0, 1.0)  # a probed step with a one-second pause in it
    for step in range(301, 333):
        s.account(step, False, 20e-6 if step != 301 else 1.0, 1.0 if step == 301 else 0.010 + 20e-6)
    assert s.interval == 4 and s.fraction == pytest.approx(before, rel=1e-9)


def test_pauses_on_every_probed_step_do_not_ratchet():
    """Every probed step carries a 50 ms pause outside the agent (a benchmark interleaving
    variants, evaluation aligned with the cadence): the probe's measured cost stays bounded by
    CLIP times its own host time instead of growing with every probe, and the interval settles."""
    s = schedule(budget=0.01)
    for step in range(2000):
        p = s.is_probe(step)
        agent_s = 20e-6 + (200e-6 if p else 0.0)
        s.account(step, p, agent_s, 0.010 + agent_s + (0.050 if p else 0.0))
    assert s.cost.probe_extra_s <= CLIP * 200e-6 * 1.01
    # the ideal with the clipped excess: 4 * 200 us / 80 us = 10 -> 16, never more
    assert s.interval == 16 and s.fraction <= 0.01


def test_no_decision_before_measurements():
    """Warm-up steps are not measured; until a probe and an unprobed step are, the interval is
    the starting one; NaN or negative times are ignored."""
    s = schedule(budget=0.01)
    s.account(0, True, 10.0, 10.0)
    s.account(5, False, math.nan, 0.01)
    s.account(6, False, -1.0, 0.01)
    assert s.interval == START_INTERVAL and math.isnan(s.fraction) and s.cost.steps == 0


# --- the monitor measures its own cost -------------------------------------------------------------


class MLP(nn.Sequential):
    def __init__(self):
        torch.manual_seed(0)
        super().__init__(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def train(collector, steps: int, slow_probe_s: float, **settings) -> tuple[list[int], agent.Monitor]:
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    monitor = agent.attach(model, opt, endpoint=collector.endpoint, **settings)
    if slow_probe_s:  # every recorded activation costs this much host time: a dear probe
        moments = monitor.reducer.moments

        def slow(t):
            time.sleep(slow_probe_s)
            return moments(t)

        monitor.reducer.moments = slow
    x = torch.randn(16, 8)
    with monitor:
        for _ in range(steps):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        reports = collector.wait_steps(steps)
    return [s for s, r in sorted(reports.items()) if r.probe], monitor


def test_monitor_probes_less_when_its_probe_is_dear(collector):
    """A probe that sleeps 5 ms per activation (15 ms per probe) on sub-millisecond steps cannot
    fit a 1% budget: after the start (steps 0 and 8) the interval goes far past the run. The
    reports carry the measured cost and the interval."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the sentinel alone may be over budget here
        probed, monitor = train(collector, 48, slow_probe_s=0.005, budget=0.01)
    assert probed == [0, 8]
    assert monitor.schedule.interval > 48 and monitor.schedule.cost.probe_extra_s >= 0.015
    last = collector.reports()[47]
    assert last.probe_interval == monitor.schedule.interval and 0 < last.agent_cost < math.inf


def test_monitor_ceiling_holds_for_a_dear_probe(collector):
    """max_probe_interval_s far below one step: the ceiling is one step, so once the first steps
    are measured (after the warm-up) every step is probed however dear, and the agent flags that
    it is over budget (one warning)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        probed, monitor = train(collector, 24, slow_probe_s=0.002, budget=0.01, max_probe_interval_s=1e-6)
    assert probed == [0] + list(range(4, 24))
    assert monitor.schedule.over_budget and collector.reports()[23].over_budget
    assert len([w for w in caught if "budget" in str(w.message)]) == 1


def test_monitor_every_fixes_the_cadence_and_the_schema_says_which(collector):
    from gradwatch import wire

    probed, _ = train(collector, 12, slow_probe_s=0.002, every=3)
    assert probed == [0, 3, 6, 9]
    schemas = [m for m in collector.msgs if isinstance(m, wire.Schema)]
    assert schemas and all(m.every == 3 for m in schemas)
    assert collector.reports()[11].probe_interval == 3
