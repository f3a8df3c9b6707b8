"""Gradient agreement and replica drift: pure-function tier on recorded rounds, the per-step
gradient norms through real wire frames into a real State and Runner, then fault injection on
real 3-rank gloo DDP runs against a real aggregator process."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from gradwatch import wire
from gradwatch.aggregator.checks import Outcome, Thresholds
from gradwatch.aggregator.checks._fingerprints import minority
from gradwatch.aggregator.checks.grad_agreement import GradientAgreement
from gradwatch.aggregator.checks.replica_drift import ReplicaDrift

from .conftest import run_demo, start_aggregator, wait_for
from .test_checks_gradients import JOB as UNIT, PARAMS, PIDX, SLOTS, Job, probe

CONSISTENCY = {"grad_agreement", "replica_drift"}


def _round(fp, seen=None, step=7, ranks=None):
    fp = np.asarray(fp, np.uint64)
    seen = np.ones(fp.shape, bool) if seen is None else np.asarray(seen)
    return SimpleNamespace(
        step=step, ranks=tuple(ranks or range(fp.shape[0])), params=tuple(f"p{i}" for i in range(fp.shape[1])),
        fp_grad=fp, fp_grad_seen=seen, fp_weight=fp, fp_weight_seen=seen,
    )


JOB = SimpleNamespace(job="j", ranks={k: SimpleNamespace(closing=False) for k in range(8)})  # ranks heard, none said goodbye


def test_minority_names_the_rank_that_differs():
    fp = np.array([[1, 2, 3], [1, 2, 4], [1, 2, 3], [1, 9, 3]], np.uint64)
    assert minority(fp, np.ones_like(fp, bool)) == ({1: [2], 3: [1]}, [])


def test_minority_ignores_unseen_entries_and_reports_ties():
    fp = np.array([[5, 1], [6, 1], [0, 2]], np.uint64)
    seen = np.array([[1, 1], [1, 1], [0, 1]], bool)
    bad, tied = minority(fp, seen)
    assert bad == {2: [1]} and tied == [0]  # p0: 5 vs 6 with rank 2 not holding it


def test_grad_agreement_outcomes_on_recorded_rounds():
    check = GradientAgreement(Thresholds())
    assert check.on_round(JOB, _round([[1, 2]])).outcome == Outcome.NO_DATA  # one rank
    assert check.on_round(JOB, _round([[1, 2], [1, 2], [1, 2]])).outcome == Outcome.HEALTHY
    ev = check.on_round(JOB, _round([[1, 2], [1, 3], [1, 2]], ranks=(4, 5, 6)))
    assert ev.outcome == Outcome.FINDING
    (f,) = ev.findings
    assert (f.check, f.rank, f.step, f.details["params"]) == ("grad_agreement", 5, 7, ["p1"])
    # a later step judged without rank 5 resolves its finding; the same step again would fold into it
    tie = check.on_round(JOB, _round([[1, 2], [1, 3]], step=8))
    assert [(f.rank, f.details["params"]) for f in tie.findings] == [(None, ["p1"])]


def test_replica_drift_reads_weight_fingerprints():
    r = _round([[1, 2], [1, 2], [1, 2]])
    r.fp_weight = np.array([[1, 2], [1, 2], [8, 2]], np.uint64)
    (f,) = ReplicaDrift(Thresholds()).on_round(JOB, r).findings
    assert (f.check, f.rank, f.details["params"]) == ("replica_drift", 2, ["p0"])


@pytest.mark.parametrize("cls", [GradientAgreement, ReplicaDrift])
def test_a_round_too_small_to_judge_leaves_the_findings_standing(cls):
    """A burst of probes on the one rank whose own gradient norm spiked makes rounds of that rank
    alone. Such a round cannot judge agreement and changes nothing (answering no_data would drop
    the active finding, and the next full round would raise the same fault again: two findings for
    one fault); a check that never judged the job says no_data."""
    check = cls(Thresholds())
    assert check.on_round(JOB, _round([[1, 2]], ranks=(2,))).outcome == Outcome.NO_DATA  # nothing judged yet
    full = _round([[1, 2], [1, 2], [8, 2]], step=10)
    (f,) = check.on_round(JOB, full).findings
    assert (f.rank, f.details["params"]) == (2, ["p0"])
    for step in (11, 12):  # the burst: rank 2 alone
        assert check.on_round(JOB, _round([[8, 2]], step=step, ranks=(2,))) is None
    again = _round([[1, 2], [1, 2], [8, 2]], step=20)
    (g,) = check.on_round(JOB, again).findings
    assert g.key == f.key and g.step == 10  # the same finding, not a new one


@pytest.mark.parametrize("cls", [GradientAgreement, ReplicaDrift])
def test_a_named_rank_gone_for_good_does_not_keep_its_finding_through_rounds_too_small(cls):
    """A 2-rank job whose named rank's agent closed while training goes on (or was forgotten):
    every later round holds the other rank alone. Its finding must not stand for ever (review)."""
    job = SimpleNamespace(job="j", ranks={0: SimpleNamespace(closing=False), 1: SimpleNamespace(closing=False),
                                          2: SimpleNamespace(closing=False)})
    check = cls(Thresholds())
    (f,) = check.on_round(job, _round([[1, 2], [1, 2], [8, 2]], step=10)).findings
    assert f.rank == 2
    assert check.on_round(job, _round([[8, 2]], step=11, ranks=(2,))) is None  # live: it stands
    job.ranks[2].closing = True  # its agent said goodbye, training goes on
    assert check.on_round(job, _round([[1, 2]], step=12, ranks=(0,))).outcome == Outcome.NO_DATA
    del job.ranks[2]
    check = cls(Thresholds())
    check.on_round(job, _round([[1, 2], [1, 2], [8, 2]], step=10, ranks=(0, 1, 3)))
    assert check.on_round(job, _round([[1, 2]], step=11, ranks=(0,))).outcome == Outcome.NO_DATA  # rank 3: never heard


@pytest.mark.parametrize("cls", [GradientAgreement, ReplicaDrift])
def test_a_tie_finding_naming_no_rank_goes_once_one_of_its_ranks_is_gone_for_good(cls):
    """Two ranks that disagree with no majority give a finding naming no rank (its ranks in
    ``details``). Rounds of one rank leave it standing while both are live, and drop it once one
    of them closed while the other trains on (it stood until rank_ttl_s: nothing named was gone)."""
    job = SimpleNamespace(job="j", ranks={0: SimpleNamespace(closing=False), 1: SimpleNamespace(closing=False)})
    check = cls(Thresholds())
    (f,) = check.on_round(job, _round([[1, 2], [8, 2]], step=10, ranks=(0, 1))).findings
    assert f.rank is None
    assert check.on_round(job, _round([[1, 2]], step=11, ranks=(0,))) is None  # both live: it stands
    job.ranks[1].closing = True
    assert check.on_round(job, _round([[1, 2]], step=12, ranks=(0,))).outcome == Outcome.NO_DATA


def _minority_per_set(fp, seen, holders, rtol):
    """The vote held set by set: each holders number over the whole matrix (the definition)."""
    out, tied = {}, set()
    for h in np.unique(holders):
        bad, t = minority(fp, seen & (holders == h), rtol=rtol)
        for k, ps in bad.items():
            out.setdefault(k, []).extend(ps)
        tied.update(t)
    return {k: sorted(v) for k, v in out.items()}, sorted(tied)


@pytest.mark.parametrize("rtol", [None, 1e-3])
def test_minority_within_holders_matches_the_vote_set_by_set(rtol):
    rng = np.random.default_rng(11)
    found = 0
    for _ in range(200):
        R, P = int(rng.integers(2, 12)), int(rng.integers(1, 6))
        holders = rng.integers(0, 4, (R, P)) * (rng.random((R, P)) < 0.8)
        if rng.random() < 0.3:
            holders *= 10**6  # numbers too far apart for the sets' table: sorted instead
        if rtol is None:
            fp = rng.integers(0, 3, (R, P)).astype(np.uint64)
        else:
            fp = rng.choice([1.0, 1.0 + 1e-5, 2.0, np.nan], (R, P))
        seen = rng.random((R, P)) < (0.9 if rng.random() < 0.5 else 1.0)  # every entry seen: the fast path
        got = minority(fp, seen, holders, rtol=rtol)
        assert got == _minority_per_set(fp, seen, holders, rtol)
        found += len(got[0]) + len(got[1])
    assert found > 50  # the draws do split


def test_holder_sets_are_numpys_unique_whatever_the_keys():
    from gradwatch.aggregator.checks._fingerprints import _sets

    rng = np.random.default_rng(12)
    for _ in range(300):
        keys = rng.integers(0, int(rng.choice([3, 50, 10**7])), int(rng.integers(0, 40)))
        _, first, inv = np.unique(keys, return_index=True, return_inverse=True)
        got = _sets(keys)
        assert np.array_equal(got[0], first) and np.array_equal(got[1], inv.reshape(-1))


def test_minority_with_a_tolerance_groups_close_values():
    v = np.array([[1.0, 2.0], [1.0 + 1e-7, 2.0], [1.0, 2.002], [1.1, 2.0]])
    bad, tied = minority(v, np.ones(v.shape, bool), rtol=1e-5)
    assert bad == {2: [1], 3: [0]} and tied == []  # 1e-7 apart is the same value, 1e-3 is not
    assert minority(v[:2], np.ones((2, 2), bool), rtol=0.0) == ({}, [0])  # exact: the two split


# --- every step's gradient norms, through the wire into a real State and Runner ---------------------

CHECKS = ("grad_agreement", "replica_drift")
#: healthy per-parameter gradient norms after all-reduce, float32 as on the wire
NORMS = np.float32([0.75, 1.25, 0.0625, 3.5, 0.3])


def sentinel(job: Job, rank: int, step: int, norms=NORMS, digest=None, fp=None) -> None:
    """Rank ``rank``'s report of ``step`` with per-parameter gradient norms ``norms``; with ``fp``
    (uint64 gradient fingerprints) a probe report."""
    extra = {}
    if fp is not None:
        extra = dict(probe=True, fp_grad=np.asarray(fp, np.uint64), fp_weight=np.zeros(len(PARAMS), np.uint64), **probe())
    job.send(wire.Report(job.header(rank), digest or job.digest[rank], step, 0.01, 1.0, 0, local_grad_norm=1.0 + rank,
                         grad_norms=np.asarray(norms, np.float32), **extra))


def altered(param: str, factor: float) -> np.ndarray:
    out = NORMS.copy()
    out[PIDX[param]] *= np.float32(factor)
    return out


def test_grad_agreement_names_the_rank_and_parameter_whose_norm_differs_on_an_unprobed_step():
    job = Job(CHECKS, world=3)
    bad = altered("fc1.bias", 1.001)  # a gradient altered after all-reduce, 1e-3 relative
    for step in range(6):
        for r in range(3):
            sentinel(job, r, step, bad if (step, r) == (3, 1) else NORMS)
        if step == 3:  # found at the step itself, from the sentinels alone: no probe at step 3
            (f,) = job.active("grad_agreement")
            x, ref = float(bad[PIDX["fc1.bias"]]), float(NORMS[PIDX["fc1.bias"]])  # the float32 wire values
            assert (f.rank, f.step, f.layer) == (1, 3, None)
            assert f.details["params"] == ["fc1.bias"] and f.details["module"] == "fc1"
            assert f.details["evidence"] == ["grad_norms"] and f.details["ranks"] == [0, 1, 2]
            assert (f.details["grad_norm"], f.details["majority_grad_norm"]) == (x, ref)
            assert f.details["rel_diff"] == pytest.approx(abs(x - ref) / ref, rel=1e-12)  # float64 reference
            assert "rank 1" in f.summary and "fc1.bias" in f.summary
    # one finding, resolved by the next step judged without it; the drift check saw no probe
    assert job.events("grad_agreement") == [("raised", 3, 1, None), ("resolved", 3, 1, None)]
    assert job.events("replica_drift") == [] and job.status("grad_agreement") == "healthy"


@pytest.mark.parametrize("factor", [1.0, 1 + 4e-6], ids=["equal_bits", "within_tolerance"])
def test_grad_agreement_no_finding_when_norms_agree_to_the_bit_or_within_tolerance(factor):
    job = Job(CHECKS, world=3)
    close = altered("fc2.weight", factor)  # 4e-6: a reduction-order difference, not a fault
    assert factor == 1.0 or close[PIDX["fc2.weight"]] != NORMS[PIDX["fc2.weight"]]
    for step in range(5):
        for r in range(3):
            sentinel(job, r, step, close if r == 2 else NORMS)
    assert job.events("grad_agreement") == [] and job.status("grad_agreement") == "healthy"


def test_grad_agreement_never_compares_missing_or_non_finite_norms():
    job = Job(CHECKS, world=3)
    odd = NORMS.copy()
    odd[PIDX["emb.weight"]] = np.nan  # no gradient on this rank
    odd[PIDX["head.weight"]] = np.inf  # the nonfinite check's
    for r in range(3):
        sentinel(job, r, 0, odd if r == 0 else NORMS)
    job.send(wire.Report(job.header(0), job.digest[0], 1, 0.01, 1.0, 0))  # an agent without norms
    for r in (1, 2):
        sentinel(job, r, 1)
    assert job.events("grad_agreement") == []


def test_grad_agreement_two_ranks_split_without_a_majority():
    job = Job(CHECKS, world=2)
    for r in range(2):
        sentinel(job, r, 0, altered("head.weight", 1.01) if r else NORMS)
    (f,) = job.active("grad_agreement")
    assert (f.rank, f.step, f.details["params"]) == (None, 0, ["head.weight"])


def test_grad_agreement_one_finding_when_norms_and_fingerprints_see_the_same_fault():
    job = Job(CHECKS, world=3)
    fp = np.arange(1, len(PARAMS) + 1, dtype=np.uint64)
    odd = fp.copy()
    odd[PIDX["head.weight"]] += np.uint64(1)
    for step in (9, 10, 11):  # 10 is probed: the sentinels and the round both see rank 2
        for r in range(3):
            faulty = step == 10 and r == 2
            sentinel(job, r, step, altered("head.weight", 1.5) if faulty else NORMS,
                     fp=(odd if faulty else fp) if step == 10 else None)
        if step == 10:
            (f,) = job.active("grad_agreement")
            assert f.details["evidence"] == ["fingerprints", "grad_norms"] and f.step == 10
    assert job.events("grad_agreement") == [("raised", 10, 2, None), ("resolved", 10, 2, None)]


def test_grad_agreement_compares_replicas_of_a_shard_never_the_shards_of_a_group():
    # HSDP: 3 replicas x 2 shards; every parameter sharded along "shard": ranks 0, 2, 4 hold one
    # half, 1, 3, 5 the other, so the halves' norms differ by design
    world = 6
    job = Job(CHECKS, world=world)
    digests = {}
    mesh = wire.Mesh(("replicate", "shard"), (3, 2))
    for r in range(world):
        job.coord[r] = (r // 2, r % 2)
        s = wire.Schema(job.header(r), "node", r, 10, PARAMS, SLOTS, mesh=mesh, shard=tuple((1,) for _ in PARAMS))
        job.send(s)
        digests[r] = s.hash
    half = {0: NORMS, 1: NORMS * np.float32(0.5)}
    for step in range(3):
        for r in range(world):
            norms = half[r % 2]
            if (step, r) == (1, 3):
                norms = norms * np.float32(np.array([1, 1, 1, 1.01, 1], np.float32))  # fc2.weight, second half
            sentinel(job, r, step, norms, digest=digests[r])
    assert job.events("grad_agreement") == [("raised", 1, 3, None), ("resolved", 1, 3, None)]
    (ev,) = [e for e in job.runner.events if e.check == "grad_agreement" and e.event == "raised"]
    assert ev.details["params"] == ["fc2.weight"] and ev.details["ranks"] == list(range(world))


def test_a_mesh_ranks_steps_sent_before_its_schema_are_judged_where_it_is_on_the_mesh():
    """Records that come before their schema (an aggregator restarted mid-run, a schema shed under
    overload) wait in the step table under the key of the rank's place (its header's coordinates):
    once the schema comes they are judged as the rank's later steps are, never as unplaced."""
    world = 6
    job = Job(CHECKS, world=world)
    mesh = wire.Mesh(("replicate", "shard"), (3, 2))
    digest = wire.schema_hash(PARAMS, SLOTS, mesh, tuple((1,) for _ in PARAMS))
    half = {0: NORMS, 1: NORMS * np.float32(0.5)}
    step0 = {r: half[r % 2] * (np.float32([1, 1, 1, 1.01, 1]) if r == 3 else 1) for r in range(world)}  # rank 3 differs
    for r in range(world - 1):
        job.coord[r] = (r // 2, r % 2)
        sentinel(job, r, 0, step0[r], digest=digest)  # before any rank's mesh schema
    job.coord[world - 1] = (2, 1)
    for r in range(world):
        s = wire.Schema(job.header(r), "node", r, 10, PARAMS, SLOTS, mesh=mesh, shard=tuple((1,) for _ in PARAMS))
        assert s.hash == digest
        job.send(s)
    sentinel(job, world - 1, 0, step0[world - 1], digest=digest)  # the step is whole now: released
    for step in (1, 2):
        for r in range(world):
            sentinel(job, r, step, half[r % 2], digest=digest)
    assert job.runner.errors == {}
    assert job.events("grad_agreement") == [("raised", 0, 3, None), ("resolved", 0, 3, None)]


# --- knock-ons: a desync's drift is its own fault's ----------------------------------------------

FP = np.arange(1, len(PARAMS) + 1, dtype=np.uint64)
DRIFTED = FP.copy()
DRIFTED[PIDX["head.weight"]] += np.uint64(1)


def step_of(job: Job, step: int, desync: bool = False, drift=None, jump: float = 0.0) -> None:
    """Every rank reports ``step``: rank 1's gradient norm of head.weight altered after all-reduce
    (``desync``); with ``drift`` (True/False) a probed step, rank 1's weights differing or not, and
    its weight norm of head.weight moved by ``jump`` (the others' stay put)."""
    for r in range(job.world):
        norms = altered("head.weight", 1.5) if desync and r == 1 else NORMS
        extra = {}
        if drift is not None:
            arrays = probe(param={"head.weight": {1: 1.0 + jump}}) if r == 1 else probe()
            extra = dict(probe=True, fp_grad=FP, fp_weight=DRIFTED if drift and r == 1 else FP, **arrays)
        job.send(wire.Report(job.header(r), job.digest[r], step, 0.01, 1.0, 0, local_grad_norm=1.0,
                             grad_norms=np.asarray(norms, np.float32), **extra))


def test_a_desyncs_drift_is_folded_into_its_grad_agreement_finding_which_lasts_while_replicas_differ():
    """Rank 1's gradient is altered after all-reduce at the unprobed step 3: grad_agreement names
    it there and resolves at step 4 (the gradients agree again). The next probe (5) finds the
    weights it updated different: replica_drift's knock-on (replica_drift.knock_on_of), within
    knock_on_window_s, so it is not raised; the gradient finding is reopened with it as evidence and
    stays while the replicas differ."""
    job = Job(CHECKS, world=3)
    for step in range(5):
        step_of(job, step, desync=step == 3)
        job.tick()
    assert job.events("grad_agreement") == [("raised", 3, 1, None), ("resolved", 3, 1, None)]
    step_of(job, 5, drift=True)
    assert job.status("replica_drift") == "finding" and job.active("replica_drift") == []
    assert job.events("replica_drift") == [] and job.runner.folded[(UNIT, "replica_drift")] == 1
    (f,) = job.active("grad_agreement")
    assert (f.rank, f.step) == (1, 3) and [(k["check"], k["rank"], k["step"]) for k in f.details["knock_on"]] == [
        ("replica_drift", 1, 5)]
    assert job.events("grad_agreement")[-1] == ("updated", 3, 1, None)
    for step in (6, 7):  # unprobed, then probed: the replicas still differ
        step_of(job, step, drift=True if step == 7 else None)
        job.tick()
    assert [f.rank for f in job.active("grad_agreement")] == [1] and job.events("replica_drift") == []
    step_of(job, 8, drift=False)  # the replicas agree again (a restart from a checkpoint)
    assert job.active("grad_agreement") == [] and job.events("replica_drift") == []
    assert job.events("grad_agreement") == [("raised", 3, 1, None), ("resolved", 3, 1, None), ("updated", 3, 1, None),
                                            ("resolved", 3, 1, None)]


def test_a_desync_at_a_probed_step_holds_its_finding_while_the_drift_it_caused_lasts():
    """The fault at the probed step 10: gradient norms, gradient and weight fingerprints all see it.
    The gradients agree at step 11, but the finding stays (no resolved event) while replica_drift
    still reports the drift folded into it; it resolves with the drift."""
    job = Job(CHECKS, world=3)
    for step in range(10):
        step_of(job, step)
    step_of(job, 10, desync=True, drift=True)
    step_of(job, 11)
    job.tick()
    assert [f.rank for f in job.active("grad_agreement")] == [1] and job.active("replica_drift") == []
    assert job.events("grad_agreement") == [("raised", 10, 1, None), ("updated", 10, 1, None)]
    step_of(job, 12, drift=True)
    assert [f.rank for f in job.active("grad_agreement")] == [1]
    step_of(job, 13, drift=False)
    assert job.events("grad_agreement")[-1] == ("resolved", 10, 1, None) and job.events("replica_drift") == []


@pytest.mark.parametrize("named", [False, True], ids=["tie", "tie-broken"])
def test_a_job_level_gradient_finding_folds_only_a_job_level_drift(named):
    """World 2: two replicas disagree and neither can be named (no majority), so grad_agreement's
    finding is job-level. It says no rank's fault: the drift that follows is folded into it when
    it names no rank either (one fault, one finding), and raised when the drift's tie-break names
    the rank whose weight norm jumped (a tensor-parallel bit flip's drift names the flipped holder
    while grad_agreement only sees the tie: the named finding must stay raised)."""
    job = Job(CHECKS, world=2)
    for step in range(5):  # probes at 0 and 2: the agreeing history the tie-break needs
        step_of(job, step, desync=step == 3, drift=False if step in (0, 2) else None)
        job.tick()
    assert job.events("grad_agreement") == [("raised", 3, None, None), ("resolved", 3, None, None)]
    step_of(job, 5, drift=True, jump=5.0 if named else 0.0)
    if named:
        assert job.events("replica_drift") == [("raised", 5, 1, None)] and job.runner.folded[(UNIT, "replica_drift")] == 0
    else:
        assert job.events("replica_drift") == [] and job.runner.folded[(UNIT, "replica_drift")] == 1
        (f,) = job.active("grad_agreement")
        assert f.rank is None and [(k["check"], k["rank"]) for k in f.details["knock_on"]] == [("replica_drift", None)]


def test_a_job_level_drift_while_the_job_level_gradient_finding_is_active_is_folded():
    """World 2, the tie still reported (the desync lasts from step 3 to 5) when the probe at 5 sees
    the replicas differ with no rank to name: folded into the active finding, not raised."""
    job = Job(CHECKS, world=2)
    for step in range(5):
        step_of(job, step, desync=step >= 3, drift=False if step in (0, 2) else None)
        job.tick()
    assert job.events("grad_agreement") == [("raised", 3, None, None)]
    step_of(job, 5, desync=True, drift=True)
    assert job.events("replica_drift") == [] and job.runner.folded[(UNIT, "replica_drift")] == 1
    (f,) = job.active("grad_agreement")
    assert [(k["check"], k["rank"], k["step"]) for k in f.details["knock_on"]] == [("replica_drift", None, 5)]


def test_drift_long_after_a_desync_or_without_one_is_raised():
    """Outside knock_on_window_s (60 s by default, the runner's clock), or with no gradient
    finding at all (a bit flip in one replica's weights), drift is a fault of its own."""
    job = Job(CHECKS, world=3)
    for step in range(5):
        step_of(job, step, desync=step == 3)
        job.tick()
    job.tick(61)
    step_of(job, 5, drift=True)
    assert job.events("replica_drift") == [("raised", 5, 1, None)] and not job.runner.folded
    job = Job(CHECKS, world=3)
    step_of(job, 0)
    step_of(job, 1, drift=True)
    assert job.events("replica_drift") == [("raised", 1, 1, None)] and job.events("grad_agreement") == []
    assert job.runner.view().folded == ()


def _raised(agg, job):
    return sorted(
        (e["check"], e["rank"], e["step"]) for e in agg.findings(job) if e["event"] == "raised" and e["check"] in CONSISTENCY
    )


@pytest.fixture(scope="module")
def agg(tmp_path_factory):
    a = start_aggregator(tmp_path_factory.mktemp("agg"), "--round-grace-s", "5", "--publish-interval-s", "0.05")
    yield a
    a.stop()


def _settled(agg, job, probes):
    """Wait until every probed step of the job was reconciled and published."""
    from .conftest import samples

    wait_for(lambda: samples(agg.scrape(), "gradwatch_job_probe_step").get((("job_id", job),)) == probes[-1],
             20, what=f"probe step {probes[-1]} of {job}")


@pytest.mark.ddp
def test_desync_after_all_reduce_is_named_with_rank_step_and_parameter(agg):
    run_demo(agg.endpoint, ranks=3, steps=25, every=10, inject=["desync@20:rank=2"], job="desync")
    _settled(agg, "desync", [0, 10, 20])
    # the perturbed gradient is seen at step 20, and the replica it updates drifts from then on:
    # the drift is the desync's knock-on, folded into its finding (one fault, one finding)
    assert _raised(agg, "desync") == [("grad_agreement", 2, 20)]
    grad = next(e for e in agg.findings("desync") if e["check"] == "grad_agreement")
    assert grad["details"]["params"] == ["head.weight"] and grad["severity"] == "critical"
    assert [(k["check"], k["rank"], k["step"]) for k in grad["details"]["knock_on"]] == [("replica_drift", 2, 20)]


@pytest.mark.ddp
def test_desync_on_an_unprobed_step_is_named_at_that_step_from_the_sentinel_norms(agg):
    run_demo(agg.endpoint, ranks=3, steps=35, every=10, inject=["desync@23:rank=2"], job="desync_unprobed")
    _settled(agg, "desync_unprobed", [0, 10, 20, 30])
    # step 23 is not probed: the per-step gradient norms name rank 2 there; its weights, updated
    # with the perturbed gradient, differ from then on and the next probe (30) finds the drift: the
    # desync's knock-on, folded into its finding
    assert _raised(agg, "desync_unprobed") == [("grad_agreement", 2, 23)]
    grad = next(e for e in agg.findings("desync_unprobed") if e["check"] == "grad_agreement")
    assert grad["details"]["params"] == ["head.weight"] and grad["details"]["module"] == "head"
    assert grad["details"]["evidence"] == ["grad_norms"] and grad["details"]["rel_diff"] > 1e-5
    # resolved at the next step (the gradients after all-reduce agree again), reopened by the drift
    events = [(e["event"], e["step"]) for e in reversed(agg.findings("desync_unprobed")) if e["check"] == "grad_agreement"]
    assert events[:3] == [("raised", 23), ("resolved", 23), ("updated", 23)]
    assert [(k["check"], k["rank"], k["step"]) for k in grad["details"]["knock_on"]] == [("replica_drift", 2, 30)]


@pytest.mark.ddp
def test_bit_flip_in_one_replica_is_named_as_drift_only(agg):
    run_demo(agg.endpoint, ranks=3, steps=25, every=10, inject=["drift@9:rank=1"], job="drift")
    _settled(agg, "drift", [0, 10, 20])
    assert _raised(agg, "drift") == [("replica_drift", 1, 10)]
    active = {(f["check"], f["rank"]) for f in agg.findings("drift", active=True)}
    assert ("replica_drift", 1) in active  # the replica stays different: the finding stays raised


@pytest.mark.ddp
def test_clean_run_raises_no_consistency_finding(agg):
    run_demo(agg.endpoint, ranks=3, steps=25, every=10, job="clean")
    _settled(agg, "clean", [0, 10, 20])
    assert _raised(agg, "clean") == []
    status = {(dict(k)["check"], dict(k)["status"]): v for k, v in _status(agg, "clean").items()}
    assert status[("grad_agreement", "healthy")] == 1 and status[("replica_drift", "healthy")] == 1


def _status(agg, job):
    from .conftest import samples

    return {k: v for k, v in samples(agg.scrape(), "gradwatch_check_status").items() if ("job_id", job) in k}


def _drift_round(step: int, fp, weight):
    """Two ranks, two parameters: weight fingerprints and each rank's own weight norms."""
    r = _round(fp, step=step)
    r.own_param = np.stack([np.full((2, 2), np.nan), np.asarray(weight, np.float64), np.zeros((2, 2))], axis=-1)
    return r


def test_replica_drift_breaks_a_tie_of_two_holders_by_their_weight_norm_history():
    # both ranks agree at steps 0 and 10 (norms 2.0 -> 1.9: the optimizer moves p0's norm by 0.1
    # per probe interval); at 20 they disagree on p0: rank 1's norm jumped 0.5, rank 0's moved 0.1
    check = ReplicaDrift(Thresholds())
    check.on_round(JOB, _drift_round(0, [[1, 5], [1, 5]], [[2.0, 3.0], [2.0, 3.0]]))
    check.on_round(JOB, _drift_round(10, [[2, 5], [2, 5]], [[1.9, 3.0], [1.9, 3.0]]))
    (f,) = check.on_round(JOB, _drift_round(20, [[3, 5], [4, 5]], [[1.8, 3.0], [1.4, 3.0]])).findings
    assert (f.rank, f.details["params"], f.details["candidates"]) == (1, ["p0"], [0, 1])
    ev = f.details["norms"]["p0"]
    assert ev["moved"] == {"0": pytest.approx(0.1), "1": pytest.approx(0.5)} and ev["steps"] == [0, 10]
    # the verdict stands while the pair disagrees, whatever the norms do next (one fault, one finding)
    (g,) = check.on_round(JOB, _drift_round(30, [[5, 5], [6, 5]], [[1.7, 3.0], [1.65, 3.0]])).findings
    assert g.rank == 1
    # agreeing again clears it; a new tie whose norms move alike (a sign flip) names no rank
    check.on_round(JOB, _drift_round(40, [[7, 5], [7, 5]], [[1.6, 3.0], [1.6, 3.0]]))
    check.on_round(JOB, _drift_round(50, [[8, 5], [8, 5]], [[1.5, 3.0], [1.5, 3.0]]))
    (h,) = check.on_round(JOB, _drift_round(60, [[9, 5], [10, 5]], [[1.4, 3.0], [1.41, 3.0]])).findings
    assert (h.rank, h.details["candidates"]) == (None, [0, 1])
    # a jump only 1.5x the optimizer's move is not decisive at drift_tie_ratio 2; 2.5x is
    for jump, named in ((0.15, None), (0.25, 1)):
        c = ReplicaDrift(Thresholds())
        c.on_round(JOB, _drift_round(0, [[1, 5], [1, 5]], [[2.0, 3.0], [2.0, 3.0]]))
        c.on_round(JOB, _drift_round(10, [[2, 5], [2, 5]], [[1.9, 3.0], [1.9, 3.0]]))
        (f,) = c.on_round(JOB, _drift_round(20, [[3, 5], [4, 5]], [[1.8, 3.0], [1.9 - jump, 3.0]])).findings
        assert f.rank == named, (jump, f.details)


def test_replica_drift_without_history_lists_both_candidates():
    check = ReplicaDrift(Thresholds())
    (f,) = check.on_round(JOB, _drift_round(0, [[3, 5], [4, 5]], [[1.8, 3.0], [0.5, 3.0]])).findings
    assert (f.rank, f.details["candidates"]) == (None, [0, 1])
    assert "2 needed" in f.details["norms"]["0,1"]["history"]


def _tp_rank(rank: int, endpoint: str, master_port: int) -> None:
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port))
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import gradwatch.agent as gw

    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))
        parallelize_module(model, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)),
                           {"0": ColwiseParallel(), "2": RowwiseParallel()})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(7)  # tensor-parallel ranks share the batch
        with gw.attach(model, opt, endpoint=endpoint, job="tpburst", every=10):
            for step in range(45):
                x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
                loss = F.mse_loss(model(x), y)
                if step == 25 and rank == 1:
                    loss = loss * 1e6  # rank 1's replicated head now differs for good
                loss.backward()
                opt.step()
                opt.zero_grad()
    finally:
        dist.destroy_process_group()


@pytest.mark.ddp
def test_a_one_rank_burst_does_not_raise_a_persistent_drift_twice(tmp_path):
    """A 2-rank tensor-parallel job; rank 1's loss x 1e6 at step 25 leaves its replicated head's
    weights different for good. Only rank 1's sentinel sees its spike, so only it bursts (probes
    26-29: rounds of one rank). replica_drift names rank 1 once for the whole run: a burst round
    keeps the finding, so the next full round does not raise it again."""
    import torch.multiprocessing as mp

    from .conftest import free_port, samples

    agg = start_aggregator(tmp_path, "--publish-interval-s", "0.05", "--round-grace-s", "1")
    try:
        mp.start_processes(_tp_rank, args=(agg.endpoint, free_port()), nprocs=2, start_method="spawn")
        wait_for(lambda: samples(agg.scrape(), "gradwatch_job_probe_step").get((("job_id", "tpburst"),)) == 40,
                 30, what="the last probe")
        text = agg.scrape()
        # the burst's rounds of one rank: partial (rank 0's interval, 10, skips 26-29), not incomplete
        rounds = samples(text, "gradwatch_rounds_total")
        assert rounds[(("job_id", "tpburst"), ("outcome", "partial"))] >= 1
        drift = [(e["event"], e["rank"]) for e in agg.findings("tpburst") if e["check"] == "replica_drift"]
        assert drift == [("raised", 1)]
    finally:
        agg.stop()
