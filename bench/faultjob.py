"""A 2-rank gloo DDP training job with or without the agent, for bench/outage.py and
tests/test_netns_faults.py. Run as a script; gloo rendezvous on loopback.

Stops after ``--steps`` steps, or (``--steps -1``) when the file ``--stop`` appears; the ranks
agree on stopping with an all-reduce every step, in both modes, so a run without the agent can
repeat exactly the steps of a run with it. With ``--baton FILE`` (bench/outage.py) it trains
only while FILE reads ``<--name>:<phase>`` and records steps and seconds of each turn per phase, so two jobs
take turns on the same cores. Writes the step count to ``--progress.<rank>`` after each step and
``--out.<rank>.pt`` (final parameters) and ``--out.<rank>.json`` (counters) at the end.
With ``--watchdog-s S`` a rank still running after S seconds dumps every thread's stack to
stderr and exits 1: a hang becomes a failure that says where it hung.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import os
import resource
import time
from datetime import timedelta

#: glibc's allocator held still, for side-by-side speed runs (bench/outage.py, bench/ddp_steps.py):
#: large blocks stay in the heap and freed memory is not handed back, so no step page-faults fresh
#: memory in (PyTorch's CPU tuning guide swaps in jemalloc or tcmalloc for the same reason). With
#: glibc's defaults a job falls into one of two trim regimes, ~0.1k or ~4k faults a step at width
#: 4096, and stays there; which one is chance, nudged by any other allocation (docs/agent.md: CPU jobs and the allocator)
MALLOC_FIXED = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


def build(rank: int, port: int, width: int):
    """The job of this rank: joins the 2-rank gloo group on 127.0.0.1:``port`` and returns
    ``(model, optimizer, generator)``: a DDP MLP 64-``width``-8 (seed 0, the same on every rank),
    SGD at lr 1e-2, and this rank's data generator (seed 100 + rank). Also bench/ddp_steps.py's."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.ReLU(), torch.nn.Linear(width, 8)))
    return model, torch.optim.SGD(model.parameters(), lr=1e-2), torch.Generator().manual_seed(100 + rank)


def worker(rank: int, a) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    if a.watchdog_s > 0:
        faulthandler.dump_traceback_later(a.watchdog_s, exit=True)
    torch.use_deterministic_algorithms(True)
    model, opt, gen = build(rank, a.port, a.width)
    mon = None
    if a.endpoint:
        from gradwatch import agent

        mon = agent.attach(model, opt, endpoint=a.endpoint, job=a.job, every=a.every or None, heartbeat_s=a.heartbeat_s)
    fd = os.open(f"{a.progress}.{rank}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    baton = os.open(a.baton, os.O_RDONLY) if a.baton else None
    phases: dict[str, list[list[float]]] = {}  # phase -> [steps, seconds] of each turn
    flag = torch.zeros(2)
    step, turn, t0 = 0, None, 0.0
    # the sender thread's CPU time per phase (rank 0, whichever job trains): load-independent
    sender_tid = mon.sender._thread.native_id if mon is not None else None
    sender_cpu: dict[str, list[float]] = {}  # phase -> [cpu seconds, wall seconds]
    cur_phase, c0, w0 = None, 0.0, 0.0

    # the training thread's minor page faults (rank 0): glibc's heap trimming shows as faults
    faults0 = resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)).ru_minflt

    def thread_cpu() -> float:
        with open(f"/proc/self/task/{sender_tid}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    while True:
        flag.zero_()
        if rank == 0:
            flag[0] = float(os.path.exists(a.stop) or (0 <= a.steps <= step))
            if baton is not None:
                owner, _, phase = os.pread(baton, 64, 0).decode().strip().partition(":")
                flag[0] += 2.0 * (owner == "stop")
                flag[1] = float(owner == a.name)
                # a turn starts or ends: the phase's clock runs only while this job trains
                now = time.perf_counter()
                if sender_tid is not None and phase != cur_phase:
                    c = thread_cpu()
                    if cur_phase is not None:
                        acc = sender_cpu.setdefault(cur_phase, [0.0, 0.0])
                        acc[0] += c - c0
                        acc[1] += now - w0
                    cur_phase, c0, w0 = phase, c, now
                mine = phase if owner == a.name else None
                if mine != turn:
                    if turn is not None:
                        phases[turn][-1][1] = now - t0
                    turn, t0 = mine, now
                    if turn is not None:
                        phases.setdefault(turn, []).append([0, 0.0])
        else:
            flag[1] = 1.0 if baton is None else 0.0
        dist.all_reduce(flag)
        if flag[0] > 0:
            break
        if baton is not None and flag[1] < 1:  # not this job's turn
            time.sleep(0.002)
            continue
        x, y = torch.randn(a.batch, 64, generator=gen), torch.randn(a.batch, 8, generator=gen)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        step += 1
        if turn is not None:
            phases[turn][-1][0] += 1
        os.pwrite(fd, f"{step:12d}".encode(), 0)
        if a.sleep_s:
            time.sleep(a.sleep_s)
    if turn is not None:
        phases[turn][-1][1] = time.perf_counter() - t0
    faults = resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)).ru_minflt - faults0
    info = {"steps": step, "phases": phases, "agent": mon is not None, "sender_cpu": sender_cpu,
            "faults_per_step": faults / max(step, 1)}
    if mon is not None:
        s = mon.sender
        info.update(alive=s.alive, errors=mon.errors + s.errors, sent=s.sent, drops=s.drops, connected=s.connected,
                    **{k: getattr(s, k, None) for k in ("reports", "turns", "blocked")})  # None: an older agent
        mon.close()
    torch.save({n: p.detach().clone() for n, p in model.module.named_parameters()}, f"{a.out}.{rank}.pt")
    with open(f"{a.out}.{rank}.json", "w") as f:
        json.dump(info, f)
    del model  # the DDP freed while its group is registered (see train_rank in commands/demo/run.py)
    gc.collect()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--endpoint", default="", help="aggregator endpoint; empty: no agent")
    p.add_argument("--port", type=int, required=True, help="gloo rendezvous port on 127.0.0.1")
    p.add_argument("--steps", type=int, default=-1)
    p.add_argument("--stop", default="/nonexistent")
    p.add_argument("--baton", default="")
    p.add_argument("--name", default="agent")
    p.add_argument("--progress", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--job", default="faults")
    p.add_argument("--every", type=int, default=5, help="probe cadence; 0: the budget (the agent's default)")
    p.add_argument("--heartbeat-s", type=float, default=0.5)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--sleep-s", type=float, default=0.0, help="pause after each step (pacing on a shared machine)")
    p.add_argument("--watchdog-s", type=float, default=0.0, help="dump stacks and exit 1 after this many seconds; 0: off")
    a = p.parse_args()
    import torch.multiprocessing as mp

    mp.start_processes(worker, args=(a,), nprocs=2, start_method="fork")


if __name__ == "__main__":
    main()
