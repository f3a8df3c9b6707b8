"""Steps per second of a 2-rank gloo DDP job with and without the agent, no aggregator anywhere,
and where the agent's time on the training thread goes.

Runs of ``--steps`` optimizer steps each, one variant at a time on the whole machine, alternating
the variants' order every round; a run's figure is rank 0's steps/s after a warm-up of 200 steps;
a variant's figure is its median over ``--rounds`` runs and "ratio" that median over the no-agent
median. Unlike bench/outage.py (two jobs taking turns on the cores, aggregator faults) this asks
only what the agent's every-step path costs a small DDP job.

Variants:

  none        the plain training step
  agent       gradwatch.agent.attach with its defaults (endpoint where nothing listens, or --endpoint)
  no-hook     the same without the DDP communication hook (``local_norms=False``)
  hook-only   no agent, only its all-reduce hook (agent.ddp.allreduce_mean) in DDP's place

``--timers`` adds rank 0's mean wall time per step in the agent's bucket observation, its
hook's all-reduce launch and the sentinel (the agent's own measurement) to the agent runs, and
to every run the CPU time per step of rank 0's training thread and (with the agent) its sender
thread, from schedstat: the figures that hold whatever else runs on the machine.

    .venv/bin/python bench/ddp_steps.py                                  # MLP 64-256-8, batch 32
    .venv/bin/python bench/ddp_steps.py --width 8192 --batch 512 --steps 300 --timers
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

VARIANTS = ("none", "agent", "no-hook", "hook-only")
ROOT = Path(__file__).resolve().parents[1]


def cpu_s(tid: int) -> float:
    """Seconds thread ``tid`` of this process has run on a CPU (schedstat's first field): unlike
    wall time, it does not grow when other work shares the cores."""
    with open(f"/proc/self/task/{tid}/schedstat", "rb") as f:
        return int(f.read().split()[0]) / 1e9


def worker(rank: int, variant: str, a, port: int, q) -> None:
    import threading

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT))
    from bench.faultjob import build
    import resource

    model, opt, gen = build(rank, port, a.width)
    mon, spent = None, {}
    if variant == "hook-only":
        from gradwatch.agent.ddp import allreduce_mean

        model.register_comm_hook(None, allreduce_mean)
    elif variant != "none":
        from gradwatch import agent

        mon = agent.attach(model, opt, endpoint=a.endpoint or "tcp://127.0.0.1:9", job=f"ddp-steps-{port}",
                           local_norms=variant != "no-hook")
        if a.timers and mon.comm.observing:
            def timed(name, fn):
                def call(*args, **kwargs):
                    t = time.perf_counter()
                    try:
                        return fn(*args, **kwargs)
                    finally:
                        spent[name] = spent.get(name, 0.0) + time.perf_counter() - t
                return call

            mon.comm.observe = timed("bucket observation", mon.comm.observe)
            inner_state, inner = mon.comm._inner
            mon.comm._inner = (inner_state, timed("hook's all-reduce launch", inner))

    def step():
        x, y = torch.randn(a.batch, 64, generator=gen), torch.randn(a.batch, 8, generator=gen)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(200):
        step()
    dist.barrier()
    tids = {"training thread": threading.get_native_id()}
    if mon is not None:
        tids["sender thread"] = mon.sender._thread.native_id
    cpu0 = {k: cpu_s(t) for k, t in tids.items()}
    faults0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    t0 = time.perf_counter()
    for _ in range(a.steps):
        step()
    dt = time.perf_counter() - t0
    faults = (resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults0) / a.steps
    cpu = {f"{k} CPU": (cpu_s(t) - cpu0[k]) / a.steps * 1e6 for k, t in tids.items()}
    if rank == 0:
        us = {k: v / a.steps * 1e6 for k, v in spent.items()} if a.timers else {}
        if a.timers:
            us.update(cpu)
        if mon is not None and a.timers:
            us["sentinel (agent's own median)"] = mon.schedule.cost.sentinel_s * 1e6
        q.put((a.steps / dt, dt / a.steps * 1e6, us, faults))
    if mon is not None:
        mon.close()
    del model, mon  # the DDP freed while its group is registered (see train_rank in commands/demo/run.py)
    gc.collect()
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)} (first: the base)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=2000, help="timed steps per run")
    p.add_argument("--width", type=int, default=256, help="hidden width of the 2-layer MLP")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--timers", action="store_true", help="time the agent's parts on rank 0 (adds a little)")
    p.add_argument("--port", type=int, default=29650, help="first gloo rendezvous port on 127.0.0.1 (one per run)")
    p.add_argument("--endpoint", default="", help="a running aggregator's ZeroMQ endpoint for the agent variants "
                   "(default: nowhere; the sender then builds no report)")
    p.add_argument("--malloc", choices=("fixed", "glibc"), default="fixed",
                   help="fixed (default): every run with glibc's heap trimming and mmap threshold held "
                   "(bench/faultjob.py's MALLOC_FIXED), so a ratio is the agent's cost, not which of glibc's "
                   "trim regimes a run fell into; glibc: its defaults")
    p.add_argument("--json", default="", help="also write the results here")
    a = p.parse_args()
    variants = a.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        p.error(f"--variants: unknown {sorted(unknown)}")
    import os

    import torch.multiprocessing as mp

    sys.path.insert(0, str(ROOT))
    from bench.faultjob import MALLOC_FIXED

    if a.malloc == "fixed":
        os.environ.update(MALLOC_FIXED)  # read by each spawned rank's C library at its start

    ctx = mp.get_context("spawn")
    runs: dict[str, list] = {v: [] for v in variants}
    port = a.port
    for r in range(a.rounds):
        for v in variants if r % 2 == 0 else variants[::-1]:
            q = ctx.Queue()
            procs = [ctx.Process(target=worker, args=(k, v, a, port, q)) for k in range(2)]
            port += 1
            for pr in procs:
                pr.start()
            got = q.get(timeout=600)
            for pr in procs:
                pr.join(60)
            runs[v].append(got)
            print(f"round {r} {v}: {got[0]:.1f} steps/s, {got[3]:.0f} page faults/step" + "".join(f", {k} {x:.0f} us" for k, x in got[2].items()),
                  file=sys.stderr, flush=True)
    base = statistics.median(x[0] for x in runs[variants[0]])
    print(f"\n2-rank gloo DDP, MLP 64-{a.width}-8, batch {a.batch}, {a.steps} steps per run, {a.rounds} rounds, "
          f"allocator {a.malloc}\n")
    print("| variant | steps/s (median) | ratio | runs | page faults/step (rank 0) |")
    print("|---|---|---|---|---|")
    rows = []
    for v in variants:
        med = statistics.median(x[0] for x in runs[v])
        rows.append({"variant": v, "steps_per_s": med, "ratio": med / base, "runs": runs[v], "malloc": a.malloc})
        print(f"| {v} | {med:.1f} | {med / base:.3f} | {', '.join(f'{x[0]:.0f}' for x in runs[v])} "
              f"| {', '.join(f'{x[3]:.0f}' for x in runs[v])} |")
    for v in variants:
        for name in sorted({k for x in runs[v] for k in x[2]}):
            vals = [x[2][name] for x in runs[v] if name in x[2]]
            print(f"{v}: {name} {statistics.median(vals):.0f} us/step (of {statistics.median(x[1] for x in runs[v]):.0f})")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
