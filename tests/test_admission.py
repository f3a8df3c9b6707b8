"""Admission prefers proven jobs: a job is exported and judged only once its ranks showed steps,
proven jobs outrank the others for slots, each sender's jobs in making are bounded, a job refused a
slot is counted and never judged, and a lookalike of a live job is a job of its own, quiet.

Each test drives a real aggregator state and checks runner in this process (tests/fakejob.py's
InProcess, on a fake clock) with the admission settings at their defaults unless it says
otherwise (InProcess itself proves every job as it comes: ``proof_steps`` 0).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from gradwatch import wire
from gradwatch.aggregator.checks import CHECKS
from gradwatch.aggregator.jobs import HELD_EVENTS
from gradwatch.aggregator.limits import Limits
from gradwatch.aggregator.snapshot import snapshot

from .fakejob import FakeJob, InProcess, train

DEFAULTS = Limits()
ALL = tuple(CHECKS)


def aggregator(**state) -> InProcess:
    """Every check, the admission limits at their defaults (``state``: others)."""
    return InProcess(ALL, {"silent_after_s": 5}, proof_steps=DEFAULTS.proof_steps, **state)


class Sender:
    """Fake jobs whose every message comes from ``source`` (an address, as the intake names it)."""

    def __init__(self, agg: InProcess, source: str):
        self.agg, self.source = agg, source

    def send(self, msg) -> None:
        st = self.agg.state
        st.apply(wire.decode(wire.encode(msg), schema_sizes=st.schema_sizes), source=self.source)

    def job(self, name: str, world: int = 3, **kw) -> FakeJob:
        return FakeJob(self.send, name, world, clock=self.agg.clock, **kw)


def exported(agg: InProcess) -> set:
    return {j.job for j in snapshot(agg.state, 0.0).jobs}


def test_a_job_is_proven_by_half_its_ranks_advancing_in_three_messages_each_not_by_one_frame():
    agg = aggregator()
    src = Sender(agg, "10.0.0.1")
    job = src.job("real", world=4)
    job.schema()
    # one coalesced batch of 50 steps from every rank: one message each, not a proof
    for r in range(4):
        job.steps(r, [job.record(r, s) for s in range(50)])
    st = agg.state.jobs["real"]
    assert st.admitted and not st.proven and exported(agg) == set()
    train(job, agg, range(50, 60), ranks=[0])  # rank 0: eleven messages, one rank of the two needed
    train(job, agg, [50], ranks=[1])  # rank 1: its second message
    train(job, agg, [50], ranks=[1])  # a step it reported before advances nothing
    assert not st.proven and st.proof_ranks == 1 and exported(agg) == set()
    train(job, agg, [51], ranks=[1])  # its third: half of the world's ranks
    assert st.proven and exported(agg) == {"real"}
    # heartbeats do not advance a step: a job of heartbeats alone is never proven
    hb = src.job("beats", world=1)
    hb.schema()
    for _ in range(10):
        hb.heartbeat(0, 3)
        agg.tick(0.5)
    assert not agg.state.jobs["beats"].proven


def test_an_unproven_job_exports_nothing_and_raises_nothing_and_is_judged_once_proven():
    """The checks judge a job's first steps once it is proven: a NaN at step 1 is found, a few
    steps late; meanwhile the job has no series, no status, no finding."""
    agg = aggregator()
    job = Sender(agg, "10.0.0.1").job("nan", world=2)
    job.schema()
    for s in range(2):  # step 1 is non-finite on rank 1; one message of each rank per step
        for r in range(2):
            job.report(r, s, grad_norm=float("nan") if (s, r) == (1, 1) else 1.0, nonfinite=3 if (s, r) == (1, 1) else 0)
            job.heartbeat(r, s)
        agg.tick(0.5)
    for r in range(2):  # both ranks silent for 20 s: would be rank_silent, were the job judged
        agg.tick(1.0)
    agg.tick(20)
    assert exported(agg) == set() and list(agg.runner.events) == []
    assert not any(job_id == "nan" for job_id, _ in agg.runner.status)
    train(job, agg, range(2, 4))  # the third message of each rank: proven
    assert agg.state.jobs["nan"].proven
    for _ in range(20):  # nonfinite waits for a probed step to locate the NaN, then says so unlocated
        for r in range(2):
            job.heartbeat(r, 3)
        agg.tick(1.0)
    raised = [(e.check, e.step) for e in agg.events() if e.event == "raised"]
    assert ("nonfinite", 1) in raised, raised
    assert not [e for e in agg.events() if e.check == "rank_silent"]  # its silence before proof is not judged


def test_events_held_for_an_unproven_job_are_bounded():
    agg = aggregator()
    job = Sender(agg, "10.0.0.1").job("slow", world=3)
    job.schema()
    train(job, agg, range(3 * HELD_EVENTS), ranks=[0])  # one rank of three: never proven
    st = agg.state.jobs["slow"]
    assert not st.proven
    assert len(st.held) == HELD_EVENTS and st.held_dropped > 0


def test_a_real_job_evicts_unproven_ones_holding_every_slot_and_proven_jobs_are_never_evicted(caplog):
    agg = aggregator(max_jobs=4)
    fakes = []
    for i in range(4):  # invented jobs from four senders, each a schema and a report: every slot
        fake = Sender(agg, f"10.9.0.{i}").job(f"fake{i}", world=1)
        fake.schema()
        fake.report(0, 0)
        fakes.append(fake)
        agg.tick(0.1)
    assert agg.state.registry.holding() == 4 and not any(j.proven for j in agg.state.jobs.values())
    real = Sender(agg, "10.0.0.1").job("real", world=3)
    real.schema()
    train(real, agg, range(4))
    assert agg.state.jobs["real"].proven and "fake0" not in agg.state.jobs  # the least recently heard went
    assert agg.state.registry.unproven_evicted == 1
    # three more real jobs: every slot proven
    for i in range(3):
        other = Sender(agg, f"10.0.1.{i}").job(f"real{i}", world=1)
        other.schema()
        train(other, agg, range(3))
    assert sorted(j.job for j in agg.state.jobs.values() if j.proven) == ["real", "real0", "real1", "real2"]
    # a fifth real job is not admitted: counted once, logged once, shown, never judged
    late = Sender(agg, "10.0.2.1").job("late", world=2)
    late.schema()
    with caplog.at_level(logging.WARNING, logger="gradwatch.aggregator"):
        train(late, agg, range(6))
        agg.tick(30)  # its ranks silent for 30 s: no rank_silent, it is not judged
    said = [r.getMessage() for r in caplog.records if "not admitted" in r.getMessage()]
    assert len(said) == 1 and "--max-jobs" in said[0] and "'late'" in said[0]
    assert agg.state.rejected["too_many_jobs"] == 12 and agg.state.admission.refused_total == 1
    snap = snapshot(agg.state, 0.0)
    assert snap.not_admitted == (("late", "too_many_jobs"),) and snap.jobs_refused == 1
    assert "late" not in {j.job for j in snap.jobs}
    assert not [e for e in agg.events() if e.job == "late"]
    assert dict(snap.stages) == {"proven": 4, "unproven": 0, "pending": 1}
    agg.state.registry.drop(agg.state.jobs["late"])  # gone (its ranks forgotten): no longer shown, still counted
    snap = snapshot(agg.state, 0.0)
    assert snap.not_admitted == () and snap.jobs_refused == 1


def test_each_sender_holds_a_bounded_share_and_churns_its_own_jobs_only():
    agg = aggregator()
    real = Sender(agg, "10.0.0.1").job("real", world=2)
    real.schema()
    real.report(0, 0)  # unproven, holding a slot
    flood = Sender(agg, "10.6.6.6")
    for i in range(100):  # invented jobs, each a schema and a report: slots, then pending ones
        fake = flood.job(f"fake{i}", world=1)
        fake.schema()
        fake.report(0, 0)
        agg.tick(0.01)
        mine = [j for j in agg.state.jobs.values() if j.source == "10.6.6.6"]
        assert sum(j.admitted for j in mine) <= DEFAULTS.max_unproven_per_source
        assert sum(not j.admitted for j in mine) <= DEFAULTS.max_pending_per_source
    assert "real" in agg.state.jobs  # another sender's job is never evicted by the flood's own churn
    train(real, agg, range(1, 4))
    assert agg.state.jobs["real"].proven and exported(agg) == {"real"}


def test_one_sender_proving_invented_jobs_holds_its_share_of_slots_and_a_real_job_gets_in(caplog):
    """One address proves world-1 jobs, four frames each (a schema and three advancing steps), as
    fast as it likes: it holds max_jobs_per_source slots at most, and past them its further jobs
    are refused, never another sender's; a real job from another address is admitted and proven."""
    agg = aggregator()
    flood = Sender(agg, "10.6.6.6")
    with caplog.at_level(logging.WARNING, logger="gradwatch.aggregator"):
        for i in range(DEFAULTS.max_jobs):
            fake = flood.job(f"squat{i}", world=1)
            fake.schema()
            for step in (1, 2, 3):
                fake.report(0, step)
            agg.tick(0.01)
    mine = [j for j in agg.state.jobs.values() if j.source == "10.6.6.6" and j.admitted]
    assert len(mine) == DEFAULTS.max_jobs_per_source and all(j.proven for j in mine)
    said = [r.getMessage() for r in caplog.records if "not admitted" in r.getMessage()]
    from gradwatch.aggregator.admission import LOG_BURST

    assert 1 <= len(said) <= LOG_BURST and all("--max-jobs-per-source" in line for line in said)
    assert agg.state.admission.refused_total == DEFAULTS.max_jobs - DEFAULTS.max_jobs_per_source
    real = Sender(agg, "10.0.0.1").job("real", world=3)
    real.schema()
    train(real, agg, range(4))
    assert agg.state.jobs["real"].proven and "real" in exported(agg)


def test_a_lookalike_frame_makes_a_quiet_job_of_its_own_and_is_evicted_first():
    agg = aggregator(max_jobs=2)
    victim = Sender(agg, "10.0.0.1").job("victim", world=2, key="k-real")
    victim.schema()
    train(victim, agg, range(5))
    assert agg.state.jobs["victim"].proven
    forger = Sender(agg, "10.6.6.6").job("victim", world=1, key="k-other")
    forger.schema()
    forger.report(0, 0, grad_norm=1e30)  # an exploding norm under the victim's id
    lookalike = [j for j in agg.state.jobs.values() if j.name == "victim" and j.key == "k-other"]
    assert len(lookalike) == 1 and lookalike[0].admitted and not lookalike[0].proven
    assert exported(agg) == {"victim"}
    agg.tick(30)
    assert not [e for e in agg.events() if e.job != "victim"]
    # a second real job needs the slot the lookalike holds: the lookalike goes, the victim stays
    other = Sender(agg, "10.0.0.2").job("other", world=1)
    other.schema()
    train(other, agg, range(3))
    assert exported(agg) == {"victim", "other"} and not any(j.key == "k-other" for j in agg.state.jobs.values())


def test_proof_steps_zero_takes_every_job_as_it_comes():
    agg = InProcess(ALL, proof_steps=0)
    job = FakeJob(agg.send, "any", 1, clock=agg.clock)
    job.heartbeat(0)
    assert agg.state.jobs["any"].proven and exported(agg) == {"any"}


@pytest.mark.parametrize("share, ranks_needed", [(0.5, 3), (1.0, 5), (0.01, 1)])
def test_the_share_of_ranks_a_proof_needs(share, ranks_needed):
    agg = aggregator(proof_rank_share=share)
    job = Sender(agg, "10.0.0.1").job("j", world=5)
    job.schema()
    train(job, agg, range(3), ranks=range(ranks_needed - 1))
    assert not agg.state.jobs["j"].proven
    train(job, agg, range(3), ranks=[ranks_needed - 1])
    assert agg.state.jobs["j"].proven
    assert np.isclose(agg.state.limits.proof_rank_share, share)
