"""Sharded layouts on real parts: FSDP2, FSDP1 (use_orig_params False and True), HSDP, tensor
parallel and pipeline parallel (with FSDP2, plain replicas or tensor parallelism within a stage;
an interleaved schedule of two stages per rank) jobs (gloo, CPU, tests/sharded_job.py) with agents
-> a real aggregator -> /metrics.

Each run checks the global gradient norm of every rank and the per-layer gradient norms at
/metrics against an unsharded float64 replay of the same job (rel 1e-5), that clean steps raise
no finding, and that training is bit-identical with and without the agent."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from . import sharded_job as J
from .conftest import samples, wait_for

pytestmark = pytest.mark.ddp  # tiers: README, Tests

ROOT = Path(__file__).resolve().parent.parent


def run_job(mode: str, out: Path, ranks: int, steps: int, every: int, endpoint: str = "", job: str = "", flip: str = "",
            without: Path | None = None) -> dict:
    """Run tests/sharded_job.py; returns each rank's local parameters after the last step (with
    ``without``, the same job trained first without the agent in the same processes writes its
    parameters there)."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "tests.sharded_job", mode, "--ranks", str(ranks), "--steps", str(steps),
           "--every", str(every), "--out", str(out)]
    if endpoint:
        cmd += ["--endpoint", endpoint, "--job", job]
    if flip:
        cmd += ["--flip", flip]
    if without is not None:
        cmd += ["--without", str(without)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    # torch 2.13's gloo teardown now and then aborts a process after it finished ("terminate called
    # without an active exception", also without the agent): a rank that saved its results and
    # destroyed its process group has done all the test looks at
    # (the ranks share one pipe: read every mark wherever it lands, not line by line)
    finished = {int(k) for k in re.findall(re.escape(J.DONE) + r" (\d+)", run.stdout)}
    assert run.returncode == 0 or (finished == set(range(ranks)) and "terminate called" in run.stderr), \
        run.stdout[-3000:] + run.stderr[-3000:]
    return {r: torch.load(out / f"rank{r}.pt") for r in range(ranks)}


def reference(mode: str, ranks: int, steps: int) -> list[tuple[float, dict[str, float]]]:
    """Replay the job unsharded in one process, float64: per step, the mean of the replicas'
    gradients (what FSDP's reduce-scatter and HSDP's all-reduce average), then SGD. Returns per
    step the global gradient norm and each module's gradient norm (L2 over its parameters)."""
    m = J.model().double()
    opt = torch.optim.SGD(m.parameters(), lr=J.LR)
    n = J.replicas(mode, ranks)
    out = []
    for step in range(steps):
        grads = None
        for replica in range(n):
            x, y = J.batch(replica, step, torch.float64)
            g = torch.autograd.grad(torch.nn.functional.mse_loss(m(x), y), list(m.parameters()))
            grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        for p, g in zip(m.parameters(), grads):
            p.grad = g / n
        total = sum(float(p.grad.square().sum()) for p in m.parameters()) ** 0.5
        per = {name: sum(float(p.grad.square().sum()) for p in mod.parameters()) ** 0.5
               for name, mod in m.named_children() if any(True for _ in mod.parameters())}
        out.append((total, per))
        opt.step()
        opt.zero_grad()
    return out


def check_job(aggregator, tmp_path: Path, mode: str, ranks: int, steps: int = 50, every: int = 10) -> str:
    """Run ``mode`` with and without the agent and check /metrics against :func:`reference`, no
    finding, and bit-identical training; returns the last /metrics text of the run."""
    job = f"sharded-{mode}-{ranks}"
    with_agent = run_job(mode, tmp_path / "with", ranks, steps, every, aggregator.endpoint, job, without=tmp_path / "without")
    last_probe = (steps - 1) // every * every

    def published():
        text = aggregator.scrape()
        steps_seen = samples(text, "gradwatch_rank_steps_total")
        done = samples(text, "gradwatch_job_probe_step").get((("job_id", job),)) == last_probe
        return text if done and len(steps_seen) == ranks and set(steps_seen.values()) == {steps} else None

    text = wait_for(published, 30, what=f"{job}: every step and the last probed step at /metrics")
    ref = reference(mode, ranks, steps)

    norms = samples(text, "gradwatch_rank_grad_norm")
    for r in range(ranks):  # the global norm, as under DDP: not the rank's shard
        assert norms[(("job_id", job), ("rank", str(r)))] == pytest.approx(ref[-1][0], rel=1e-5), r
    layers = samples(text, "gradwatch_layer_grad_norm")
    for layer, want in ref[last_probe][1].items():
        for agg in ("min", "median", "max"):
            assert layers[(("agg", agg), ("job_id", job), ("layer", layer))] == pytest.approx(want, rel=1e-5), (layer, agg)

    rounds = samples(text, "gradwatch_rounds_total")
    assert rounds[(("job_id", job), ("outcome", "complete"))] == len(range(0, steps, every))
    assert aggregator.findings(job) == []  # a healthy sharded job: no finding at all

    without = {r: torch.load(tmp_path / "without" / f"rank{r}.pt") for r in range(ranks)}
    for r in range(ranks):  # the agent never changes training: bit for bit
        assert with_agent[r].keys() == without[r].keys()
        for name in with_agent[r]:
            assert torch.equal(with_agent[r][name].view(torch.uint8), without[r][name].view(torch.uint8)), (r, name)
    return text


# pipeline parallel ("pp..."): GPipe stages x data-parallel or tensor-parallel ranks per stage. Each
# rank's agent reports its stages' parameters only; the aggregator adds the stages' sums of squares
# into the global norm every rank shows, and per layer /metrics aggregates the ranks holding that layer.
@pytest.mark.parametrize("mode, ranks, steps", [
    ("fsdp2", 2, 50),
    ("fsdp2", 4, 50),
    ("fsdp1", 2, 50),
    ("fsdp1o", 2, 50),
    ("tp", 2, 50),  # a tensor-parallel MLP with a replicated LayerNorm
    ("hsdp", 4, 50),  # 2 x 2
    ("pp", 4, 30),  # 2 stages (layers 0-1, 2-3), FSDP2 within each: the mesh found from the "dp" sub-mesh
    # 2 stages x 2 tensor-parallel ranks: stage 0 column-wise, stage 1 row-wise plus a LayerNorm
    # replicated over its TP pair; the mesh (pp, tp) found from the parameters' "tp" sub-mesh, each
    # stage's shard groups its TP pair
    ("pptp", 4, 50),
    # 4 one-layer stages on 2 ranks (rank r: stages r and r + 2, ScheduleInterleaved1F1B): a rank's
    # report covers all its stages; the aggregator adds the 2 ranks' totals (one per "pp" coordinate)
    ("ppi", 2, 50),
], ids=lambda v: str(v))
def test_a_sharded_layout(aggregator, tmp_path, mode, ranks, steps):
    check_job(aggregator, tmp_path, mode, ranks, steps=steps, every=10)


def test_pipeline_parallel_2_stages_3_replicas_each(aggregator, tmp_path):
    job = "sharded-ppdp-6"
    text = check_job(aggregator, tmp_path, "ppdp", 6, steps=50, every=10)  # plain replicas: attach(mesh=)
    # outlier_rank scored every rank among its own stage's 3 replicas (activation scales of
    # different layers per stage), and none stood out over the 5 probed steps
    z = samples(text, "gradwatch_rank_outlier_zscore")
    assert sorted(int(dict(k)["rank"]) for k in z if dict(k)["job_id"] == job) == list(range(6))
    assert max(v for k, v in z.items() if dict(k)["job_id"] == job) < 3.5


def test_fsdp1_inside_pipeline_stages(aggregator, tmp_path):
    # FSDP1 over each stage's 2 data-parallel ranks: fails inside torch's pipelining on gloo/CPU in
    # torch 2.13 (the stage's first backward), before the agent is involved; skipped on that error
    # only, so a torch that runs it runs the whole check
    try:
        run_job("ppfsdp1", tmp_path / "probe", 4, steps=1, every=1)
    except AssertionError as e:
        if "data is not allocated yet" in str(e):
            pytest.skip(f"FSDP1 in a PipelineStage, torch {torch.__version__}, gloo/CPU: stage backward fails: "
                        "RuntimeError: The tensor has a non-zero number of elements, but its data is not allocated yet")
        raise
    check_job(aggregator, tmp_path, "ppfsdp1", 4, steps=50, every=10)


def drift_findings(aggregator, job: str) -> list[dict]:
    return [e for e in aggregator.findings(job) if e["check"] == "replica_drift" and e["event"] == "raised"]


# after a flip, HSDP's all-reduce over "replicate" keeps the gradients equal: only the flipped
# weight drifts. Tensor parallel has no reduction of replicated parameters' gradients: the flipped
# LayerNorm changes rank 1's replicated gradients too, so every replicated parameter drifts by the
# next probe; the column- and row-sharded weights are never compared across the TP group.
# Two holders: no majority. The tie-break (aggregator/checks/replica_drift.py) names the rank whose
# weight norm jumped: an exponent bit (23) halves or doubles the element, a jump far beyond the
# optimizer's move (of a 2-element LayerNorm shard: decisive; one element of 0.weight's 64-element
# shard moves its norm only a few times the optimizer's move: undecided); a low mantissa bit (3)
# moves the norm by about 1e-7 of itself, less than one SGD step does: both ranks stay candidates.
@pytest.mark.parametrize("mode, ranks, flip, drifted, named, candidates", [
    ("hsdp", 4, "12:2:3.weight:29", ["3.weight"], 2, [0, 2]),  # rank 2 replicates rank 0's shard
    ("hsdp", 4, "12:2:0.weight", ["0.weight"], None, [0, 2]),
    ("tp", 2, "14:1:3.weight:29", ["2.bias", "3.weight", "3.bias"], 1, [0, 1]),  # Replicate over the TP group
    ("tp", 2, "12:1:3.weight:31", ["2.bias", "3.weight", "3.bias"], None, [0, 1]),
])
def test_bit_flip_between_two_holders_is_named_when_its_norm_jumped(aggregator, tmp_path, mode, ranks, flip, drifted,
                                                                    named, candidates):
    job = f"flip-{mode}-{flip}"
    run_job(mode, tmp_path, ranks, steps=20, every=5, endpoint=aggregator.endpoint, job=job, flip=flip)
    if mode == "tp" and named is None:
        # a tie on both sides: grad_agreement's finding of the replicated gradients (step 13, no rank)
        # comes first and the drift names no rank either, so it is folded into that finding (one
        # fault, one finding), its summary listed there
        def folded():
            return [k for x in aggregator.findings(job) if x["check"] == "grad_agreement" and x["event"] == "updated"
                    for k in x["details"].get("knock_on", []) if k["check"] == "replica_drift"]

        (k, *_) = wait_for(folded, 30, what="the drift folded into the gradient finding")
        assert (k["step"], k["rank"]) == (15, None) and f"candidates {candidates}" in k["summary"], k
        assert drift_findings(aggregator, job) == []
        assert [(x["check"], x["event"], x["step"], x["rank"]) for x in aggregator.findings(job)] == [
            ("grad_agreement", "updated", 13, None), ("grad_agreement", "raised", 13, None)]
        return
    (e, *_) = wait_for(lambda: drift_findings(aggregator, job), 30, what="a replica_drift finding")
    assert e["step"] == 15, e  # flipped after step 12's (14's) update, probed at 15
    assert e["details"]["params"] == drifted, e
    assert e["rank"] == named, str(e["details"])
    assert e["details"]["candidates"] == candidates, e
    assert e["details"]["ranks"] == list(range(ranks))
    if named is not None:  # the flipped parameter is the decisive one: its norm jumped on that rank only
        flipped = flip.split(":")[2]
        moved = e["details"]["norms"][flipped]["moved"]
        assert moved[str(named)] > 2 * max(v for k, v in moved.items() if k != str(named)), e
    # one fault, one finding: raised once, at the next probe, and no other check fires
    assert [(x["step"], x["rank"]) for x in drift_findings(aggregator, job)] == [(15, named)]
    others = [(x["check"], x["step"], x["rank"]) for x in aggregator.findings(job) if x["check"] != "replica_drift"]
    # under TP rank 1's corrupted LayerNorm also changes its replicated gradients: grad_agreement
    # reports that tie too, from the next step's gradient norms (no rank: it has no history to
    # break it with)
    assert others == ([("grad_agreement", int(flip.split(":")[0]) + 1, None)] if mode == "tp" else []), others


def test_bit_flip_in_one_replica_of_one_pipeline_stage_names_the_rank(aggregator, tmp_path):
    # ranks 3, 4, 5 are stage 1's replicas (dp 0, 1, 2); rank 4's 2.weight flips after step 12.
    # Gradients are all-reduced within the stage, so only the flipped weight drifts; stage 0's
    # ranks (which never hold 2.weight) are not compared with stage 1's.
    job = "flip-ppdp"
    run_job("ppdp", tmp_path, 6, steps=20, every=5, endpoint=aggregator.endpoint, job=job, flip="12:4:2.weight")
    (e, *_) = wait_for(lambda: drift_findings(aggregator, job), 30, what="a replica_drift finding")
    assert e["step"] == 15 and e["rank"] == 4, e
    assert e["details"]["params"] == ["2.weight"], e
    assert [(x["step"], x["rank"]) for x in drift_findings(aggregator, job)] == [(15, 4)], "raised once, at the next probe"
    assert [x for x in aggregator.findings(job) if x["check"] != "replica_drift"] == []
