"""README's example training script (examples/train.py) under a real torchrun, two gloo ranks,
against a real aggregator process: it runs as the README says, and the aggregator shows the job
under the id it was given, every rank at its last step, with no finding."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import samples, wait_for

pytestmark = pytest.mark.ddp

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train.py"


def test_the_example_script_trains_under_torchrun_and_reports_its_ranks(aggregator):
    steps = 30
    env = {**os.environ, "GRADWATCH_JOB": "example", "GRADWATCH_ENDPOINT": aggregator.endpoint}
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(EXAMPLE), "--steps", str(steps)],
        capture_output=True, text=True, timeout=240, env=env,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"trained {steps} steps on 2 ranks" in run.stdout

    def at_last_step():
        seen = samples(aggregator.scrape(), "gradwatch_rank_steps_total")
        return {dict(k)["rank"]: v for k, v in seen.items() if dict(k)["job_id"] == "example"} == {"0": steps, "1": steps}

    wait_for(at_last_step, 20, what="both ranks' steps on /metrics")
    assert aggregator.findings(job="example") == []
