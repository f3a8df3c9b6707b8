"""End to end on real parts: a 2-rank gloo DDP demo job with agents -> a real aggregator process
over TCP -> /metrics, checked against a reference computed here, without DDP or the agent."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from gradwatch.commands.demo.model import GPT, GPTConfig, batch, stdlib_text

from .conftest import samples, wait_for

pytestmark = pytest.mark.ddp  # tiers: README, Tests

STEPS, EVERY, RANKS, SEED, BATCH, CONTEXT, LR = 25, 10, 2, 3, 8, 32, 3e-3
LAST_PROBE = (STEPS - 1) // EVERY * EVERY


def reference_linear_grad_norms() -> dict[str, float]:
    """Replay the job in one process: per step, average the ranks' gradients as DDP's all-reduce
    does, then AdamW. Returns the L2 norm over (weight, bias) gradients of every Linear at the last
    probed step."""
    torch.manual_seed(SEED)
    model = GPT(GPTConfig(context=CONTEXT, width=32, layers=2, heads=2))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    text = stdlib_text()
    out = {}
    for step in range(LAST_PROBE + 1):
        grads = None
        for rank in range(RANKS):
            x, y = batch(text, SEED, rank, step, BATCH, CONTEXT)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            g = torch.autograd.grad(loss, list(model.parameters()))
            grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        for p, g in zip(model.parameters(), grads):
            p.grad = g / RANKS
        if step == LAST_PROBE:
            for name, m in model.named_modules():
                if isinstance(m, torch.nn.Linear):
                    sq = sum(float(p.grad.double().square().sum()) for p in m.parameters())
                    out[name] = sq**0.5
        opt.step()
        opt.zero_grad()
    return out


def test_two_rank_ddp_job_reaches_metrics_and_matches_reference(aggregator):
    cmd = [
        sys.executable, "-m", "gradwatch.commands", "demo", "--aggregator", aggregator.endpoint,
        "--ranks", str(RANKS), "--steps", str(STEPS), "--every", str(EVERY), "--seed", str(SEED),
        "--batch-size", str(BATCH), "--context", str(CONTEXT), "--width", "32", "--layers", "2",
        "--heads", "2", "--lr", str(LR), "--job", "e2e", "--no-progress",
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr

    def probe_published():
        text = aggregator.scrape()
        return text if samples(text, "gradwatch_job_probe_step").get((("job_id", "e2e"),)) == LAST_PROBE else None

    text = wait_for(probe_published, 20, what="the last probed step at /metrics")

    steps = samples(text, "gradwatch_rank_steps_total")
    assert steps == {(("job_id", "e2e"), ("rank", str(r))): STEPS for r in range(RANKS)}
    probes = samples(text, "gradwatch_rank_probes_total")
    assert set(probes.values()) == {len(range(0, STEPS, EVERY))}
    rounds = samples(text, "gradwatch_rounds_total")
    assert rounds[(("job_id", "e2e"), ("outcome", "complete"))] == len(range(0, STEPS, EVERY))
    assert rounds[(("job_id", "e2e"), ("outcome", "incomplete"))] == 0

    ref = reference_linear_grad_norms()
    got = samples(text, "gradwatch_layer_grad_norm")
    assert len(ref) == 2 * 4 + 1  # qkv, proj, fc, proj per block, and the head
    for layer, want in ref.items():
        for agg in ("min", "median", "max"):  # after all-reduce every rank holds the same gradient
            value = got[(("agg", agg), ("job_id", "e2e"), ("layer", layer))]
            assert value == pytest.approx(want, rel=1e-5), (layer, agg)

    # every leaf layer shows up in the activation series, for both ranks' data
    layers = {dict(k)["layer"] for k in samples(text, "gradwatch_layer_activation_std")}
    assert {"tok", "pos", "head", "ln_f", "blocks.1.mlp.act"} <= layers
