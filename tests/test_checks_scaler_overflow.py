"""A healthy AMP job whose loss scale grew huge, on a real 2-rank gloo DDP job against a real
aggregator process: bf16 autocast with a GradScaler, whose scale only grows when gradients never
overflow (float32 master gradients: ~2^64 after ~96,000 steps at the default growth_interval).
The DDP hook's float32 sum of squares of the scaled bucket then overflows, so the ranks' local
norms would read Inf beside finite gradients: a false critical ``nonfinite`` finding, and an
explosion that cannot name its rank. The scale starts at 2^70 here to get there at once. Such a
norm is no event, and from the step after the agent first sees the scale past 2^40 its hook
divides each bucket by the scale before norming it: the local norms are finite and exact against
a float64 reference."""

from __future__ import annotations

import json
import math
import os
import time

import pytest
import torch.multiprocessing as mp

from .conftest import free_port, samples, start_aggregator, wait_for

pytestmark = pytest.mark.ddp  # tiers: README, Tests

RANKS, STEPS, EVERY = 2, 24, 4


def _rank(rank: int, endpoint: str, master_port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(RANKS), LOCAL_RANK=str(rank),
                      TORCHELASTIC_RUN_ID="scaled", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port))
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from gradwatch import agent

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=RANKS)
    try:
        torch.manual_seed(0)
        def net():
            return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))

        model = net()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**70, growth_interval=1_000_000)
        gen = torch.Generator().manual_seed(100 + rank)
        with agent.attach(ddp, opt, scaler=scaler, endpoint=endpoint, every=EVERY) as mon:
            for step in range(STEPS):
                x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
                if step == STEPS - 1:
                    # the sender switches the division on once it has seen a report with the scale
                    # (a step or two after the first); the last step must come after that
                    deadline = time.monotonic() + 20
                    while mon.comm.unscale.source is None and time.monotonic() < deadline:
                        time.sleep(0.01)
                    # the reference: this rank's own gradient of this step (no all-reduce), by a
                    # copy of the model, in float64, unscaled
                    twin = net()  # not a deepcopy: that would copy the agent's module hooks too
                    twin.load_state_dict(model.state_dict())
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        scaler.scale(F.mse_loss(twin(x).float(), y)).backward()
                    sq = sum(float(p.grad.double().square().sum()) for p in twin.parameters())
                    with open(f"{out}.{rank}", "w") as f:
                        json.dump(math.sqrt(sq) / 2.0**70, f)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = F.mse_loss(ddp(x).float(), y)
                scaler.scale(loss).backward()
                assert all(torch.isfinite(p.grad).all() for p in model.parameters())  # healthy, scaled
                # the premise: a float32 norm of the scaled gradient overflows
                assert torch.isinf(torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()])))
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
            assert scaler.get_scale() == 2.0**70  # no step skipped
            time.sleep(0.3)
        del ddp, mon  # the DDP freed while its group is registered (see train_rank in commands/demo/run.py)
    finally:
        dist.destroy_process_group()


def test_a_huge_loss_scale_on_finite_gradients_raises_no_nonfinite_finding(tmp_path):
    agg = start_aggregator(tmp_path, "--publish-interval-s", "0.05")
    try:
        out = str(tmp_path / "local")
        mp.start_processes(_rank, args=(agg.endpoint, free_port(), out), nprocs=RANKS, start_method="spawn")
        wait_for(lambda: samples(agg.scrape(), "gradwatch_job_probe_step").get((("job_id", "scaled"),))
                 == STEPS - EVERY, 20, what="the last probe")
        wait_for(lambda: sorted(samples(agg.scrape(), "gradwatch_rank_step").values()) == [STEPS - 1] * RANKS,
                 20, what="the last step")
        text = agg.scrape()
        local = samples(text, "gradwatch_rank_local_grad_norm")
        want = {str(r): json.loads((tmp_path / f"local.{r}").read_text()) for r in range(RANKS)}
        assert sorted(dict(k)["rank"] for k in local) == sorted(want)
        for k, v in local.items():  # the hook divided the bucket by the scale: finite, exact
            assert v == pytest.approx(want[dict(k)["rank"]], rel=1e-5)
        grad = samples(text, "gradwatch_rank_grad_norm")
        assert grad and all(0 < v < 100 for v in grad.values())  # the gradients themselves are finite
        assert [e for e in agg.findings("scaled") if e["event"] == "raised"] == []
        nonfinite = samples(text, "gradwatch_rank_nonfinite_steps_total")
        assert nonfinite and all(v == 0 for v in nonfinite.values())
    finally:
        agg.stop()
