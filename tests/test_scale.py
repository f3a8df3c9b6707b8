"""The aggregator's fast paths keep its behaviour. Each fast path is compared with the
straightforward computation of the same result, on inputs chosen to reach its corners (ties, duplicates,
several schemas in one round, checks without a handler)."""

from __future__ import annotations

import numpy as np

from gradwatch import wire
from gradwatch.aggregator import Aggregator, load
from gradwatch.aggregator.checks import Check, Thresholds
from gradwatch.aggregator.runner import Runner
from gradwatch.aggregator.checks.straggler import _peer_medians
from gradwatch.aggregator.reconcile import reconcile


def test_peer_medians_equal_numpy_median_of_the_others_bit_for_bit():
    rng = np.random.default_rng(0)
    for trial in range(2000):
        n = int(rng.integers(2, 40))
        x = rng.random(n)
        if trial % 3 == 0:
            x = np.round(x * 4) / 4  # ties
        xs = [float(v) for v in x]
        want = [float(np.median([y for q, y in enumerate(xs) if q != k])) for k in range(n)]
        assert _peer_medians(xs).tolist() == want, xs


class _Job:
    def __init__(self, name):
        self.job = name


def test_dispatch_skips_checks_without_the_handler_but_gives_each_a_status_first():
    calls = []

    class Reports(Check):
        name = "reports"

        def on_steps(self, job, views):
            calls.append(("reports", job.job))

    class Ticks(Check):
        name = "ticks"

        def on_tick(self, job, now):
            calls.append(("ticks", job.job))

    runner = Runner([], Thresholds())
    runner.checks = {"reports": Reports(Thresholds()), "ticks": Ticks(Thresholds())}
    for job in ("a", "a", "b"):
        runner.dispatch("on_steps", _Job(job), [])
    assert calls == [("reports", "a")] * 2 + [("reports", "b")]
    # both checks have a status for both jobs from their first event (no_data: nothing said yet)
    assert runner.view().status == (("a", "reports", "no_data"), ("a", "ticks", "no_data"),
                                     ("b", "reports", "no_data"), ("b", "ticks", "no_data"))
    runner.forget("a")
    runner.dispatch("on_tick", _Job("a"), 0.0)
    assert calls[-1] == ("ticks", "a") and ("a", "reports", "no_data") in runner.view().status


def _schema(rank, layers, dup=False):
    params = tuple((f"{m}.weight", (4,), "float32") for m in layers)
    if dup:
        params += ((f"{layers[0]}.weight", (4,), "float32"),)
    slots = tuple((m, "", "Linear", "float32") for m in layers)
    return wire.Schema(wire.Header("j", rank, 4, "b", 0, 0.0), "h", 0, 1, params, slots)


def _reference(world, schemas, step, reports, complete):
    """The round reconciled rank by rank (each rank's rows and fingerprints placed one at a time):
    what the reconciliation grouped by schema must equal."""
    from gradwatch.aggregator import reductions

    rr = reconcile(world, schemas, step, reports, complete)
    lidx = {n: i for i, n in enumerate(rr.layers)}
    pidx = {n: i for i, n in enumerate(rr.params)}
    act = np.full_like(rr.act, np.nan)
    count = np.full_like(rr.act_count, np.nan)
    seen = np.zeros_like(rr.fp_grad_seen)
    for k, r in enumerate(rr.ranks):
        rep, s = reports[r], schemas[reports[r].schema]
        cols = [lidx[m + o] for m, o, _, _ in s.slots]
        act[k, cols] = rep.act
        if rep.act_count is not None:
            count[k, cols] = rep.act_count
        pcols = np.array([pidx[p[0]] for p in s.params])
        seen[k, pcols[reductions.observed_rows("param", rep.param)]] = True
    return rr, act, count, seen


def test_reconcile_by_schema_equals_rank_by_rank():
    rng = np.random.default_rng(1)
    a = _schema(0, ["x", "y", "z"])
    b = _schema(1, ["y", "w"], dup=True)  # another schema in the same round, a duplicate name
    schemas = {a.hash: a, b.hash: b}
    reports = {}
    for r, s in enumerate([a, b, a, b]):
        n_s, n_p = len(s.slots), len(s.params)
        param = rng.random((n_p, 3)).astype(np.float32)
        param[r % n_p, 2] = np.nan  # one parameter without a gradient on each rank
        reports[r] = wire.Report(
            wire.Header("j", r, 4, "b", 1, 0.0), s.hash, 10, 0.1, 1.0, 0, probe=True,
            act=rng.random((n_s, 6)).astype(np.float32), act_grad=rng.random((n_s, 2)).astype(np.float32),
            param=param, act_count=None if r == 3 else np.ones((n_s, 2), np.float32),
            fp_grad=np.arange(n_p, dtype=np.uint64), fp_weight=np.arange(n_p, dtype=np.uint64) + np.uint64(r))
    rr, act, count, seen = _reference(4, schemas, 10, reports, True)
    assert rr.layers == ("x", "y", "z", "w") and rr.params == ("x.weight", "y.weight", "z.weight", "w.weight")
    np.testing.assert_array_equal(rr.act, act)
    np.testing.assert_array_equal(rr.fp_grad_seen, seen)
    np.testing.assert_array_equal(rr.act_count, count)
    assert np.isnan(rr.act_count[3]).all() and not np.isnan(rr.act_count[0, :3]).any()
    # schema b lists y.weight twice: the later row wins, as in a per-rank assignment
    assert rr.fp_weight[1].tolist() == [0, 3, 0, 2] and rr.fp_weight[3].tolist() == [0, 5, 0, 4]


def test_a_job_through_the_fast_paths_has_the_same_findings_and_series(tmp_path):
    """bench/load.py's job in process: healthy, every report received, one round per probe."""
    from bench.load import Job, report_frame, schema_frame

    job = Job("j", 32, 12)
    now = [0.0]
    agg = Aggregator(load(listen="tcp://127.0.0.1:0"), clock=lambda: now[0])
    for r in range(job.world):
        agg.handle(schema_frame(job, r, 0))
    for step in range(40):
        for r in range(job.world):
            agg.handle(report_frame(job, r, step + 1, step, step % 5 == 0, 0.1))
        now[0] += 0.1
        agg.state.tick()
    agg.publish()
    snap = agg.snapshot
    assert dict(snap.received) == {"schema": 32, "report": 32 * 40} and not snap.rejected
    assert snap.jobs[0].rounds_complete == 8 and snap.jobs[0].last_round.step == 35
    assert not snap.checks.active
    agg.runner.close()
