"""gradwatch where users train: a Hugging Face Trainer, a Lightning and an accelerate job, each a
real two-rank job launched by torchrun (gloo, CPU) with the framework's one line of gradwatch,
reporting through a tee (kept here for exact comparison, passed on unchanged) to a real
aggregator over TCP.

Each job (tests/jobs/) trains with gradient accumulation 2 under clipping at 1.0 and multiplies
rank 1's loss by 1e4 at one step; each rank writes float64 references of what its optimizer
applied. Checked: the steps are the framework's, every step's global gradient norm and every
parameter's equal the references, the loss is the framework's (not divided by accumulation),
both ranks' own norms are measured (rank 1's is the blown-up one), probes carry per-layer
statistics, and the aggregator raises exactly one finding: an explosion naming rank 1 at the
framework's step.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import pytest

from gradwatch import wire

from .conftest import ROOT, Collector, free_port, start_aggregator, wait_for

pytestmark = [pytest.mark.ddp, pytest.mark.timeout(240)]

STEPS, INJECT, RANKS = 40, 25, 2
#: where each framework numbers the blown-up step (its own numbering: Trainer's global_step
#: after the step, Lightning's before it, accelerate none of its own: optimizer steps from 0)
FRAMEWORKS = ("hf", "lightning", "accelerate")


def run_job(framework: str, tmp_path, aggregator) -> tuple[Collector, list[dict]]:
    tee = Collector(forward=aggregator.endpoint)
    out = tmp_path / framework
    out.mkdir()
    env = {
        **os.environ, "GW_OUT": str(out), "GW_STEPS": str(STEPS), "GW_INJECT_STEP": str(INJECT), "GW_INJECT_RANK": "1",
        "GRADWATCH_ENDPOINT": tee.endpoint, "GRADWATCH_JOB": f"{framework}-job", "GRADWATCH_EVERY": "5",
        "PYTHONUNBUFFERED": "1",
    }
    log = out / "job.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS), "--master-addr", "127.0.0.1",
         "--master-port", str(free_port()), str(ROOT / "tests" / "jobs" / f"{framework}_job.py")],
        env=env, cwd=out, stdout=log.open("w"), stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 200
    try:
        while proc.poll() is None:
            assert time.monotonic() < deadline, f"{framework} job still running: {log.read_text()[-3000:]}"
            tee.pump(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, log.read_text()[-5000:]
    # the goodbyes (and anything behind them) are on their way: both ranks said finished
    tee.wait(lambda: len([m for m in tee.of(wire.Heartbeat) if m.reason == "finished"]) == RANKS,
             what="both ranks' goodbyes")
    refs = [json.loads((out / f"ref-{r}.json").read_text()) for r in range(RANKS)]
    return tee, refs


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_framework_job_is_measured_right_and_its_blow_up_names_rank_1(framework, tmp_path):
    aggregator = start_aggregator(tmp_path, "--round-grace-s", "3", "--publish-interval-s", "0.05")
    try:
        tee, refs = run_job(framework, tmp_path, aggregator)
        job = f"{framework}-job"
        for rank, ref in enumerate(refs):
            reports = tee.reports(job=job, rank=rank)
            steps = {int(s): v for s, v in ref["steps"].items()}
            # the framework's steps, every one of them
            assert sorted(reports) == sorted(steps), (rank, sorted(reports)[:5], sorted(steps)[:5])
            schemas = [m for m in tee.of(wire.Schema) if m.header.job == job and m.header.rank == rank]
            names = [p[0] for p in schemas[-1].params]
            compared = 0
            for s, r in sorted(reports.items()):
                want = steps[s]
                assert r.grad_norm == pytest.approx(want["grad_norm"], rel=1e-6), (rank, s)
                assert r.loss == pytest.approx(want["loss"], rel=1e-5), (rank, s)
                assert math.isfinite(r.local_grad_norm) and r.local_grad_norm > 0, (rank, s)
                if r.grad_norms is not None:
                    got = dict(zip(names, r.grad_norms.tolist()))
                    assert got == pytest.approx(want["params"], rel=1e-5), (rank, s)
                    compared += 1
            assert compared == len(steps), "per-parameter norms travel every step of a replicated job"
            probes = [r for r in reports.values() if r.probe]
            assert probes and all(p.act is not None and len(p.act) > 0 for p in probes), "probes carry per-layer statistics"
        # the blow-up: rank 1's own norm at the injected step, far above rank 0's
        blown = [tee.reports(job=job, rank=r)[INJECT].local_grad_norm for r in range(RANKS)]
        assert blown[1] > 100 * blown[0], blown
        if framework == "hf":  # the Trainer's log: the ranks' mean of the loss gradwatch reports
            log = {e["step"]: e["loss"] for e in refs[0]["log"]}
            for s, logged in log.items():
                mean = sum(tee.reports(job=job, rank=r)[s].loss for r in range(RANKS)) / RANKS
                assert mean == pytest.approx(logged, rel=1e-3, abs=1e-4), s
        if framework == "lightning":  # Lightning's logger records the same step numbers
            lines = (tmp_path / framework / "csv" / "version_0" / "metrics.csv").read_text().splitlines()[1:]
            assert sorted({int(line.split(",")[1]) for line in lines}) == sorted(tee.reports(job=job, rank=0))

        def findings():
            events = aggregator.findings(job=job)
            return events if any(e["check"] == "explosion" for e in events) else None

        events = wait_for(findings, 30, what="the explosion finding")
        time.sleep(1.0)  # anything else the job's end would raise
        raised = [e for e in aggregator.findings(job=job) if e["event"] == "raised"]
        assert [(e["check"], e["rank"], e["step"]) for e in raised] == [("explosion", 1, INJECT)], events
    finally:
        aggregator.stop()
        if "tee" in locals():
            tee.close()
