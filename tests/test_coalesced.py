"""Coalesced records (wire ``steps``) against one report per step: the aggregator draws the same
conclusions from both.

Issue 14: the agent sends its per-step records in batches, a few per second; the checks must raise
exactly what they raise when every step comes on its own. Each scenario below is one job's
traffic, fed to a real :class:`State` and checks :class:`Runner` twice, through ``wire.encode`` and
``wire.decode``: once as one report per rank per step (in step order), once as ``steps`` batches of
random lengths per rank, interleaved at random. The findings raised and resolved (check, step,
rank, layer, in order per check) must be the same; so must the rank gauges and counters.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest

from gradwatch import wire
from gradwatch.aggregator.checks import Runner, Thresholds
from gradwatch.aggregator.reconcile import snapshot
from gradwatch.aggregator.state import State

PARAMS = tuple((f"l{i}.weight", (8, 8), "float32") for i in range(4))
SLOTS = tuple((f"l{i}", "", "Linear", "float32") for i in range(4))
CHECKS = ("explosion", "vanishing", "nonfinite", "grad_agreement", "straggler", "training_stalled")
WORLD, STEPS = 4, 400


def scenario(faults: set, seed: int = 0) -> list[list[wire.Report]]:
    """Per rank, its unprobed reports of every step, with ``faults`` injected (see the test ids)."""
    rng = np.random.default_rng(seed)
    base = rng.uniform(0.5, 1.5, STEPS)
    out = []
    for r in range(WORLD):
        reps = []
        for s in range(STEPS):
            g, local, nonfinite = float(base[s]), float(base[s] * (1 + 0.01 * r)), 0
            compute = 0.02 * (1 + 0.05 * rng.standard_normal())
            norms = np.full(len(PARAMS), g / 2, np.float32)
            if "spike" in faults and s == 120:
                g, local = g * 50, local * (200 if r == 2 else 1)
            if "spike" in faults and s == 300:  # a second, separate episode
                g, local = g * 40, local * (100 if r == 1 else 1)
            if "desync" in faults and s == 200 and r == 3:
                norms[1] *= 1.5  # one rank's gradient altered after all-reduce, once
            if "straggler" in faults and r == 1 and 150 <= s < 280:
                compute *= 2.5
            if "nan" in faults and s >= 350:
                g, nonfinite = float("nan"), 4
                local = float("inf") if (r == 0 and s == 350) else float("nan")
            reps.append(wire.Report(wire.Header("j", r, WORLD, f"b{r}", 0, 0.0), "", s, 0.025, g, nonfinite,
                                    local_grad_norm=local, compute_time=compute, grad_norms=norms, loss=float(s)))
        out.append(reps)
    return out


class Feed:
    """A state and runner on a fake clock; messages go through the wire both ways."""

    def __init__(self):
        self.now = 100.0
        self.runner = Runner(list(CHECKS), Thresholds(), wall=lambda: 0.0)
        self.state = State(clock=lambda: self.now, runner=self.runner)
        self.seq = collections.Counter()
        self.digest = ""
        for r in range(WORLD):
            sch = wire.Schema(self.header(r), "node", r, 0, PARAMS, SLOTS)
            self.digest = sch.hash
            self.send(sch)

    def header(self, rank: int) -> wire.Header:
        self.seq[rank] += 1
        return wire.Header("j", rank, WORLD, f"b{rank}", self.seq[rank] - 1, 0.0)

    def send(self, msg) -> None:
        self.state.apply(wire.decode(wire.encode(msg), schema_sizes=self.state.schema_sizes))

    def records(self, reps: list) -> list:
        return [wire.msgspec.structs.replace(x, header=self.header(x.header.rank), schema=self.digest) for x in reps]

    def tick(self, dt: float = 0.01) -> None:
        self.now += dt
        self.state.tick()

    def findings(self) -> dict:
        """check -> [(event, step, rank, layer)], in the order raised and resolved."""
        out = collections.defaultdict(list)
        for e in self.runner.events:
            out[e.check].append((e.event, e.step, e.rank, e.layer))
        return dict(out)


def per_step(traffic) -> Feed:
    f = Feed()
    for s in range(STEPS):
        for r in range(WORLD):
            f.send(f.records([traffic[r][s]])[0])
        f.tick()
    f.tick(10.0)
    return f


def coalesced(traffic, seed: int) -> Feed:
    """Every rank's records as ``steps`` batches of 1 to 60 records, ranks interleaved at random."""
    rng = np.random.default_rng(seed)
    f = Feed()
    at = [0] * WORLD
    while min(at) < STEPS:
        r = int(rng.choice([k for k in range(WORLD) if at[k] < STEPS]))
        n = int(rng.integers(1, 61))
        batch = traffic[r][at[r]: at[r] + n]
        at[r] += len(batch)
        f.send(wire.Steps.of(f.records(batch)))
        f.tick()
    f.tick(10.0)
    return f


ALL = {"spike", "desync", "straggler", "nan"}


@pytest.mark.parametrize("faults, seed", [(set(), 0), ({"spike"}, 0), ({"desync"}, 0), ({"straggler"}, 0), ({"nan"}, 0),
                                          (ALL, 0), (ALL, 1)],
                         ids=["clean", "spike", "desync", "straggler", "nan", "all", "all-seed1"])
def test_batches_raise_and_resolve_exactly_what_single_reports_do(faults, seed):
    traffic = scenario(faults, seed)
    want = per_step(traffic)
    got = coalesced(traffic, seed)
    assert got.findings() == want.findings()
    expected = {"spike": "explosion", "desync": "grad_agreement", "straggler": "straggler", "nan": "nonfinite"}
    for fault, check in expected.items():  # the scenario is not vacuous: each fault is found
        assert any(e[0] == "raised" for e in want.findings().get(check, [])) == (fault in faults), (fault, want.findings())
    def ranks(f: Feed) -> list:
        return [{k: getattr(x, k) for k in ("rank", "step", "steps", "nonfinite_steps", "step_time", "loss")}
                for x in snapshot(f.state, 0.0).jobs[0].ranks]

    assert ranks(got) == ranks(want)


def test_a_spike_inside_one_batch_is_raised_and_resolved_not_lost():
    """One release holding the spike and the whole episode after it: both events are recorded."""
    traffic = scenario({"spike"})
    f = Feed()
    for r in range(WORLD):  # every rank's 400 steps in batches of 200: the episode at 120 opens and ends inside one
        f.send(wire.Steps.of(f.records(traffic[r][:200])))
    f.tick()
    events = f.findings()["explosion"]
    assert events[:2] == [("raised", 120, 2, None), ("resolved", 120, 2, None)]
