"""A gloo DDP training job of ``--ranks`` ranks with the agent attached, for the control channel's
tests (tests/test_stacks.py, tests/test_halt.py). Run as a script; gloo rendezvous on loopback.

Each rank trains a small MLP (the same seed everywhere, its own data) for ``--steps`` steps,
``--sleep-s`` after each, its batches coming from the user's own :func:`load_batch`. Faults, each
at step ``--at`` of rank ``--rank`` (or of every rank):

  sleep        the rank's data loader sleeps ``--hold-s`` seconds (:func:`load_batch`)
  collective   the rank enters an all-reduce its peers never enter (:func:`sync_extra`)
  pause        every rank sleeps ``--hold-s`` seconds in :func:`evaluate` (a healthy job, all alike)
  gil          the rank computes for about ``--hold-s`` seconds in one C call holding the GIL (:func:`hold_gil`)
  nan-weight   the rank's first weight gets a NaN after that step (:func:`corrupt`)
  nan-grad     the rank's loss is multiplied by NaN at that step: every rank's all-reduced gradient is NaN

Each rank writes ``--out.<rank>.json``: the steps it completed, the step at which it raised
``gradwatch.Halt`` (None if it did not), the steps it probed (read in a step pre-hook registered
after the agent's), the agent's counters, and the weights (``--out.<rank>.pt``): after each of
the last two completed steps and of the steps ``--keep`` lists, and at the halt. With
``--checkpoint`` rank 0 saves the model's state after every completed step, as a training loop
would.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import timedelta


def load_batch(gen, step: int, a, rank: int):
    """The user's data loader: a batch of random data; at the fault's step, a rank that hangs."""
    import torch

    if a.fault == "sleep" and rank == a.rank and step == a.at:
        time.sleep(a.hold_s)  # the hung data loader
    return torch.randn(a.batch, 16, generator=gen), torch.randn(a.batch, 4, generator=gen)


def sync_extra(rank: int, group):
    """An all-reduce only this rank enters (on a group of its own, so gloo sees no mismatch with
    the peers' gradient all-reduce): it waits there for peers that never come."""
    import torch
    import torch.distributed as dist

    flag = torch.ones(1)
    dist.all_reduce(flag, group=group)  # the peers are in the next step's backward: this never completes
    return flag


def hold_gil(a):
    """A long computation in one C call that never releases the interpreter lock: no other thread
    of the process runs meanwhile, the agent's sender thread neither."""
    return sum(range(int(a.hold_s * 5e7)))


def evaluate(a):
    """Every rank pauses here alike (an evaluation pass): a healthy job whose stacks are equal."""
    time.sleep(a.hold_s)


def corrupt(model):
    import torch

    with torch.no_grad():
        next(model.parameters()).view(-1)[0] = float("nan")


def worker(rank: int, a) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradwatch
    from gradwatch import agent

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=rank, world_size=a.ranks,
                            timeout=timedelta(seconds=a.timeout_s))
    side = dist.new_group(backend="gloo")  # a second group: the collective only the faulty rank enters
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(100 + rank)
    settings = dict(endpoint=a.endpoint, job=a.job, every=a.every or None, heartbeat_s=0.25, coalesce_s=0.1,
                    stack_source=a.stack_source)
    if a.halt:
        settings["on_critical"] = "halt"
    if a.skip:
        settings["on_nonfinite"] = "skip"
    if a.server_key:
        settings.update(server_key=a.server_key, client_key=a.client_key)
    mon = agent.attach(model, opt, **settings)
    probed: list[int] = []
    step = 0

    def seen(optimizer, args, kwargs):  # after the agent's pre-hook: whether this step is probed
        if getattr(mon, "recorder", None) is not None and mon.active and mon.recorder.probing:
            probed.append(step)

    opt.register_step_pre_hook(seen)
    weights: dict[str, dict] = {}
    halted = None

    def snapshot():
        return {n: p.detach().clone() for n, p in model.module.named_parameters()}

    keep = {int(k) for k in a.keep.split(",") if k}
    weights["start"] = snapshot()
    try:
        while step < a.steps:
            if a.fault == "pause" and step == a.at:
                evaluate(a)
            if a.fault == "gil" and rank == a.rank and step == a.at:
                hold_gil(a)
            x, y = load_batch(gen, step, a, rank)
            loss = F.mse_loss(model(x), y)
            if a.fault == "nan-grad" and rank == a.rank and step == a.at:
                loss = loss * float("nan")
            loss.backward()
            if a.fault == "collective" and rank == a.rank and step == a.at:
                sync_extra(rank, side)
            opt.step()
            opt.zero_grad()
            step += 1
            weights[f"after{step - 1}"] = snapshot()
            if step - 3 not in keep:  # the last two completed steps, and those asked for
                weights.pop(f"after{step - 3}", None)
            if rank == 0 and a.checkpoint:
                torch.save(model.module.state_dict(), a.checkpoint)  # the loop's checkpoint of its last step
            if a.fault == "nan-weight" and rank == a.rank and step - 1 == a.at:
                corrupt(model.module)
            time.sleep(a.sleep_s)
    except gradwatch.Halt as e:
        halted = e.step
        weights["halted"] = snapshot()
    info = {"steps": step, "halted": halted, "probed": probed, "rank": rank,
            "nonfinite_skipped": getattr(mon, "nonfinite_skipped", 0)}
    sender = getattr(mon, "sender", None)
    if sender is not None:
        info.update(accepted=sender.inbox.accepted, rejected=dict(sender.inbox.rejected), done=dict(mon.control.done))
    mon.close()
    torch.save(weights, f"{a.out}.{rank}.pt")
    with open(f"{a.out}.{rank}.json", "w") as f:
        json.dump(info, f)
    if halted is None:  # a halted job's ranks all stopped before the same step: no collective is left
        dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--endpoint", required=True)
    p.add_argument("--port", type=int, required=True, help="gloo rendezvous port on 127.0.0.1")
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--job", default="control")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--sleep-s", type=float, default=0.02)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--every", type=int, default=0, help="probe cadence; 0: the budget")
    p.add_argument("--fault", default="", choices=("", "sleep", "collective", "pause", "gil", "nan-weight", "nan-grad"))
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--at", type=int, default=10)
    p.add_argument("--hold-s", type=float, default=30.0)
    p.add_argument("--halt", action="store_true", help="attach with on_critical='halt'")
    p.add_argument("--skip", action="store_true", help="attach with on_nonfinite='skip'")
    p.add_argument("--stack-source", action="store_true")
    p.add_argument("--server-key", default="")
    p.add_argument("--client-key", default="")
    p.add_argument("--checkpoint", default="", help="rank 0 saves the model's state here after every step")
    p.add_argument("--keep", default="", help="steps whose weights after them are kept, comma-separated (and the last two)")
    p.add_argument("--timeout-s", type=float, default=120.0, help="the process group's timeout")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    import torch.multiprocessing as mp

    mp.start_processes(worker, args=(a,), nprocs=a.ranks, start_method="fork")


if __name__ == "__main__":
    main()
