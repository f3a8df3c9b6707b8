"""Coalesced records (wire ``steps``) against one report per step: the aggregator draws the same
conclusions from both.

The agent sends its per-step records in batches, a few per second; the checks must raise
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
from gradwatch.aggregator.snapshot import snapshot

from .fakejob import LocalJob, Model

#: four linear layers
MODEL = Model(tuple((f"l{i}.weight", (8, 8), "float32") for i in range(4)), tuple((f"l{i}", "", "Linear", "float32") for i in range(4)))
PARAMS, SLOTS = MODEL.params, MODEL.slots
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


class Feed(LocalJob):
    """The job's ranks reporting to a state and runner on a fake clock; messages go through the
    wire both ways. Each rank has sent its schema."""

    def __init__(self, checks=CHECKS, **state):
        super().__init__(checks, wall=lambda: 0.0, state=state, job="j", world=WORLD, model=MODEL, every=0,
                         clock=lambda: 0.0, boots=[f"b{r}" for r in range(WORLD)])
        self.schema()

    def records(self, reps: list) -> list:
        """``reps`` as their ranks send them: each with the rank's next header and its schema."""
        return [wire.msgspec.structs.replace(x, header=self.header(x.header.rank), schema=self.digest[x.header.rank])
                for x in reps]

    def tick(self, dt: float = 0.01) -> None:
        super().tick(dt)

    def findings(self) -> dict:
        """check -> [(event, step, rank, layer)], in the order raised and resolved."""
        out = collections.defaultdict(list)
        for e in self.runner.events:
            out[e.check].append((e.event, e.step, e.rank, e.layer))
        return dict(out)


def per_step(traffic, feed: Feed | None = None, between=None) -> Feed:
    """``traffic`` one report per rank per step; ``between()`` after each message, if given."""
    f = feed or Feed()
    for s in range(STEPS):
        for r in range(WORLD):
            f.send(f.records([traffic[r][s]])[0])
            if between is not None:
                between()
        f.tick()
    f.state.finish_closing()
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


# --- probed steps reconciled in slices ----------------------------------------------------------

ROUND_CHECKS = CHECKS + ("outlier_rank", "dead_units", "replica_drift", "noise_scale")


def with_probes(traffic, every: int = 5, seed: int = 0) -> list[list[wire.Report]]:
    """``traffic`` with every ``every``-th step a probe report: arrays that follow the step's
    gradient norm, rank 2's activations 1,000x from step 100 to 160, rank 3's gradient fingerprint of one
    parameter different at step 200 (a desync after all-reduce)."""
    rng = np.random.default_rng(seed)
    n_s, n_p = len(SLOTS), len(PARAMS)
    out = []
    for r, reps in enumerate(traffic):
        row = []
        for x in reps:
            if x.step % every:
                row.append(x)
                continue
            g = x.grad_norm if np.isfinite(x.grad_norm) else np.nan
            act = np.abs(rng.standard_normal((n_s, 6))).astype(np.float32) * [1, 1, 1, 1, 0, 0]
            if r == 2 and 100 <= x.step <= 160:
                act *= 1000
            param = np.stack([np.full(n_p, g / 2), np.ones(n_p), np.zeros(n_p)], axis=1).astype(np.float32)
            fp = np.arange(n_p, dtype=np.uint64) + np.uint64(x.step)
            if r == 3 and x.step == 200:
                fp[1] += np.uint64(7)
            row.append(wire.msgspec.structs.replace(
                x, probe=True, act=act, act_grad=np.abs(rng.standard_normal((n_s, 2))).astype(np.float32) * [1, 0],
                act_count=np.ones((n_s, 2), np.float32), param=param, fp_grad=fp,
                fp_weight=np.arange(n_p, dtype=np.uint64)))
        out.append(row)
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_rounds_reconciled_in_slices_raise_exactly_what_rounds_reconciled_at_once_do(seed):
    """A large job's probed step is reconciled in slices between the writer's batches
    of frames (round_slice_ranks). The same traffic with every round reconciled at once and with
    every round sliced, slices run at random between messages (often none until later steps
    have come), raises and resolves the same findings and leaves the same latest round."""
    traffic = with_probes(scenario(ALL, seed), seed=seed)
    whole = per_step(traffic, Feed(ROUND_CHECKS))
    rng = np.random.default_rng(seed)
    sliced = Feed(ROUND_CHECKS, round_slice_ranks=1)
    waited = []

    def between():  # now and then a few slices: rounds wait while later steps come
        waited.append(len(sliced.state.closing))
        if rng.random() < 0.05:
            for _ in range(int(rng.integers(1, 4))):
                sliced.state.advance()

    per_step(traffic, sliced, between)
    assert max(waited) >= 2 and not sliced.state.closing  # rounds did wait, several at once, and all finished
    assert sliced.findings() == whole.findings()
    found = whole.findings()
    for check in ("explosion", "grad_agreement", "nonfinite", "outlier_rank"):  # not vacuous: the rounds' checks fire
        assert any(e[0] == "raised" for e in found.get(check, [])), (check, found)
    a, b = whole.state.jobs["j"], sliced.state.jobs["j"]
    assert (a.rounds_complete, a.rounds_incomplete) == (b.rounds_complete, b.rounds_incomplete) == (STEPS // 5, 0)
    from .test_scale_probe import _same_round

    _same_round(b.last_round, a.last_round)


def _one_round_in_slices(feed: Feed, traffic, step: int = 0) -> None:
    for r in range(WORLD):
        feed.send(feed.records([traffic[r][step]])[0])
    assert len(feed.state.closing) == 1 and feed.state.jobs["j"].deferred is not None


def test_a_round_in_slices_of_a_job_dropped_meanwhile_is_dropped_and_a_failing_one_skipped(monkeypatch):
    """The round of a job the state dropped is not reconciled on; a reconciliation that raises
    (a bug of ours) is counted as internal, and the job's events that waited behind it still run,
    in order, so its checks go on; the job's probe memory is given back in both cases."""
    traffic = with_probes(scenario(set()))
    f = Feed(ROUND_CHECKS, round_slice_ranks=1)
    _one_round_in_slices(f, traffic)
    job = f.state.jobs["j"]
    assert job.pending_bytes > 0
    f.state.registry.drop(job)
    assert f.state.advance() is False and not f.state.closing and job.deferred is None

    import gradwatch.aggregator.reconcile as rec

    g = Feed(ROUND_CHECKS, round_slice_ranks=1)
    monkeypatch.setattr(rec.reductions, "aggregate_all", lambda arrays: 1 / 0)
    _one_round_in_slices(g, traffic)
    for s in range(1, 5):  # steps behind the round: their events wait
        for r in range(WORLD):
            g.send(g.records([traffic[r][s]])[0])
    job = g.state.jobs["j"]
    waiting = [e[0] for e in job.deferred if isinstance(e, tuple)]
    assert waiting.count("on_steps") == 4
    called = []
    dispatch = g.runner.dispatch
    monkeypatch.setattr(g.runner, "dispatch", lambda method, *a: (called.append(method), dispatch(method, *a)))
    g.state.finish_closing()
    assert g.state.rejected["internal"] == 1 and job.deferred is None and job.pending_bytes == 0
    assert job.last_round is None and called == waiting  # the later steps judged, in order


def test_a_rounds_slices_yield_to_waiting_frames_within_a_bound():
    """SliceGate: with no frame waiting a large round's slices run back to back; while frames
    wait, at most ROUND_SHARE of the writer's time, until the round has been in slices for
    ROUND_WAIT_S, when it finishes back to back (its checks wait for it); a new round starts over."""
    from gradwatch.aggregator.daemon import ROUND_SHARE, ROUND_WAIT_S, SliceGate

    gate, a, b = SliceGate(), object(), object()
    assert gate.ready(a, False, 10.0)  # nothing waits: at once
    gate.ran(10.0, 10.2)  # a 0.2 s slice
    assert gate.ready(a, False, 10.2)
    due = 10.0 + 0.2 / ROUND_SHARE
    assert not gate.ready(a, True, 10.2) and not gate.ready(a, True, due - 0.01)
    assert gate.ready(a, True, due)
    gate.ran(due, due + 0.01)  # short slices: the share is what the last one took
    assert not gate.ready(a, True, due + 0.02) and gate.ready(a, True, due + 0.01 + 0.01 / ROUND_SHARE)
    gate.ran(10.8, 10.95)
    assert not gate.ready(a, True, 10.0 + ROUND_WAIT_S - 0.01)
    assert gate.ready(a, True, 10.0 + ROUND_WAIT_S)  # in slices for ROUND_WAIT_S: back to back
    assert gate.ready(b, True, 20.0)  # the next round: its first slice at once
    gate.ran(20.0, 20.3)
    assert not gate.ready(b, True, 20.31)
