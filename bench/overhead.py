#!/usr/bin/env python
"""Training-step overhead of the gradwatch agent, measured side by side in one process.

Variants (each trains its own copy of the model, same initial weights, same batches):

  none         no agent: the plain training step
  budget       gradwatch agent with its defaults: the probe interval chosen within a 1% budget
  every10      gradwatch agent probing every 10th step (sentinel every step)
  every1       gradwatch agent probing every step
  anchor       "tutorial hooks": a forward hook on every leaf module computing mean, std and zero
               ratio with .item(), and a full backward hook computing the output-gradient norm with
               .item(), every step (what a hand-written monitor typically does)
  tensorboard  SummaryWriter.add_histogram of every parameter and gradient every 10th step
  wandb        wandb.watch(model, log="all", log_freq=10), offline
  none+busy, budget+busy
               the same while a second process keeps the other core busy (ratios to none+busy)

Models:

  transformer  gradwatch.commands.demo.model.GPT sized so one step is ~0.5 s on one CPU thread
  cnn          a small CNN on scikit-learn's bundled digits (8x8 images), ~5 ms steps, where
               per-call fixed costs dominate as they do on a GPU

Measurement: the variants run in blocks of --steps-per-block optimizer steps, interleaved
round-robin (the order rotates every round), for --rounds rounds after a warm-up. A block's time
is wall time from before its first step to after its last (with torch.cuda.synchronize() at those
two boundaries only, never inside a step) divided by its steps; a block always holds a whole number
of default-cadence periods (a multiple of 10 steps) so every agent block holds the same number of
probes. A variant's figure is the median of its block times; "ratio" is that median over the no-agent
median, "paired" the median over rounds of (variant block / no-agent block of the same round).

The agents report to a real aggregator process on loopback (--sink: an in-process ROUTER socket).
See bench/README.md.

    .venv/bin/python bench/overhead.py                      # full run, ~8.5 minutes
    .venv/bin/python bench/overhead.py --quick              # smoke test, < 1 minute
    .venv/bin/python bench/overhead.py --models cnn --json bench/results/cnn.json
    .venv/bin/python bench/overhead.py --profile cnn:every1 # cProfile of one variant
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import statistics
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
import zmq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import harness  # noqa: E402
from gradwatch import agent as gw  # noqa: E402
from gradwatch import wire  # noqa: E402

VARIANTS = ("none", "budget", "every10", "every1", "anchor", "tensorboard", "wandb", "none+busy", "budget+busy")
ALL_VARIANTS = ("none", "budget", "guard", *VARIANTS[2:])  # guard: by --variants only
LABELS = {
    "none": "no agent",
    "budget": "agent, budget 1% (default)",
    "guard": "agent, budget 1%, nan_guard on",
    "every10": "agent every=10",
    "every1": "agent every=1",
    "anchor": "tutorial hooks (anchor)",
    "tensorboard": "TensorBoard histograms /10",
    "wandb": "wandb.watch all /10 (offline)",
    "none+busy": "no agent, other core busy",
    "budget+busy": "agent budget, other core busy",
}
BUSY = "+busy"  # variants run while a second process keeps the other core busy; their base is none+busy
# From the issue: (bound, kind). "max" is a target the agent must meet.
TARGETS = {
    "transformer": {"budget": (1.01, "max"), "budget+busy": (1.01, "max"), "every1": (1.10, "max")},
    "cnn": {"budget": (1.01, "max"), "budget+busy": (1.01, "max"), "every1": (1.30, "max")},
}
CADENCE = 10  # the agent's default `every`; blocks are a multiple of it

# Full-run defaults per model: (rounds, steps per block). Quick mode: see QUICK.
DEFAULTS = {"transformer": (12, 10), "cnn": (60, 100)}
QUICK = {"transformer": (2, 10), "cnn": (4, 50)}


# --------------------------------------------------------------------------------------------
# The endpoint: a real ROUTER socket (as the aggregator's) drained by a background thread.
# --------------------------------------------------------------------------------------------


class Sink:
    """Binds a ZeroMQ ROUTER socket (as the aggregator's) on 127.0.0.1 (random port) and drains it in a thread."""

    def __init__(self, keep: int = 64):
        self._ctx = zmq.Context(io_threads=1)
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.messages = 0
        self.bytes = 0
        self.samples: list[bytes] = []  # first `keep` frames and the most recent ones, decoded at the end
        self._keep = keep
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-sink", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            while True:
                try:
                    frame = self._sock.recv_multipart(zmq.NOBLOCK)[-1]  # without the agent's routing id
                except zmq.Again:
                    break
                self.messages += 1
                self.bytes += len(frame)
                if len(self.samples) < self._keep:
                    self.samples.append(frame)
                else:
                    self.samples[self._keep // 2 + self.messages % (self._keep // 2)] = frame

    def close(self) -> dict:
        time.sleep(0.3)  # let the agents' final flushes land
        self._stop.set()
        self._thread.join(2.0)
        self._sock.close(linger=0)
        self._ctx.term()
        kinds: dict[str, int] = {}
        for f in self.samples:
            try:
                k = type(wire.decode(f)).__name__.lower()
            except Exception as e:  # reports may need schema sizes; record what failed
                k = f"undecodable:{type(e).__name__}"
            kinds[k] = kinds.get(k, 0) + 1
        return {"endpoint": self.endpoint, "messages": self.messages, "bytes": self.bytes, "sample_kinds": kinds}


# --------------------------------------------------------------------------------------------
# The anchor: what a hand-written "tutorial" monitor does.
# --------------------------------------------------------------------------------------------


class AggregatorProcess(harness.AggregatorProcess):
    """A real aggregator (``python -m gradwatch.aggregator``) in another process on loopback; the
    agents report to it as in production. :meth:`close` reads its message counters from /metrics."""

    def __init__(self):
        os.makedirs(LOGDIR, exist_ok=True)
        try:
            super().__init__(log=os.path.join(LOGDIR, "aggregator.log"))
        except RuntimeError as e:
            raise SystemExit(str(e)) from None

    def close(self) -> dict:
        time.sleep(0.5)  # let the agents' final flushes land
        received = {}
        for line in self.get("/metrics").splitlines():
            if line.startswith("gradwatch_messages_received_total{"):
                kind = line.split('kind="')[1].split('"')[0] if 'kind="' in line else "?"
                received[kind] = float(line.rsplit(" ", 1)[1])
        self.stop()
        return {"endpoint": self.endpoint, "received": received, "messages": int(sum(received.values()))}


class TensorBoardHistograms:
    """TensorBoard's usual monitoring: every ``every``-th optimizer step, a histogram of every
    parameter and of its gradient (``SummaryWriter.add_histogram``), written to a temporary logdir."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, logdir: str, every: int = 10):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(logdir)
        self.model, self.every, self.i = model, every, 0
        self.handle = opt.register_step_pre_hook(self._log)

    def _log(self, opt, args, kwargs) -> None:
        if self.i % self.every == 0:
            for name, p in self.model.named_parameters():
                self.writer.add_histogram(name, p.detach(), self.i)
                if p.grad is not None:
                    self.writer.add_histogram(name + ".grad", p.grad, self.i)
        self.i += 1

    def close(self) -> None:
        self.handle.remove()
        self.writer.close()


class WandbWatch:
    """``wandb.watch(model, log="all", log_freq=10)`` in an offline run (WANDB_MODE=offline): parameter
    and gradient histograms every 10th batch; the training step also calls ``wandb.log`` with the
    loss every step, as wandb's own examples do (without it watch's histograms are never committed)."""

    run = None  # one wandb run per process

    def __init__(self, model: nn.Module, logdir: str):
        import wandb

        os.environ.setdefault("WANDB_MODE", "offline")
        os.environ.setdefault("WANDB_SILENT", "true")
        if WandbWatch.run is None:
            WandbWatch.run = wandb.init(project="gradwatch-bench", dir=logdir, mode="offline")
        self.wandb = wandb
        wandb.watch(model, log="all", log_freq=10)
        self.model = model

    def log(self, loss: torch.Tensor) -> None:
        self.wandb.log({"loss": loss.item()})

    def close(self) -> None:
        try:
            self.wandb.unwatch(self.model)
        except Exception:
            pass


class Busy:
    """A second process that keeps one core busy (as data-loader workers do), started paused:
    :meth:`on` and :meth:`off` resume and pause it (SIGCONT / SIGSTOP) around a block."""

    def __init__(self):
        import signal

        self._signal = signal
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        self.off()

    def on(self) -> None:
        self.proc.send_signal(self._signal.SIGCONT)

    def off(self) -> None:
        self.proc.send_signal(self._signal.SIGSTOP)

    def close(self) -> None:
        self.on()
        self.proc.kill()
        self.proc.wait()


class TutorialHooks:
    """Forward hook per leaf module (mean, std, zero ratio via .item()) and a full backward hook
    per leaf module (output-gradient norm via .item()), on every step."""

    def __init__(self, model: nn.Module):
        self.act: dict[str, tuple[float, float, float]] = {}
        self.grad: dict[str, float] = {}
        self.handles = []
        for name, m in model.named_modules():
            if name and next(m.children(), None) is None:
                self.handles.append(m.register_forward_hook(self._forward(name)))
                self.handles.append(m.register_full_backward_hook(self._backward(name)))

    def _forward(self, name: str):
        def hook(module, args, out):
            if isinstance(out, torch.Tensor) and out.is_floating_point():
                o = out.detach()
                self.act[name] = (o.mean().item(), o.std().item(), (o == 0).float().mean().item())

        return hook

    def _backward(self, name: str):
        def hook(module, grad_input, grad_output):
            g = grad_output[0]
            if g is not None:
                self.grad[name] = g.norm().item()

        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


# --------------------------------------------------------------------------------------------
# Models, data and the training step.
# --------------------------------------------------------------------------------------------


@dataclass
class Workload:
    name: str
    describe: str
    build: Callable[[], nn.Module]
    optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    batches: list  # [(x, y)] on the device; step i uses batches[i % len]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def transformer_workload(device: torch.device, quick: bool) -> Workload:
    from gradwatch.commands.demo.model import GPT, GPTConfig, batch, stdlib_text

    cfg = GPTConfig(context=128, width=256, layers=4, heads=8)
    size = 4 if quick else 16  # quick: a quarter of the batch, only to keep the smoke test short
    text = stdlib_text()
    batches = [tuple(t.to(device) for t in batch(text, 0, 0, i, size, cfg.context)) for i in range(8)]
    n = sum(p.numel() for p in GPT(cfg).parameters())
    return Workload(
        name="transformer",
        describe=(
            f"gradwatch.commands.demo.model.GPT width={cfg.width} layers={cfg.layers} heads={cfg.heads} "
            f"context={cfg.context} batch={size} ({n / 1e6:.2f}M params), AdamW lr=3e-4"
        ),
        build=lambda: GPT(cfg),
        optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=3e-4),
        batches=batches,
        loss=lambda logits, y: F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)),
    )


class DigitsCNN(nn.Sequential):
    def __init__(self, c1: int = 24, c2: int = 32, hidden: int = 128):
        super().__init__(
            nn.Conv2d(1, c1, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(c1, c2, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(c2 * 4 * 4, hidden),
            nn.ReLU(),
            nn.Linear(hidden, 10),
        )


def cnn_workload(device: torch.device, quick: bool) -> Workload:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    size = 128
    batches = [
        (x[i : i + size].to(device), y[i : i + size].to(device)) for i in range(0, len(x) - size + 1, size)
    ]
    n = sum(p.numel() for p in DigitsCNN().parameters())
    return Workload(
        name="cnn",
        describe=(
            f"CNN conv(1->24,3x3) relu conv(24->32,3x3) relu maxpool2 flatten fc(512->128) relu fc(128->10), "
            f"{len(list(DigitsCNN().modules())) - 1} leaf modules, {n / 1e3:.1f}k params, "
            f"sklearn digits 8x8, batch={size}, Adam lr=1e-3"
        ),
        build=DigitsCNN,
        optimizer=lambda m: torch.optim.Adam(m.parameters(), lr=1e-3),
        batches=batches,
        loss=F.cross_entropy,
    )


WORKLOADS = {"transformer": transformer_workload, "cnn": cnn_workload}


@dataclass
class Runner:
    """One variant: its own model, optimizer and attachment."""

    variant: str
    model: nn.Module
    opt: torch.optim.Optimizer
    wl: Workload
    attachment: object = None
    i: int = 0
    blocks: list = field(default_factory=list)

    def step(self) -> None:
        x, y = self.wl.batches[self.i % len(self.wl.batches)]
        self.i += 1
        self.opt.zero_grad(set_to_none=True)
        loss = self.wl.loss(self.model(x), y)
        loss.backward()
        self.opt.step()
        if isinstance(self.attachment, WandbWatch):
            self.attachment.log(loss)

    def settle(self, timeout: float = 2.0) -> None:
        """Outside timing: let the agent's sender thread drain this block's reports, so one
        variant's background work does not spill into the next variant's block."""
        sender = getattr(self.attachment, "sender", None)
        q = getattr(sender, "_queue", None)
        if q is None:
            return
        deadline = time.perf_counter() + timeout
        while q and time.perf_counter() < deadline:
            time.sleep(0.001)

    def close(self) -> dict:
        a = self.attachment
        info = {}
        if isinstance(a, TutorialHooks):
            info = {"hooks": len(a.handles)}
            a.close()
        elif isinstance(a, (TensorBoardHistograms, WandbWatch)):
            a.close()
        elif a is not None:
            a.close()  # first: the final flush and heartbeat count as sent
            info = {
                "steps": a.step,
                "probes": a.probes,
                "errors": a.errors,
                "not_instrumented": list(a.not_instrumented),
                "sender_sent": a.sender.sent,
                "sender_drops": a.sender.drops,
                "sender_errors": a.sender.errors,
                "fused_kernel": a.reducer.fused_ready,
                "probe_interval": a.schedule.interval,
                "agent_cost": a.schedule.fraction,
                "over_budget": a.schedule.over_budget,
            }
        return info


def make_runner(variant: str, wl: Workload, device: torch.device, endpoint: str, agent_opts: Optional[dict] = None) -> Runner:
    torch.manual_seed(0)
    model = wl.build().to(device)
    opt = wl.optimizer(model)
    r = Runner(variant, model, opt, wl)
    if variant in ("every10", "every1", "budget", "guard", "budget+busy"):
        opts = dict(agent_opts or {})
        if variant.startswith("every"):
            opts["every"] = 10 if variant == "every10" else 1
        if variant == "guard":
            opts["nan_guard"] = "on"
        job = f"bench-{wl.name}-{variant.replace('+', '-')}"
        r.attachment = gw.attach(model, opt, endpoint=endpoint, job=job, **opts)
        if not getattr(r.attachment, "active", False):
            raise SystemExit(f"agent did not attach for {wl.name}/{variant}")
    elif variant == "anchor":
        r.attachment = TutorialHooks(model)
    elif variant == "tensorboard":
        r.attachment = TensorBoardHistograms(model, opt, os.path.join(LOGDIR, f"tb-{wl.name}"))
    elif variant == "wandb":
        r.attachment = WandbWatch(model, LOGDIR)
    return r


LOGDIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "logs")  # git-ignored
BUSY_PROC: Optional[Busy] = None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_block(r: Runner, steps: int, device: torch.device) -> tuple[float, float, float]:
    """Seconds per step of one block: (wall, training-thread CPU, whole-process CPU)."""
    busy = r.variant.endswith(BUSY) and BUSY_PROC is not None
    if busy:
        BUSY_PROC.on()
        time.sleep(0.05)  # let it take its core
    try:
        return _time_block(r, steps, device)
    finally:
        if busy:
            BUSY_PROC.off()


def _time_block(r: Runner, steps: int, device: torch.device) -> tuple[float, float, float]:
    sync(device)
    c0, p0, t0 = time.thread_time(), time.process_time(), time.perf_counter()
    for _ in range(steps):
        r.step()
    sync(device)
    t1, c1, p1 = time.perf_counter(), time.thread_time(), time.process_time()
    return (t1 - t0) / steps, (c1 - c0) / steps, (p1 - p0) / steps


# --------------------------------------------------------------------------------------------
# Measurement and report.
# --------------------------------------------------------------------------------------------


def quantiles(xs: list[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def wait_compile(timeout: float) -> bool:
    """Wait for the agent's background compile threads; True if there were any."""
    deadline = time.perf_counter() + timeout
    waited = False
    while any(t.name == "gradwatch-compile" and t.is_alive() for t in threading.enumerate()):
        waited = True
        if time.perf_counter() > deadline:
            print(f"  warning: the agent's fused kernel is still compiling after {timeout:.0f}s", flush=True)
            break
        time.sleep(0.2)
    return waited


def measure(
    wl: Workload, device: torch.device, rounds: int, spb: int, sink: Sink, compile_wait: float, agent_opts: dict
) -> dict:
    variants = VARIANTS
    runners = [make_runner(v, wl, device, sink.endpoint, agent_opts) for v in variants]
    # Warm-up: one block per variant (allocator, autograd graph caches, the agent's first probe
    # and schema, lazy imports). The agent may compile its fused statistics kernel in a
    # background thread (CUDA by default, or fused=on); wait for that, so compilation never
    # lands inside a measured block, then warm up once more on the compiled kernel.
    for r in runners:
        time_block(r, spb, device)
        r.settle()
    if wait_compile(compile_wait):
        ready = [getattr(r.attachment, "reducer", None) for r in runners]
        print(f"  fused kernel ready: {[red.fused_ready for red in ready if red is not None]}", flush=True)
        for r in runners:
            time_block(r, spb, device)
            r.settle()
    t_start = time.perf_counter()
    load0 = os.getloadavg()[0]
    for rnd in range(rounds):
        order = variants[rnd % len(variants) :] + variants[: rnd % len(variants)]
        for v in order:
            r = runners[variants.index(v)]
            r.blocks.append(time_block(r, spb, device))
            r.settle()
        done = rnd + 1
        if done == rounds or done % max(1, rounds // 4) == 0:
            el = time.perf_counter() - t_start
            print(f"  round {done}/{rounds}  ({el:.0f}s, load average {os.getloadavg()[0]:.2f})", flush=True)
    col = lambda r, k: [b[k] for b in r.blocks]  # noqa: E731  k: 0 wall, 1 thread CPU, 2 process CPU
    bases = {v: runners[variants.index("none+busy" if v.endswith(BUSY) and "none+busy" in variants else "none")] for v in variants}
    out = {
        "model": wl.name, "describe": wl.describe, "rounds": rounds, "steps_per_block": spb,
        "loadavg_1m_start_end": [load0, os.getloadavg()[0]], "variants": {},
    }
    for r in runners:
        base_r = bases[r.variant]
        base_blocks = col(base_r, 0)
        base = statistics.median(base_blocks)
        base_cpu = statistics.median(col(base_r, 1))
        base_proc = statistics.median(col(base_r, 2))
        wall = col(r, 0)
        med = statistics.median(wall)
        q1, q3 = quantiles(wall)
        paired = [b / a for a, b in zip(base_blocks, wall)]
        pq1, pq3 = quantiles(paired)
        target = TARGETS[wl.name].get(r.variant)
        ratio = med / base
        cpu = statistics.median(col(r, 1))
        proc = statistics.median(col(r, 2))
        entry = {
            "label": LABELS[r.variant],
            "median_step_s": med,
            "q1_step_s": q1,
            "q3_step_s": q3,
            "ratio": ratio,
            "paired_ratio": statistics.median(paired),
            "paired_q1": pq1,
            "paired_q3": pq3,
            "paired_min": min(paired),
            "paired_max": max(paired),
            "base": base_r.variant,
            "median_thread_cpu_s": cpu,
            "thread_cpu_ratio": cpu / base_cpu,
            "median_process_cpu_s": proc,
            "process_cpu_ratio": proc / base_proc,
            "blocks_wall_s": wall,
            "blocks_thread_cpu_s": col(r, 1),
            "blocks_process_cpu_s": col(r, 2),
        }
        if target is not None:
            entry["target"] = target[0]
            entry["target_kind"] = target[1]
            if target[1] == "max":
                entry["meets_target"] = ratio <= target[0]
        entry["agent"] = r.close()
        out["variants"][r.variant] = entry
    out["probe_read"] = probe_read_ratio(wl, device)
    return out


def probe_read_ratio(wl: Workload, device: torch.device, reps: int = 20) -> dict:
    """The probe's per-element cost against one plain read of the same bytes.

    Captures every leaf module's floating output of one training forward pass, then times the
    agent's statistics kernel (``Reducer.moments``: mean, variance, min, max, zero and non-finite
    counts) over all of them against ``torch.sum`` of each (one read of the bytes, one kernel per
    tensor). Best of ``reps`` passes each. Returns seconds and the ratio."""
    from gradwatch.agent.stats import Reducer

    torch.manual_seed(0)
    model = wl.build().to(device)
    outs: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda m, a, o: outs.append(o.detach()) if isinstance(o, torch.Tensor) and o.is_floating_point() else None)
             for n, m in model.named_modules() if n and next(m.children(), None) is None]
    x, _ = wl.batches[0]
    model(x)
    for h in hooks:
        h.remove()
    red = Reducer("off")

    def best(fn) -> float:
        times = []
        for _ in range(reps):
            sync(device)
            t = time.perf_counter()
            for o in outs:
                fn(o)
            sync(device)
            times.append(time.perf_counter() - t)
        return min(times)

    best(red.moments), best(torch.sum)  # warm-up
    probe, read = best(red.moments), best(torch.sum)
    elements = sum(o.numel() for o in outs)
    out = {"tensors": len(outs), "elements": elements, "moments_s": probe, "read_s": read, "ratio": probe / read}
    # the fused kernel (attach(fused="on"); the default for CUDA models), where torch.compile works
    fused = Reducer("on")
    wait_compile(300.0)
    if fused.fused_ready:
        best(fused.moments)
        out["fused_s"] = best(fused.moments)
        out["fused_ratio"] = out["fused_s"] / read
    return out


def print_table(res: dict, device: str, threads: int) -> None:
    print()
    print(f"== {res['model']}: {res['describe']}")
    print(
        f"   device={device} threads={threads}; {res['rounds']} rounds x {res['steps_per_block']} steps per block "
        f"per variant, interleaved round-robin; median of block means; 1-min load average "
        f"{res['loadavg_1m_start_end'][0]:.2f} -> {res['loadavg_1m_start_end'][1]:.2f} on {os.cpu_count()} CPUs"
    )
    print("   ratio = median wall / no-agent median wall; paired = median over rounds of per-round wall ratios;")
    print("   thr-cpu / proc-cpu = the same ratio of CPU time (training thread / whole process), robust to other load")
    hdr = (
        f"   {'variant':<30} {'median ms':>10} {'IQR ms':>17} {'ratio':>7} {'paired':>7} {'rounds':>11} {'thr-cpu':>7} {'proc-cpu':>8}"
        f"  {'target':<16} verdict"
    )
    print(hdr)
    print("   " + "-" * (len(hdr) - 3))
    for v, e in res["variants"].items():
        iqr = f"{e['q1_step_s'] * 1e3:.2f}-{e['q3_step_s'] * 1e3:.2f}"
        tgt, verdict = "-", ""
        if "target" in e:
            if e["target_kind"] == "max":
                tgt = f"<= {e['target']:.2f}x"
                verdict = "meets" if e["meets_target"] else "MISSES"
            else:
                tgt = f"~{e['target']:.3f}x expected"
        print(
            f"   {e['label']:<30} {e['median_step_s'] * 1e3:>10.2f} {iqr:>17} {e['ratio']:>6.3f}x {e['paired_ratio']:>6.3f}x"
            f" {e['paired_min']:>5.2f}-{e['paired_max']:<5.2f}"
            f" {e['thread_cpu_ratio']:>6.3f}x {e['process_cpu_ratio']:>7.3f}x  {tgt:<16} {verdict}"
        )
    pr = res.get("probe_read")
    if pr:
        print(f"   probe statistics kernel vs one plain read (torch.sum) of the same {pr['tensors']} activations "
              f"({pr['elements'] / 1e6:.2f}M elements): {pr['moments_s'] * 1e3:.3f} ms vs {pr['read_s'] * 1e3:.3f} ms, "
              f"ratio {pr['ratio']:.1f}x (target <= 3x)"
              + (f"; fused kernel {pr['fused_s'] * 1e3:.3f} ms, {pr['fused_ratio']:.1f}x" if "fused_ratio" in pr else "; no fused kernel"))
    for v, e in res["variants"].items():
        a = e["agent"]
        if "probes" in a:
            print(
                f"   {LABELS[v]}: {a['steps']} steps, {a['probes']} probes, {a['sender_sent']} messages sent, "
                f"{a['sender_drops']} dropped, {a['errors'] + a['sender_errors']} errors, probe interval "
                f"{a['probe_interval']}, measured cost {a['agent_cost']:.2%}" + (" (over budget)" if a["over_budget"] else "")
                + (f", not instrumented: {a['not_instrumented']}" if a["not_instrumented"] else "")
            )


def git_commit() -> str:
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        sha = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "agent"], capture_output=True, text=True).stdout.strip()
        return sha + ("+dirty-agent" if dirty else "")
    except Exception:
        return "?"


# --------------------------------------------------------------------------------------------
# Profiling one variant.
# --------------------------------------------------------------------------------------------


def profile(spec: str, device: torch.device, steps: int, quick: bool, sink: Sink, top: int, agent_opts: dict) -> None:
    model_name, _, variant = spec.partition(":")
    if model_name not in WORKLOADS or variant not in VARIANTS:
        raise SystemExit(f"--profile wants MODEL:VARIANT with MODEL in {list(WORKLOADS)} and VARIANT in {VARIANTS}")
    wl = WORKLOADS[model_name](device, quick)
    r = make_runner(variant, wl, device, sink.endpoint, agent_opts)
    for _ in range(max(CADENCE * 2, 20)):
        r.step()
    if wait_compile(300.0):
        for _ in range(max(CADENCE * 2, 20)):
            r.step()
    r.settle()
    sync(device)
    sender = getattr(r.attachment, "sender", None)
    acc = {"n": 0, "wall": 0.0, "cpu": 0.0}
    if sender is not None:  # time the sender thread's work per message (finalise, encode, send)
        orig = sender._send

        def timed(make):
            t, c = time.perf_counter(), time.thread_time()
            try:
                return orig(make)
            finally:
                acc["wall"] += time.perf_counter() - t
                acc["cpu"] += time.thread_time() - c
                acc["n"] += 1

        sender._send = timed
    print(f"== cProfile: {model_name}/{variant}, {steps} steps (training thread only)")
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    for _ in range(steps):
        r.step()
    sync(device)
    pr.disable()
    wall = time.perf_counter() - t0
    print(f"   {wall / steps * 1e3:.3f} ms/step under cProfile")
    r.settle()
    if acc["n"]:
        print(
            f"   sender thread: {acc['n']} messages, {acc['cpu'] / acc['n'] * 1e3:.3f} ms CPU "
            f"({acc['wall'] / acc['n'] * 1e3:.3f} ms wall) per message to build, encode and send"
        )
    s = io.StringIO()
    st = pstats.Stats(pr, stream=s).strip_dirs()
    st.sort_stats("tottime").print_stats(top)
    st.sort_stats("cumulative").print_stats(top)
    print(s.getvalue())
    print(f"== torch.profiler: {model_name}/{variant}, {min(steps, 50)} steps")
    from torch.profiler import ProfilerActivity, profile as tprofile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with tprofile(activities=acts) as prof:
        for _ in range(min(steps, 50)):
            r.step()
        sync(device)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))
    r.close()


# --------------------------------------------------------------------------------------------


def parse_per_model(text: Optional[str], models: list[str], what: str) -> dict[str, Optional[int]]:
    if text is None:
        return {m: None for m in models}
    vals = [int(v) for v in text.split(",")]
    if len(vals) == 1:
        vals = vals * len(models)
    if len(vals) != len(models):
        raise SystemExit(f"--{what}: give one value or one per model ({len(models)})")
    return dict(zip(models, vals))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    p.add_argument("--models", default="transformer,cnn", help="comma list of: transformer, cnn")
    p.add_argument("--rounds", help="rounds per model: one value or a comma list per model (default 12,60; quick 2,4)")
    p.add_argument(
        "--steps-per-block",
        help="steps per block: one value or a comma list per model, rounded up to a multiple of 10 (default 10,100; quick 10,50)",
    )
    p.add_argument("--quick", action="store_true", help="short smoke-test run (< 1 minute); not the figures")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    p.add_argument("--compile-wait", type=float, default=300.0, help="seconds to wait for the agent's background kernel compile")
    p.add_argument("--profile", metavar="MODEL:VARIANT", help="instead of the benchmark, profile one variant (e.g. cnn:every1)")
    p.add_argument("--profile-steps", type=int, default=500, help="steps profiled with --profile (default 500)")
    p.add_argument("--top", type=int, default=30, help="rows of profile output")
    p.add_argument(
        "--agent-opt", action="append", default=[], metavar="KEY=VALUE",
        help="extra gradwatch.agent.attach setting for both agent variants, e.g. fused=on (repeatable)",
    )
    p.add_argument("--variants", help=f"comma list, a subset of {','.join(ALL_VARIANTS)} (default: all; 'none' is always run)")
    p.add_argument("--sink", action="store_true", help="report to an in-process ROUTER socket instead of a real aggregator process")
    args = p.parse_args(argv)
    agent_opts = dict(kv.split("=", 1) for kv in args.agent_opt)
    global VARIANTS, BUSY_PROC
    if args.variants:
        want = [v.strip() for v in args.variants.split(",") if v.strip()]
        bad = [v for v in want if v not in ALL_VARIANTS]
        if bad:
            raise SystemExit(f"unknown variants {bad}; choose from {ALL_VARIANTS}")
        VARIANTS = tuple(v for v in ALL_VARIANTS if v in want or v == "none" or (v == "none+busy" and any(w.endswith(BUSY) for w in want)))
    for v, mod in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
        if v in VARIANTS:
            try:
                __import__(mod)
            except ImportError:
                print(f"  {mod} is not installed: variant {v} left out (pip install {mod})")
                VARIANTS = tuple(x for x in VARIANTS if x != v)
    if any(v.endswith(BUSY) for v in VARIANTS) and not args.profile:
        BUSY_PROC = Busy()

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch.cuda.is_available() is false")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in models:
        if m not in WORKLOADS:
            raise SystemExit(f"unknown model {m!r}; choose from {list(WORKLOADS)}")
    warnings.simplefilter("default", RuntimeWarning)  # agent failures must be visible
    # the anchor's full backward hook on an Embedding (integer input) warns once; it is expected
    warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with respect to module outputs")

    sink = Sink() if args.sink or args.profile else AggregatorProcess()
    if args.profile:
        try:
            profile(args.profile, device, args.profile_steps, args.quick, sink, args.top, agent_opts)
        finally:
            print(f"   sink: {sink.close()}")
        return 0

    rounds = parse_per_model(args.rounds, models, "rounds")
    spb = parse_per_model(args.steps_per_block, models, "steps-per-block")
    table = QUICK if args.quick else DEFAULTS
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "device": str(device) + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        "commit": git_commit(),
        "quick": args.quick,
        "agent_opts": agent_opts,
    }
    print(f"gradwatch overhead bench: torch {env['torch']}, {env['device']}, {env['threads']} thread(s), commit {env['commit']}")
    print(f"agents report to {'an in-process ROUTER socket' if isinstance(sink, Sink) else 'a real aggregator process'} at {sink.endpoint}"
          + (f"; agent settings {agent_opts}" if agent_opts else ""))
    if args.quick:
        print("quick mode: few rounds and a smaller transformer batch; a smoke test, not the figures")
    results = []
    t0 = time.perf_counter()
    try:
        for m in models:
            n_rounds = rounds[m] or table[m][0]
            n_spb = spb[m] or table[m][1]
            if n_spb % CADENCE:
                n_spb += CADENCE - n_spb % CADENCE
                print(f"  steps per block rounded up to {n_spb} (a multiple of the default cadence {CADENCE})")
            wl = WORKLOADS[m](device, args.quick)
            print(f"\n[{m}] {wl.describe}\n  warm-up, then {n_rounds} rounds x {len(VARIANTS)} variants x {n_spb} steps", flush=True)
            res = measure(wl, device, n_rounds, n_spb, sink, args.compile_wait, agent_opts)
            results.append(res)
            print_table(res, env["device"], env["threads"])
    finally:
        sink_info = sink.close()
        if BUSY_PROC is not None:
            BUSY_PROC.close()
    total = time.perf_counter() - t0
    sent = sum(e["agent"].get("sender_sent", 0) for r in results for e in r["variants"].values())
    print(f"\nreceiver: {sink_info['messages']} messages received of {sent} sent; {sink_info}; total {total:.0f}s")
    print("targets from the issue: budget mode <=1.01x on both models, with and without contention; every step "
          "<=1.10x (transformer), <=1.30x (cnn)")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"env": env, "sink": sink_info, "wall_s": total, "results": results}, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
