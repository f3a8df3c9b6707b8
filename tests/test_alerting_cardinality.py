"""Cardinality budget (case C34): a synthetic 1,024-rank x 200-layer job, fed as real wire frames to an
in-process aggregator (no sockets, no ranks), exports a bounded number of series; the figures are the
ones the scrape job's sample_limit and the stated budget give (docs/operations.md: Cardinality budget).

Also: layer grouping combines member layers soundly, and the per-rank detail limit keeps the ranks a
finding names."""

from __future__ import annotations

import collections
import math
import re
from collections import Counter

import numpy as np
import pytest
import yaml

from gradwatch import wire
from gradwatch.aggregator import Aggregator, load
from gradwatch.aggregator.checks import Finding
from gradwatch.aggregator.runner import RunnerView
from gradwatch.aggregator.exporter import ESSENTIAL_RANK_METRICS, SnapshotCollector
from gradwatch.aggregator.reconcile import group_layers, layer_group, reconcile
from gradwatch.aggregator.snapshot import JobView, Snapshot

from .conftest import ROOT

WORLD, EVERY = 1024, 10
#: the budget docs/operations.md states for this job with layer_depth=2 and the default rank_detail_max
BUDGET = 8_000
SAMPLE_LIMIT = 20_000


def model_layers() -> list[str]:
    """200 leaf modules of a GPT-style model: embedding, 33 blocks of 6, head."""
    subs = ("ln_1", "attn.qkv", "attn.proj", "ln_2", "mlp.fc", "mlp.proj")
    names = ["embed", *(f"blocks.{b}.{s}" for b in range(33) for s in subs), "head"]
    assert len(names) == 200
    return names


def schema(rank: int, layers: list[str]) -> wire.Schema:
    params = tuple(p for m in layers for p in ((f"{m}.weight", (64, 64), "float32"), (f"{m}.bias", (64,), "float32")))
    slots = tuple((m, "", "Linear", "float32") for m in layers)
    return wire.Schema(wire.Header("big", rank, WORLD, f"boot{rank}", 0, 0.0), "host", rank % 8, EVERY, params, slots)


def report(rank: int, seq: int, step: int, sch: wire.Schema, rng) -> wire.Report:
    n_slots, n_params = len(sch.slots), len(sch.params)
    act = rng.random((n_slots, 6), dtype=np.float32)
    act[:, 5] = 0
    act_grad = np.stack([rng.random(n_slots, dtype=np.float32), np.zeros(n_slots, np.float32)], axis=1)
    param = np.stack([rng.random(n_params, dtype=np.float32), np.ones(n_params, np.float32),
                      np.zeros(n_params, np.float32)], axis=1)
    fp = np.arange(n_params, dtype=np.uint64) + np.uint64(step)
    return wire.Report(
        wire.Header("big", rank, WORLD, f"boot{rank}", seq, 0.0), sch.hash, step, 0.1, 1.0, 0,
        probe=True, act=act, act_grad=act_grad, param=param, fp_grad=fp, fp_weight=fp,
        local_grad_norm=1.0, compute_time=0.05, batch=8,
    )


def series(registry) -> Counter:
    """Series per metric family, as Prometheus would ingest them from the exposition."""
    from prometheus_client import generate_latest

    text = generate_latest(registry).decode()
    return Counter(re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line).group(0) for line in text.splitlines() if line and line[0] != "#")


@pytest.fixture(scope="module")
def big_job():
    """One in-process aggregator per setting, fed the same frames: two probed steps of every rank."""
    layers = model_layers()
    rng = np.random.default_rng(0)
    schemas = [schema(r, layers) for r in range(WORLD)]
    frames = [[wire.encode(s) for s in schemas]]
    for k, step in enumerate((0, EVERY)):
        frames.append([wire.encode(report(r, k + 1, step, schemas[r], rng)) for r in range(WORLD)])
    now = [0.0]
    aggs = {}
    for name, settings in {"grouped": dict(layer_depth=2), "full": dict(layer_depth=0)}.items():
        # exported from its first frame (proof_steps 0): two probed steps show its series
        agg = Aggregator(load(listen="tcp://127.0.0.1:0", proof_steps=0, **settings), clock=lambda: now[0])
        counts = []
        for batch in frames:
            for f in batch:
                agg.handle(f)
            now[0] += 0.05
            agg.state.tick()
            agg.publish()
            counts.append(series(agg.registry))
        agg.runner.close()
        aggs[name] = (agg, counts)
    return aggs


@pytest.mark.slow  # a 1024-rank, 200-layer job fed through the aggregator
def test_1024_rank_200_layer_job_stays_within_the_budget_C34(big_job):
    agg, counts = big_job["grouped"]
    got = counts[-1]
    total = sum(got.values())
    assert agg.snapshot.jobs[0].last_round.complete and len(agg.snapshot.jobs[0].ranks) == WORLD
    assert total <= BUDGET, f"{total} series > budget {BUDGET}: {got.most_common(12)}"
    # every rank keeps its essential series; layer series are per group of blocks, not per layer
    for name in ESSENTIAL_RANK_METRICS - {"gradwatch_check_rank_flagged"}:
        fam = name + ("_total" if name.endswith(("_steps", "_reports", "_lost")) else "")
        assert got[fam] == WORLD, fam
    assert got["gradwatch_layer_grad_norm"] == 3 * (33 + 2)
    assert got["gradwatch_rank_grad_norm"] == 0 and got["gradwatch_rank_step_seconds"] == 0
    print(f"\ncardinality: {total} series with layer_depth=2 (budget {BUDGET})")


@pytest.mark.slow
def test_series_count_is_constant_across_steps_C34(big_job):
    for name in ("grouped", "full"):
        _, counts = big_job[name]
        assert counts[1] == counts[2], name  # a new probed step adds no series


@pytest.mark.slow
def test_full_layer_paths_fit_the_scrape_sample_limit(big_job):
    """Even without grouping (the default), the job fits the shipped scrape job's sample_limit."""
    _, counts = big_job["full"]
    total = sum(counts[-1].values())
    assert counts[-1]["gradwatch_layer_grad_norm"] == 3 * 200
    assert total <= SAMPLE_LIMIT, total
    print(f"\ncardinality: {total} series with layer_depth=0 (sample_limit {SAMPLE_LIMIT})")


def test_shipped_scrape_job_sets_the_sample_limit_the_budget_assumes():
    cfg = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    (job,) = [j for j in cfg["scrape_configs"] if j["job_name"] == "gradwatch"]
    assert job["sample_limit"] == SAMPLE_LIMIT
    readme = (ROOT / "docs" / "operations.md").read_text()
    section = readme.split("## Cardinality budget", 1)[1].split("\n## ", 1)[0]
    assert f"{BUDGET:,}" in section and f"{SAMPLE_LIMIT:,}" in section


# --- layer grouping and the rank detail limit, on small hand-made rounds ---------------------------


def _round(values_by_rank: dict[int, dict[str, tuple]], layers: list[str]):
    """A reconciled round of ``len(values_by_rank)`` ranks from per-layer (mean, std, min, max, zero,
    nonfinite, out_grad_norm, param_grad_norm, weight_norm) tuples; one param per layer."""
    params = tuple((f"{m}.weight", (4,), "float32") for m in layers)
    slots = tuple((m, "", "ReLU", "float32") for m in layers)
    sch = wire.Schema(wire.Header("j", 0, len(values_by_rank), "b", 0, 0.0), "h", 0, 1, params, slots)
    reports = {}
    for r, vals in values_by_rank.items():
        v = np.array([vals[m] for m in layers], np.float32)
        reports[r] = wire.Report(
            wire.Header("j", r, len(values_by_rank), "b", 1, 0.0), sch.hash, 0, 0.1, 1.0, 0, probe=True,
            act=v[:, :6], act_grad=np.stack([v[:, 6], np.zeros(len(layers), np.float32)], 1),
            param=np.stack([v[:, 7], v[:, 8], np.zeros(len(layers), np.float32)], 1),
            fp_grad=np.zeros(len(layers), np.uint64), fp_weight=np.zeros(len(layers), np.uint64),
        )
    return reconcile(len(values_by_rank), {sch.hash: sch}, 0, reports, True)


def test_layer_group_keeps_the_first_components():
    assert layer_group("blocks.3.mlp.fc", 2) == "blocks.3"
    assert layer_group("head", 2) == "head" and layer_group("blocks.3.mlp.fc", 0) == "blocks.3.mlp.fc"


def test_grouping_combines_member_layers_soundly():
    layers = ["b.0.fc", "b.0.act", "head"]
    rr = _round({
        0: {"b.0.fc": (1, 1, -2, 3, 0.0, 0, 3, 3, 1), "b.0.act": (3, 1, 0, 5, 0.5, 2, 4, 4, 1), "head": (0, 1, -1, 1, 0, 0, 1, 1, 1)},
        1: {"b.0.fc": (1, 1, -2, 3, 0.0, 0, 6, 6, 1), "b.0.act": (3, 1, 0, 5, 0.9, 0, 8, 8, 1), "head": (0, 1, -1, 1, 0, 0, 1, 1, 1)},
    }, layers)
    g = group_layers(rr, 2)
    assert g.layers == ("b.0", "head") and g.modules == ("b.0", "head") and g.layer_types == ("ReLU", "ReLU")
    i = g.layers.index("b.0")

    def agg(stat):
        values, observed = g.agg[stat]
        assert observed[i]
        return tuple(values[:, i])  # min, median, max over ranks

    assert agg("output_grad_norm") == pytest.approx((5.0, 7.5, 10.0))  # sqrt(3^2+4^2), sqrt(6^2+8^2)
    assert agg("grad_norm") == pytest.approx((5.0, 7.5, 10.0))
    assert agg("weight_norm") == pytest.approx((math.sqrt(2),) * 3)
    assert agg("activation_nonfinite") == (0.0, 1.0, 2.0)  # summed per rank
    assert agg("activation_zero_ratio") == pytest.approx((0.5, 0.7, 0.9))  # the worst member
    assert agg("activation_min")[0] == -2 and agg("activation_max")[2] == 5
    assert agg("activation_mean") == pytest.approx((2.0,) * 3)
    # pooled std of two equal-sized members with means 1 and 3 and stds 1: sqrt(1 + 1) = sqrt(2)
    assert agg("activation_std") == pytest.approx((math.sqrt(2),) * 3)


def test_grouping_propagates_nan_and_skips_unobserved_members():
    layers = ["b.0.fc", "b.0.act"]
    nan = float("nan")
    rr = _round({
        0: {"b.0.fc": (1, 1, 0, 1, 0, 1, nan, nan, 1), "b.0.act": (1, 1, 0, 1, 0, 0, 2, 2, 1)},
        1: {"b.0.fc": (1, 1, 0, 1, 0, 0, 1, 1, 1), "b.0.act": (1, 1, 0, 1, 0, 0, 2, 2, 1)},
    }, layers)
    rr.act_grad[1, 0] = np.nan  # rank 1 never got b.0.fc's output gradient: not observed
    g = group_layers(rr, 2)
    values, observed = g.agg["output_grad_norm"]
    assert observed[0] and all(math.isnan(x) for x in values[:, 0])  # rank 0's NaN poisons the group
    assert g.act_grad[1, 0, 0] == pytest.approx(2.0)  # rank 1: only its observed member


def _snap(world: int, active=()):
    from gradwatch.aggregator.snapshot import RankView

    ranks = tuple(RankView(r, "h", 0, 5, 0.1, 1.0, 0, 6, 1, 0, 7, 0, 0, 0.0, 0, 0) for r in range(world))
    return Snapshot(jobs=(JobView("j", world, ranks, None, 0, 0),), checks=RunnerView(active=tuple(active)))


def test_rank_detail_limit_keeps_essential_series_and_the_ranks_a_finding_names():
    from prometheus_client import CollectorRegistry

    flagged = Finding("straggler", "j", 5, "slow", rank=3)
    counts = {}
    for limit in (None, 4):
        reg = CollectorRegistry()
        reg.register(SnapshotCollector(lambda: _snap(8, [flagged]), rank_detail_max=limit))
        counts[limit] = series(reg)
    assert counts[None]["gradwatch_rank_step_seconds"] == 8
    assert counts[4]["gradwatch_rank_step_seconds"] == 1  # only rank 3, the one named
    assert counts[4]["gradwatch_rank_steps_total"] == 8 and counts[4]["gradwatch_rank_nonfinite_steps_total"] == 8
    reg = CollectorRegistry()
    reg.register(SnapshotCollector(lambda: _snap(4), rank_detail_max=4))  # at the limit: everything
    assert series(reg)["gradwatch_rank_step_seconds"] == 4


def test_rank_series_limit_keeps_only_named_ranks_and_job_level_stand_ins():
    """Above rank_series_max ranks even the essential per-rank series go (a 16,384-rank job would
    export ~100,000 of them, 5x the shipped sample_limit), but for the ranks a finding names;
    job-level series stand in. At or below the limit nothing changes and no job-level family
    appears (the golden exposition of small jobs is untouched)."""
    from dataclasses import replace

    from prometheus_client import CollectorRegistry, generate_latest

    flagged = Finding("step_skew", "j", 5, "behind", rank=3)

    def snap(world):
        s = _snap(world, [flagged])
        ranks = tuple(r._replace(step=10 + r.rank, last_seen=100.0 + r.rank) for r in s.jobs[0].ranks)
        return replace(s, jobs=(replace(s.jobs[0], ranks=ranks, totals=(("agent_drops", 2), ("lost", 0),
                                                                        ("nonfinite_steps", 1), ("steps", 48))),))

    def scrape(world, limit):
        reg = CollectorRegistry()
        reg.register(SnapshotCollector(lambda: snap(world), rank_detail_max=4, rank_series_max=limit))
        return series(reg), generate_latest(reg).decode()

    got, text = scrape(8, 4)
    assert got["gradwatch_rank_step"] == 1 and got["gradwatch_rank_steps_total"] == 1  # rank 3 only
    assert 'gradwatch_rank_step{job_id="j",rank="3"} 13.0' in text
    assert got["gradwatch_check_rank_flagged"] == 1
    assert 'gradwatch_job_rank_step{agg="min",job_id="j"} 10.0' in text
    assert 'gradwatch_job_rank_step{agg="median",job_id="j"} 13.5' in text
    assert 'gradwatch_job_rank_step{agg="max",job_id="j"} 17.0' in text
    assert 'gradwatch_job_rank_last_seen_timestamp_seconds{agg="min",job_id="j"} 100.0' in text
    assert 'gradwatch_job_steps_total{job_id="j"} 48.0' in text
    assert 'gradwatch_job_agent_dropped_reports_total{job_id="j"} 2.0' in text
    small, text = scrape(4, 4)  # at the limit: every rank, no job-level family at all
    assert small["gradwatch_rank_step"] == 4 and "gradwatch_job_rank_step" not in text
    assert "gradwatch_job_steps" not in text
    assert scrape(8, None)[0]["gradwatch_rank_step"] == 8  # no limit: every rank


def test_a_huge_jobs_round_series_are_those_of_the_ranks_a_finding_names():
    """Above rank_series_max the per-rank series of the latest round (totals over layers, the
    agent's cost and interval) come from the named ranks' rows of the round, looked up among
    its ranks: a named rank missing from the round exports none, the others their own row."""
    from dataclasses import replace

    from prometheus_client import CollectorRegistry, generate_latest

    layers = ["embed", "head"]
    rng = np.random.default_rng(0)
    reports = {}
    for r in (0, 1, 2, 3, 5, 6, 7):  # rank 4 missed the round
        sch = schema(r, layers)
        rep = report(r, 1, 10, sch, rng)
        rep.act[0, 5] = 10 * r  # the rank's non-finite activation elements: tells the rows apart
        reports[r] = rep
    rr = reconcile(8, {sch.hash: sch}, 10, reports, False)
    # ranks in the round (first, last, between), one missing from it, one past the world
    named = [Finding("straggler", "j", 10, "slow", rank=r) for r in (7, 5, 0)] + [
        Finding("step_skew", "j", 10, "behind", rank=r) for r in (4, 9)]
    s = _snap(8, named)
    s = replace(s, jobs=(replace(s.jobs[0], last_round=rr),))
    reg = CollectorRegistry()
    reg.register(SnapshotCollector(lambda: s, rank_detail_max=4, rank_series_max=4))
    text = generate_latest(reg).decode()
    got = [line for line in text.splitlines() if line.startswith("gradwatch_rank_activation_nonfinite{")]
    assert got == [f'gradwatch_rank_activation_nonfinite{{job_id="j",rank="{r}"}} {10.0 * r}' for r in (0, 5, 7)]
    # per rank, from its latest message (not the round): the named ranks of the world, 4 included
    assert series(reg)["gradwatch_rank_probe_interval_steps"] == 4


@pytest.mark.parametrize("rank_view_max", [None, 1])  # every rank's view, or a huge job's columns
def test_job_totals_count_forgotten_ranks_so_they_never_decrease(rank_view_max):
    from gradwatch.aggregator.snapshot import snapshot
    from gradwatch.aggregator.jobs import JobState, RankState
    from gradwatch.aggregator.state import State

    now = [0.0]
    st = State(rank_ttl_s=10, clock=lambda: now[0], rank_view_max=rank_view_max)
    job = st.jobs["j"] = JobState("j", 2, admitted=True, proven=True)
    job.ranks = {0: RankState(0, steps=5, last_seen=0.0, agent_drops=1, drops_base=2), 1: RankState(1, steps=7, last_seen=9.0)}
    before = dict(snapshot(st, 0.0).jobs[0].totals)
    now[0] = 12.0
    st.tick()  # rank 0 silent for 12 s > ttl: forgotten
    after = dict(snapshot(st, 0.0).jobs[0].totals)
    assert 0 not in job.ranks and before == after == {"steps": 12, "nonfinite_steps": 0, "agent_drops": 3, "lost": 0}


def test_a_huge_jobs_snapshot_has_the_columns_totals_and_views_of_a_full_one():
    """Above rank_view_max a snapshot keeps views of the named ranks only (a finding naming a rank
    gone from the job, or another job's rank, adds none) and columns over every rank: equal to what
    the views of every rank give, with distinct values in every field and forgotten ranks' counters."""
    from gradwatch.aggregator.checks import Thresholds
    from gradwatch.aggregator.runner import Runner
    from gradwatch.aggregator.snapshot import snapshot
    from gradwatch.aggregator.jobs import JobState, RankState
    from gradwatch.aggregator.state import State

    rng = np.random.default_rng(1)
    findings = [Finding("straggler", "j", 5, "slow", rank=3), Finding("rank_silent", "j", 5, "gone", rank=99),
                Finding("straggler", "k", 5, "slow", rank=4), Finding("explosion", "j", 5, "norm", rank=None)]
    runner = Runner(["straggler", "rank_silent", "explosion"], Thresholds())
    for i, f in enumerate(findings):  # active findings, as the checks would have raised them
        runner.active.setdefault((f.job, f.check), {})[(i,)] = f
    st = State(clock=lambda: 1000.0, runner=runner)
    job = st.jobs["j"] = JobState("j", 8, admitted=True, proven=True)
    job.ranks = {r: RankState(r, step=int(rng.integers(0, 100)), steps=int(rng.integers(0, 10**6)),
                              nonfinite_steps=int(rng.integers(0, 9)), lost=int(rng.integers(0, 50)),
                              agent_drops=int(rng.integers(0, 20)), drops_base=int(rng.integers(0, 20)),
                              last_seen=float(rng.uniform(900, 1000))) for r in (0, 1, 2, 3, 5, 6, 7)}
    job.forgotten = collections.Counter(steps=11, lost=2, agent_drops=4)
    # the checks' per-rank values: a huge job's are copied for the named ranks only, others' whole
    scores = {(str(r),): r / 8 for r in range(8)}
    for job_id in ("j", "k"):
        runner.checks["straggler"].state(job_id).values = {"rank_straggler_relative_score": scores}
    whole = snapshot(st, 5000.0)
    full = whole.jobs[0]
    st.limits.rank_view_max = 4
    few = snapshot(st, 5000.0)
    cut = few.jobs[0]
    want = {("k", *lv): v for lv, v in scores.items()}
    assert whole.checks.values["rank_straggler_relative_score"] == {**want, **{("j", *lv): v for lv, v in scores.items()}}
    assert few.checks.values["rank_straggler_relative_score"] == {**want, ("j", "3"): 3 / 8}
    assert full.n_ranks == cut.n_ranks == 7 and full.rank_columns is None
    assert cut.ranks == tuple(v for v in full.ranks if v.rank == 3)
    assert cut.totals == full.totals and dict(cut.totals)["steps"] == sum(r.steps for r in job.ranks.values()) + 11
    for attr in ("step", "last_seen"):
        np.testing.assert_array_equal(cut.rank_columns[attr], [getattr(v, attr) for v in full.ranks])


def test_the_agents_cost_gauges_follow_its_latest_message_not_only_probed_steps():
    """An agent over its budget probes every 16,384+ steps: a run shorter than that is never
    probed after the agent knows, and the gauges, read from the latest probed round, said 0 and
    8 while every rank warned. Every message carries them: the gauges show the latest."""
    from prometheus_client import CollectorRegistry, generate_latest

    from gradwatch.aggregator.snapshot import snapshot
    from gradwatch.aggregator.state import State

    st = State(clock=lambda: 100.0, proof_steps=0)  # exported as it comes
    sch = wire.Schema(wire.Header("j", 0, 1, "b", 0, 0.0), "n", 0, 1, (("w", (4,), "float32"),), ())
    st.apply(sch)
    recs = [wire.Report(wire.Header("j", 0, 1, "b", 1 + s, 0.0), sch.hash, s, 0.01, 1.0, 0, agent_cost=0.06,
                        probe_interval=32768, over_budget=True) for s in range(3)]
    st.apply(wire.Steps.of(recs))
    reg = CollectorRegistry()
    reg.register(SnapshotCollector(lambda: snapshot(st, 1000.0)))
    text = generate_latest(reg).decode()
    assert 'gradwatch_rank_agent_over_budget{job_id="j",rank="0"} 1.0' in text
    assert 'gradwatch_rank_probe_interval_steps{job_id="j",rank="0"} 32768.0' in text
    assert 'gradwatch_rank_agent_cost_ratio{job_id="j",rank="0"} 0.06' in text


@pytest.mark.parametrize("check", ["explosion", "grad_agreement"])  # a plain check; one with a knock-on
def test_when_a_finding_last_named_each_rank_is_kept_for_a_bounded_number_of_ranks_and_exported_in_any_job(check):
    """gradwatch_rank_finding_raised_timestamp_seconds names the rank of a finding no scrape saw
    flagged (the alerts' rank branch). Its series stay bounded whatever a job does: a job's first
    RANKS_TIMED_MAX ranks named per check, each one's latest raised finding; the others still in
    findings_total. A huge job's per-rank filter leaves it whole, and forgetting the job drops it."""
    from gradwatch.aggregator.checks import Evaluation, Outcome, Thresholds
    from gradwatch.aggregator.runner import Runner

    clock = [1000.0]
    runner = Runner([check], Thresholds(), wall=lambda: clock[0])
    c, cap = runner.checks[check], Runner.RANKS_TIMED_MAX

    def raise_ranks(ranks, step):
        clock[0] += 10
        runner._record("j", c, Evaluation(Outcome.FINDING, tuple(Finding(check, "j", step, "bad", rank=r) for r in ranks)))
        runner._record("j", c, Evaluation(Outcome.HEALTHY))  # resolved: the next raise is a new finding

    raise_ranks(range(cap + 36), 1)  # 100 ranks at once, at 1010 s
    raise_ranks([3, cap + 5], 2)  # a kept rank again, and one past the bound, at 1020 s
    raise_ranks([np.int64(4)], 3)  # a rank as numpy gives it: kept as the int it is
    raise_ranks([None], 4)  # a finding naming no rank
    view = runner.view()
    at = dict(view.raised_at)
    assert set(at) == {("j", check, r) for r in range(cap)} and all(type(k[2]) is int for k in at)
    assert at[("j", check, 3)] == 1020.0 and at[("j", check, 4)] == 1030.0 and at[("j", check, 0)] == 1010.0
    assert dict(view.raised)[("j", check)] == cap + 36 + 2 + 1 + 1

    snap = Snapshot(jobs=(JobView("j", 100_000, (), None, 0, 0, reporting=100_000),), checks=view)
    for limit in (None, 4):  # a job of 100,000 ranks: per-rank series only for named ranks, but these
        got = {(s.labels["check"], int(s.labels["rank"])): s.value
               for fam in SnapshotCollector(lambda: snap, rank_detail_max=limit, rank_series_max=limit).collect()
               if fam.name == "gradwatch_rank_finding_raised_timestamp_seconds" for s in fam.samples}
        assert got == {(check, r): t for (_, _, r), t in at.items()}

    runner.forget("j")
    assert not runner.raised_at and not runner.view().raised_at
    raise_ranks([cap + 5], 5)  # the job's bound starts afresh
    assert dict(runner.view().raised_at) == {("j", check, cap + 5): 1050.0}
