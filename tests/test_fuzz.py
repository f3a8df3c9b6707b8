"""100,000 malformed, mutated and forged frames through the aggregator's receive path
(``Aggregator.handle``: decode and apply) beside a legitimate job: no exception escapes or is
swallowed as ``internal``, state and memory stay bounded, and the legitimate job's every exported
series equals that of the same job without the fuzz. ``bench/fuzz.py`` runs a million."""

from __future__ import annotations

import logging

import pytest

from bench.fuzz import FAMILIES, frames, run


def test_every_frame_family_is_drawn_and_deterministic():
    a = list(frames(600, seed=1))
    assert {f for f, _ in a} == set(FAMILIES)
    assert a[:50] == list(frames(50, seed=1)) and a[:50] != list(frames(50, seed=2))


@pytest.mark.slow  # 100,000 frames: seconds, not the fast tier
def test_a_hundred_thousand_fuzz_frames_leave_the_aggregator_and_a_real_job_whole():
    logging.getLogger("gradwatch").setLevel(logging.ERROR)  # findings on forged jobs, by the thousand
    r = run(100_000, seed=0, steps=200)
    assert r["frames"] == 100_000
    assert r["internal"] == 0, r["rejected"]
    assert r["jobs"] <= r["max_jobs"]
    assert r["rss_peak"] - r["rss_before"] < 200 * 2**20, r
    assert r["legit"] == r["legit_base"]
    assert r["legit_base"]['gradwatch_rank_steps_total{job_id="none",rank="2"}'] == "200.0"
    assert sum(r["rejected"].values()) > 50_000  # most fuzz is rejected, by reason


#: the aggregator's resident memory under fuzzed frames at its defaults, at most (bench/README.md:
#: its RSS curve, ~150-270 MiB over six rounds of 500,000 frames)
RSS_BOUND = 300 * 2**20


@pytest.mark.ddp  # 100,000 frames over TCP to an aggregator process of its own
def test_a_hundred_thousand_fuzz_frames_over_tcp_hold_the_aggregators_memory_within_its_bound(tmp_path):
    from bench.fuzz import run_daemon

    r = run_daemon(100_000, rounds=1, seed=0, log=str(tmp_path / "aggregator.log"))
    assert r["frames"] == 100_000 and r["internal"] == 0, r["rejected"]
    assert r["rss_peak"] < RSS_BOUND, [x // 2**20 for x in r["rss"]]
    assert all(v == r["steps"] for v in r["legit_steps"].values()), r["legit_steps"]  # every step of the real job
    assert r["samples"] < 1000  # the invented jobs export nothing
