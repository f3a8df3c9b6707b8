"""Every series family under one cap (--max-series-total), and strangers' frames beside a real job.

In this process: proven jobs whose per-rank series together pass the cap are shown by job-level
series (the largest, the newest first among equals), a job keeps per-rank series for at most 64
ranks its findings name, and the scrape stays within the cap whatever the findings.

Beside a real two-rank gloo DDP job (bench/faultjob.py) reporting to a real aggregator process
over TCP: invented jobs from sixteen senders holding every slot, a thousand more invented jobs,
and a lookalike frame under the real job's id. The real job gets in within seconds, is exported
in full and raises no finding; no invented job or lookalike is exported; the scrape stays within
the cap.
"""

from __future__ import annotations

import re
import threading
import time

import numpy as np
import pytest
import zmq
from prometheus_client import generate_latest

from gradwatch.aggregator import Aggregator, load
from gradwatch.aggregator.checks import Finding
from gradwatch.aggregator.seriescap import NAMED_RANKS_MAX

from .conftest import FaultJob, samples, start_aggregator, wait_for
from .fakejob import FakeJob, Model, to_socket


def scrape_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def of_job(lines: list[str], name: str, job: str) -> list[str]:
    return [line for line in lines if line.startswith(name + "{") and f'job_id="{job}"' in line]


MODEL = Model(params=tuple((f"l{i}.weight", (8, 8), "float32") for i in range(20)),
              slots=tuple((f"l{i}", "", "Linear", "float32") for i in range(20)))


def test_per_rank_series_past_the_cap_are_shown_by_job_level_series_and_the_scrape_stays_within_it():
    now = [1000.0]
    agg = Aggregator(load(listen="tcp://127.0.0.1:0", metrics_port=0), clock=lambda: now[0])
    st = agg.state
    jobs = [FakeJob(lambda m: st.apply(m), f"job{i}", 400, MODEL, clock=lambda: now[0]) for i in range(10)]
    for j in jobs:
        j.schema()
        for step in range(3):
            for r in range(j.world):
                j.report(r, step, arrays=MODEL.tile() if step == 0 else None)
            st.finish_closing()
            now[0] += 0.5
            st.tick()
    assert all(st.jobs[j.job].proven for j in jobs)
    # findings naming 100 ranks of the newest job, and 3 of the first
    for job, ranks in (("job9", range(100)), ("job0", (5, 6, 7))):
        for r in ranks:
            f = Finding("straggler", job, 2, "slow", rank=r)
            agg.runner.active.setdefault((job, "straggler"), {})[f.key] = f
    agg.publish()
    text = generate_latest(agg.registry).decode()
    lines = scrape_lines(text)
    assert len(lines) <= agg.cfg.max_series_total
    left = samples(text, "gradwatch_series_left_out")
    assert left[(("kind", "rank"),)] > 0 and left[(("kind", "job"),)] == 0
    # the oldest jobs whole: every rank's essential series, layers, no stand-ins
    assert len(of_job(lines, "gradwatch_rank_step", "job0")) == 400
    assert len(of_job(lines, "gradwatch_check_rank_flagged", "job0")) == 3
    assert of_job(lines, "gradwatch_layer_weight_norm", "job0") and not of_job(lines, "gradwatch_job_rank_step", "job0")
    # the newest: job-level series, per-rank ones for the first 64 ranks its findings name
    assert len(of_job(lines, "gradwatch_job_rank_step", "job9")) == 3
    assert [re.search(r'rank="(\d+)"', line).group(1) for line in of_job(lines, "gradwatch_rank_step", "job9")] == [
        str(r) for r in range(NAMED_RANKS_MAX)]
    assert len(of_job(lines, "gradwatch_check_rank_flagged", "job9")) == NAMED_RANKS_MAX
    # every job keeps its job-level series and its layers
    for j in jobs:
        assert of_job(lines, "gradwatch_job_world_size", j.job) and of_job(lines, "gradwatch_layer_weight_norm", j.job)
    assert samples(text, "gradwatch_jobs")[(("stage", "proven"),)] == 10


def test_past_every_jobs_own_series_the_newest_jobs_lose_their_layers_then_go():
    now = [1000.0]
    agg = Aggregator(load(listen="tcp://127.0.0.1:0", metrics_port=0, max_series_total=1500), clock=lambda: now[0])
    st = agg.state
    jobs = [FakeJob(lambda m: st.apply(m), f"job{i}", 2, MODEL, clock=lambda: now[0]) for i in range(8)]
    for j in jobs:
        j.schema()
        for step in range(3):
            for r in range(2):
                j.report(r, step, arrays=MODEL.tile())
            now[0] += 0.5
            st.tick()
    agg.publish()
    text = generate_latest(agg.registry).decode()
    lines = scrape_lines(text)
    assert len(lines) <= 1500
    left = samples(text, "gradwatch_series_left_out")
    assert left[(("kind", "layer"),)] > 0
    assert of_job(lines, "gradwatch_layer_weight_norm", "job0") and not of_job(lines, "gradwatch_layer_weight_norm", "job7")
    assert of_job(lines, "gradwatch_job_world_size", "job0")


# --- beside a real job ------------------------------------------------------------------------------

JOB = "guarded"


class Attacker:
    """Invented jobs from ``senders`` loopback addresses (each its own source), ``per`` each: a
    schema and a report of step 0 each (a slot), sent again and again; heartbeats in between."""

    def __init__(self, ctx, endpoint: str, senders, per: int, world: int = 1, prefix: str = "fake"):
        host_port = endpoint[len("tcp://"):]
        self.jobs = []
        for i, src in enumerate(senders):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{src}:0;{host_port}")
            for k in range(per):
                self.jobs.append(FakeJob(to_socket(sock), f"{prefix}{i}-{k}", world, key=f"{prefix}{i}-{k}"))

    def round(self) -> None:
        for j in self.jobs:
            j.schema(0)
            j.report(0, 0)


@pytest.mark.ddp
def test_invented_jobs_holding_every_slot_and_a_lookalike_beside_a_real_job(tmp_path):
    agg = start_aggregator(tmp_path, "--publish-interval-s", "0.1")
    ctx = zmq.Context()
    stop = threading.Event()
    try:
        # every slot: 16 senders x 4 invented jobs (each sender's quota of unproven jobs)
        squatters = Attacker(ctx, agg.endpoint, [f"127.0.0.{2 + i}" for i in range(16)], 4)
        squatters.round()
        wait_for(lambda: samples(agg.scrape(), "gradwatch_jobs")[(("stage", "unproven"),)] == 64, 20,
                 what="64 invented jobs holding every slot")
        flood = Attacker(ctx, agg.endpoint, ["127.0.0.99"], 1000, world=3, prefix="inv")

        def keep_at_it():
            while not stop.is_set():
                squatters.round()  # each sender's jobs again: its own churn
                time.sleep(0.2)

        attack = threading.Thread(target=keep_at_it, daemon=True)
        attack.start()
        flood.round()  # a thousand invented jobs from one more sender
        # the real job: two gloo DDP ranks with the agent
        job = FaultJob(tmp_path, agg.endpoint, JOB)
        try:
            wait_for(lambda: job.steps() >= 1, 180, what="the real job's first steps")
            t_first = time.monotonic()
            wait_for(lambda: f'gradwatch_job_world_size{{job_id="{JOB}"}} 2.0' in agg.scrape(), 30,
                     what="the real job exported")
            admitted_s = time.monotonic() - t_first
            # a lookalike: one frame under the real job's id, another key, an exploding norm
            look = ctx.socket(zmq.DEALER)
            look.setsockopt(zmq.LINGER, 1000)
            look.connect(f"tcp://127.0.0.77:0;{agg.endpoint[len('tcp://'):]}")
            fake = FakeJob(to_socket(look), JOB, 1, key="not-the-real-key")
            fake.schema(0)
            fake.report(0, 0, grad_norm=1e30)
            flood.round()
            time.sleep(8)  # the real job trains on beside them
        finally:
            steps = job.finish()
        stop.set()
        attack.join(10)
        wait_for(lambda: all(samples(agg.scrape(), "gradwatch_rank_steps_total").get(
            (("job_id", JOB), ("rank", str(r)))) == steps[r] for r in range(2)), 20, what="every step of the real job counted")
        text = agg.scrape()
        lines = scrape_lines(text)
        print(f"\nthe real job exported {admitted_s:.1f} s after its first steps; scrape {len(lines):,} samples")
        assert admitted_s < 15
        assert len(lines) <= 15_000
        # the real job in full: every rank's series, its layers; no finding, no event
        assert {dict(k)["job_id"] for k in samples(text, "gradwatch_job_world_size")} == {JOB}
        assert len(of_job(lines, "gradwatch_rank_step", JOB)) == 2
        assert of_job(lines, "gradwatch_layer_weight_norm", JOB) and of_job(lines, "gradwatch_rank_grad_norm", JOB)
        assert agg.findings() == [] and agg.findings(active=True) == []
        assert samples(text, "gradwatch_series_left_out")[(("kind", "rank"),)] == 0
        assert samples(text, "gradwatch_jobs_unproven_evicted_total")[()] > 0
        assert samples(text, "gradwatch_jobs_not_admitted_total")[()] == 0  # proven jobs are not squatted
        assert "too_many_jobs" not in {dict(k)["reason"] for k, v in samples(text, "gradwatch_messages_rejected_total").items() if v}
        assert np.isfinite(admitted_s)
    finally:
        stop.set()
        ctx.destroy(linger=0)
        agg.stop()
