"""The opt-in circuit breakers on real gloo DDP jobs (tests/controljob.py) and a real aggregator:
the aggregator's halt stops every rank at the same step, before that step's optimizer step; the
local breaker skips a step whose all-reduced gradient is not finite on every rank alike."""

from __future__ import annotations

import pytest
import torch

from .conftest import samples, start_aggregator, wait_for
from .test_stacks import Job

pytestmark = [pytest.mark.ddp, pytest.mark.timeout(300)]


def weights(job: Job, rank: int) -> dict:
    return torch.load(f"{job.out}.{rank}.pt")


def same(a: dict, b: dict) -> bool:
    """Bit for bit (a NaN equals the same NaN)."""
    return a.keys() == b.keys() and all(a[k].numpy().tobytes() == b[k].numpy().tobytes() for k in a)


def finite(w: dict) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in w.values())


def test_a_nan_in_one_ranks_weights_halts_all_three_ranks_at_the_same_step_before_its_optimizer_step(tmp_path):
    """Rank 1's first weight turns NaN after step 20 (every rank attached with on_critical="halt"
    and on_nonfinite="skip": the NaN gradients of the steps after it change no weight). The
    aggregator's nonfinite finding (critical) halts the job: every rank raises gradwatch.Halt at
    the same step H, before H's optimizer step (its weights are those after step H - 1), the
    finding records the halt, and the checkpoint rank 0 saved after the loop's last completed step
    equals the last clean weights (after step 20). The same job without on_critical="halt" trains on
    to its last step."""
    agg = start_aggregator(tmp_path, "--publish-interval-s", "0.05")
    ckpt = tmp_path / "checkpoint.pt"
    try:
        job = Job(tmp_path, agg.endpoint, "--job", "halt", "--halt", "--skip", "--fault", "nan-weight", "--rank", "1",
                  "--at", "20", "--steps", "2000", "--sleep-s", "0.02", "--keep", "20", "--checkpoint", str(ckpt))
        job.wait(240)
        infos = [job.info(k) for k in range(3)]
        halted = {i["halted"] for i in infos}
        assert len(halted) == 1 and None not in halted, infos
        (h,) = halted
        assert 21 < h < 2000
        for k, i in enumerate(infos):
            assert i["steps"] == h, i  # the loop completed steps 0 .. H - 1, and not H
            w = weights(job, k)
            assert same(w["halted"], w[f"after{h - 1}"]), k  # no optimizer step at H
            assert i["done"].get("halt") == 1 and i["nonfinite_skipped"] >= 1, i  # one halt, though two checks found
        w0 = weights(job, 0)
        checkpoint = torch.load(ckpt)
        clean = w0["after20"]
        assert finite(clean) and same(dict(checkpoint), clean)
        assert not finite(weights(job, 1)["halted"])  # the corrupted replica itself
        found = [f for f in agg.findings("halt", active=True) if "halt" in f["details"]]
        assert "nonfinite" in {f["check"] for f in found}, found
        assert all(f["details"]["halt"]["step"] == h and f["details"]["halt"]["ranks"] == [0, 1, 2] for f in found)
        assert sum(f["details"]["halt"].get("sent", True) for f in found) == 1
        halts = samples(agg.scrape(), "gradwatch_control_total")[(("what", "halts"),)]
        assert halts == 1.0

        # the same job with the aggregator's halt off: it trains on to its last step
        off = Job(tmp_path, agg.endpoint, "--job", "nohalt", "--skip", "--fault", "nan-weight", "--rank", "1",
                  "--at", "20", "--steps", "120", "--sleep-s", "0.02", name="off")
        off.wait(240)
        for k in range(3):
            i = off.info(k)
            assert i["halted"] is None and i["steps"] == 120 and i["done"].get("halt") is None, i
        wait_for(lambda: any(f["check"] == "nonfinite" for f in agg.findings("nohalt", active=True)), 30,
                 what="the nonfinite finding of the job that trains on")
        assert samples(agg.scrape(), "gradwatch_control_total")[(("what", "halts"),)] == 1.0
    finally:
        agg.stop()


def test_the_local_breaker_skips_a_nan_gradient_step_on_both_ranks_alike(tmp_path):
    """Two ranks with on_nonfinite="skip", no halt; rank 1's loss is NaN at step 10 only. The
    all-reduced gradient is NaN on both, so both take it away: the weights after step 10 are those
    after step 9, equal on both ranks, training goes on (step 11 changes them), each rank counts
    one skipped step, and the aggregator exports it per rank."""
    agg = start_aggregator(tmp_path, "--publish-interval-s", "0.05")
    try:
        job = Job(tmp_path, agg.endpoint, "--job", "breaker", "--ranks", "2", "--skip", "--fault", "nan-grad",
                  "--rank", "1", "--at", "10", "--steps", "20", "--keep", "9,10,11")
        job.wait(180)
        w = [weights(job, k) for k in range(2)]
        for k in range(2):
            assert job.info(k)["nonfinite_skipped"] == 1 and job.info(k)["steps"] == 20
            assert same(w[k]["after10"], w[k]["after9"]) and finite(w[k]["after10"])
            assert not same(w[k]["after11"], w[k]["after10"])
        assert same(w[0]["after10"], w[1]["after10"]) and same(w[0]["after19"], w[1]["after19"])

        def exported():
            s = samples(agg.scrape(), "gradwatch_rank_nonfinite_skipped_steps_total")
            got = {dict(k)["rank"]: v for k, v in s.items() if dict(k)["job_id"] == "breaker"}
            return got if got == {"0": 1.0, "1": 1.0} else None

        wait_for(exported, 30, what="one skipped step exported per rank")
    finally:
        agg.stop()
