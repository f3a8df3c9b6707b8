"""The smallest DDP training script with the gradwatch agent attached: README's "A plain training loop"
snippet, runnable. A 2-layer MLP learns y = sum(x) on random batches, on CPU over gloo.

Run it beside an aggregator (``gradwatch aggregator`` listens on tcp://127.0.0.1:5555)::

    GRADWATCH_JOB=example torchrun --nproc-per-node 2 examples/train.py --steps 200

``GRADWATCH_JOB`` names the job on the dashboards: a single-node torchrun without
``--master-port`` or ``--rdzv-endpoint`` gives every launch a fresh random run id (whatever
``--rdzv-id`` says), which would otherwise be the job id. Every other
setting comes from ``GRADWATCH_<NAME>`` too (``GRADWATCH_ENDPOINT=tcp://host:5555``).
"""

from __future__ import annotations

import argparse
import gc

import torch
import torch.distributed as dist

import gradwatch.agent as gw


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200, help="optimizer steps")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be at least 1")

    dist.init_process_group("gloo")  # torchrun's environment: RANK, WORLD_SIZE, MASTER_ADDR, ...
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(dist.get_rank())  # each rank its own batches
    with gw.attach(model, optimizer) as monitor:
        for _ in range(args.steps):
            x = torch.randn(64, 32, generator=data)
            loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
            monitor.observe_loss(loss)  # optional: the loss on the dashboards, no host sync
            loss.backward()
            optimizer.step()  # the step boundary the agent counts
            optimizer.zero_grad()
    if dist.get_rank() == 0:
        print(f"trained {args.steps} steps on {dist.get_world_size()} ranks, last loss {loss.item():.4f}")
    # torch, not gradwatch: a DDP model freed after destroy_process_group (here: at the function's
    # return) can hang gloo's teardown now and then (pytorch/pytorch#56297); free it first
    del model, optimizer, monitor
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
