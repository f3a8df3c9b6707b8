"""No judgement across the aggregator's own pause: the aggregator process stopped (SIGSTOP) for 20 s
beside a real two-rank gloo DDP job (bench/faultjob.py), then continued, raises no finding: time
it did not run is no rank's silence and no stall (judged by the clock alone, every rank would be
silent for a moment, until the frames of those 20 s are handled)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from .conftest import FaultJob, samples, start_aggregator, wait_for

JOB = "paused"


@pytest.mark.ddp
def test_the_aggregator_stopped_for_20_s_beside_a_real_job_raises_no_finding(tmp_path):
    agg = start_aggregator(tmp_path, "--publish-interval-s", "0.1")
    job = FaultJob(tmp_path, agg.endpoint, JOB)
    try:
        steps = job.steps
        wait_for(lambda: steps() >= 20, 180, what="the job training")
        wait_for(lambda: f'gradwatch_job_world_size{{job_id="{JOB}"}} 2.0' in agg.scrape(), 30, what="the job exported")
        time.sleep(2)
        before = steps()
        os.kill(agg.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(20)
        finally:
            os.kill(agg.proc.pid, signal.SIGCONT)
        assert steps() > before + 20  # training went on meanwhile
        time.sleep(8)  # the ranks' frames of those 20 s come in; the checks tick on
    finally:
        done = job.finish()
    # each rank's last step heard (its agent dropped what its queue could not hold while the
    # aggregator was stopped: counted, not a finding), and its goodbye
    wait_for(lambda: all(samples(agg.scrape(), "gradwatch_rank_step").get((("job_id", JOB), ("rank", str(r))))
                         == done[r] - 1 for r in range(2)), 20, what="every rank's last step")
    wait_for(lambda: samples(agg.scrape(), "gradwatch_job_ended").get((("job_id", JOB),)) == 1.0, 30, what="the job ended")
    try:
        assert agg.findings() == [], agg.findings()
        assert "did not run for" in agg.log.read_text()  # the aggregator saw its own pause
    finally:
        agg.stop()
