"""A job-wide event is one finding: when at least half of a job's ranks (and at least 2) fall silent
or stall together, one job-level finding says so (their count and the first 16 ranks), not one
finding per rank; and a crashed job of 16,384 ranks leaves a scrape within the series cap.

The small cases drive the checks in this process (tests/fakejob.py's LocalJob, on a fake clock).
The large one feeds a real aggregator's state in this process (no sockets: 16,384 ranks' messages
through a subprocess's socket would take minutes on two cores), then renders /metrics as a scrape
does.
"""

from __future__ import annotations

import re
import time

import numpy as np
import pytest

from gradwatch import wire
from gradwatch.aggregator import Aggregator, load
from gradwatch.aggregator.seriescap import layer_samples

from .fakejob import LocalJob, Model, train


def job_level(j: LocalJob, check: str) -> list:
    return [f for f in j.runner.active.get((j.job, check), {}).values()]


def test_half_of_the_ranks_silent_together_is_one_job_level_finding_a_rank_back_resolves_its_part():
    j = LocalJob(["rank_silent"], {"silent_after_s": 5}, world=8)
    j.schema()
    train(j, j.agg, range(5), dt=1)
    for _ in range(8):  # ranks 0-4 stop at once (a node of five ranks lost); 5-7 heartbeat on
        for r in (5, 6, 7):
            j.heartbeat(r, 4)
        j.tick(1)
    (f,) = job_level(j, "rank_silent")
    assert f.rank is None and f.details["count"] == 5 and f.details["ranks"] == [0, 1, 2, 3, 4]
    assert [(e.event, e.rank) for e in j.agg.events("rank_silent")] == [("raised", None)]  # no rank named on its own
    # rank 0 comes back: four of eight remain, still half: the same finding, its count 4
    for _ in range(2):
        for r in (0, 5, 6, 7):
            j.heartbeat(r, 4)
        j.tick(1)
    (f,) = job_level(j, "rank_silent")
    assert f.rank is None and f.details["count"] == 4 and f.details["ranks"] == [1, 2, 3, 4]
    # rank 1 too: fewer than half remain; the job-level finding resolves and the rest are named each
    for _ in range(2):
        for r in (0, 1, 5, 6, 7):
            j.heartbeat(r, 4)
        j.tick(1)
    assert sorted(f.rank for f in job_level(j, "rank_silent")) == [2, 3, 4]
    events = [(e.event, e.rank) for e in j.agg.events("rank_silent")]
    assert events[0] == ("raised", None) and set(events[1:]) == {("resolved", None), ("raised", 2), ("raised", 3), ("raised", 4)}


def test_ranks_silent_apart_in_time_or_too_few_are_each_named():
    j = LocalJob(["rank_silent"], {"silent_after_s": 5, "job_wide_window_s": 10}, world=4)
    j.schema()
    for r in range(4):
        j.heartbeat(r, 0)
    for _ in range(20):  # rank 3 stops now, rank 2 twelve seconds later: two faults, each named
        for r in ((0, 1, 2) if j.now < 112 else (0, 1)):
            j.heartbeat(r, 0)
        j.tick(1)
    assert sorted(f.rank for f in job_level(j, "rank_silent")) == [2, 3]
    k = LocalJob(["rank_silent"], {"silent_after_s": 5}, world=2)  # one rank of two: half, but fewer than 2
    for r in range(2):
        k.heartbeat(r, 0)
    for _ in range(8):
        k.heartbeat(0, 0)
        k.tick(1)
    assert [f.rank for f in job_level(k, "rank_silent")] == [1]


def test_a_stall_naming_half_the_ranks_is_one_job_level_finding():
    j = LocalJob(["training_stalled"], {"stall_after_s": 2.5}, world=6)
    j.schema()
    train(j, j.agg, range(5), dt=0.5)
    for _ in range(10):  # ranks 0-3 hang outside all-reduce while 4 and 5 wait there
        for r in range(6):
            j.heartbeat(r, 4, in_step_s=j.now - 102.5, waiting=r >= 4, run_s=0.0)
        j.tick(1)
    (f,) = job_level(j, "training_stalled")
    assert f.rank is None and f.details["reason"] == "job_wide" and f.details["count"] == 4
    assert f.details["ranks"] == [0, 1, 2, 3] and f.details["waiting"] == [4, 5]


WORLD, LAYERS = 16_384, 100
MODEL = Model(params=tuple((f"blocks.{i}.weight", (64, 64), "float32") for i in range(LAYERS)),
              slots=tuple((f"blocks.{i}", "", "Linear", "float32") for i in range(LAYERS)))


@pytest.mark.slow  # ~3 s on two cores: 180,000 messages in this process
def test_a_crashed_job_of_16384_ranks_is_one_finding_and_a_scrape_within_the_cap(capsys):
    """A synthetic job of 16,384 ranks and 100 layers steps once a second (a probed step first),
    then stops without goodbyes, as a crash or a partition does: one finding names it (count
    16,384, the first 16 ranks), no finding per rank (whose ranks' series, 27 families each, would
    put the scrape far past the shipped sample_limit), and /metrics stays within
    --max-series-total."""
    now = [1000.0]
    agg = Aggregator(load(listen="tcp://127.0.0.1:0", metrics_port=0), clock=lambda: now[0])
    st = agg.state
    digest = MODEL.digest
    boots = [f"{r:016x}" for r in range(WORLD)]
    seq = [0] * WORLD
    arrays = MODEL.tile()

    def header(r):
        seq[r] += 1
        return wire.Header("big", r, WORLD, boots[r], seq[r], now[0])

    t0 = time.perf_counter()
    for r in range(WORLD):
        st.apply(wire.Schema(header(r), f"node{r // 8}", r % 8, 100, MODEL.params, MODEL.slots))
    for step in range(5):
        for r in range(WORLD):
            st.apply(wire.Report(header(r), digest, step, 1.0, 1.0, 0, **(arrays if step == 0 else {})))
            st.apply(wire.Heartbeat(header(r), step, seq[r], 0, 0))
        st.finish_closing()
        now[0] += 1.0
        st.tick()
    fed = time.perf_counter() - t0
    assert st.jobs["big"].proven and st.jobs["big"].last_round is not None
    for _ in range(12):  # every rank stops at once, no goodbye
        now[0] += 1.0
        st.tick()
    raised = [e for e in agg.runner.events if e.event == "raised"]
    assert [(e.check, e.rank) for e in raised] == [("rank_silent", None)], [(e.check, e.rank, e.summary) for e in raised]
    assert raised[0].details["count"] == WORLD and raised[0].details["ranks"] == list(range(16))
    agg.publish()
    t1 = time.perf_counter()
    from prometheus_client import generate_latest

    text = generate_latest(agg.registry).decode()
    scrape_s = time.perf_counter() - t1
    samples = [line for line in text.splitlines() if line and not line.startswith("#")]
    with capsys.disabled():
        print(f"\n16,384 ranks x 100 layers: fed in {fed:.1f} s; after the crash /metrics: {len(samples):,} samples, "
              f"{len(text) / 1e6:.2f} MB, rendered in {scrape_s:.2f} s")
    assert len(samples) <= agg.cfg.max_series_total
    assert 'gradwatch_check_rank_flagged{' not in text
    assert 'gradwatch_check_findings_active{check="rank_silent",job_id="big"} 1.0' in text
    assert re.search(r'gradwatch_job_rank_last_seen_timestamp_seconds\{agg="min",job_id="big"\}', text)
    # the job's per-layer series whole: every statistic the round observed, min/median/max
    assert sum(1 for s in samples if s.startswith("gradwatch_layer_")) == layer_samples(agg.state.jobs["big"].last_round) > 3000
    assert np.isfinite(scrape_s) and scrape_s < 10
