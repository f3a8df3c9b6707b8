"""Dead units and vanishing gradients on a real 2-rank gloo DDP job against a real aggregator
process. The fault is injected by this harness: a ReLU and a GELU layer whose preceding Linear has a
large negative bias (their units never fire; GELU's tail rounds to exact zeros), and a loss scaled by 1e-12 from one step on (the gradients
all but vanish on every rank)."""

from __future__ import annotations

import os
import time

import pytest
import torch.multiprocessing as mp

from .conftest import free_port, samples, start_aggregator, wait_for

pytestmark = pytest.mark.ddp  # tiers: README, Tests

RANKS, STEPS, EVERY, VANISH_FROM = 2, 30, 2, 10


def _rank(rank: int, endpoint: str, master_port: int, dead: bool) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(RANKS), LOCAL_RANK=str(rank),
                      TORCHELASTIC_RUN_ID="dead" if dead else "alive", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(master_port))
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from gradwatch import agent

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=RANKS)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
            torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 1)
        )
        if dead:
            with torch.no_grad():
                model[2].bias.fill_(-100.0)  # the second ReLU's units never fire
                model[4].bias.fill_(-100.0)  # nor the GELU's
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(rank)
        with agent.attach(ddp, opt, endpoint=endpoint, every=EVERY):
            for step in range(STEPS):
                x = torch.randn(16, 8, generator=gen)
                loss = F.mse_loss(ddp(x), x.sum(1, keepdim=True))
                if dead and step >= VANISH_FROM:
                    loss = loss * 1e-12
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            time.sleep(0.3)
        del ddp  # the DDP freed while its group is registered (see train_rank in commands/demo/run.py)
    finally:
        dist.destroy_process_group()


def _run(endpoint: str, dead: bool) -> None:
    mp.start_processes(_rank, args=(endpoint, free_port(), dead), nprocs=RANKS, start_method="spawn")


def test_dead_relu_layer_and_vanishing_gradients_are_named_and_a_healthy_job_raises_neither(tmp_path):
    agg = start_aggregator(tmp_path, "--publish-interval-s", "0.05", "--round-grace-s", "3")
    try:
        _run(agg.endpoint, dead=True)
        _run(agg.endpoint, dead=False)
        for job in ("dead", "alive"):
            wait_for(lambda: samples(agg.scrape(), "gradwatch_job_probe_step").get((("job_id", job),))
                     == STEPS - EVERY, 20, what=f"the last probe of {job}")
        raised = sorted((e["check"], e["layer"], e["rank"]) for e in agg.findings("dead")
                        if e["event"] == "raised" and e["check"] in ("dead_units", "vanishing"))
        # layers "3" and "5" are the second ReLU and the GELU (module paths of the Sequential);
        # vanishing names no rank
        assert raised == [("dead_units", "3", None), ("dead_units", "5", None), ("vanishing", None, None)]
        vanish = next(e for e in agg.findings("dead") if e["check"] == "vanishing")
        assert vanish["step"] == VANISH_FROM
        assert [e for e in agg.findings("alive") if e["check"] in ("dead_units", "vanishing")] == []
        status = {(dict(k)["check"], dict(k)["status"]): v for k, v in samples(agg.scrape(), "gradwatch_check_status").items()
                  if ("job_id", "alive") in k}
        assert status[("dead_units", "healthy")] == 1 and status[("vanishing", "healthy")] == 1
    finally:
        agg.stop()
