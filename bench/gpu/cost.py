"""Part 5, overhead on the device: step time with CUDA events and peak GPU memory, with and without the agent.

Two models: the demo's GPT at GPT-2 small's size (width 768, 12 blocks, 12 heads, context 1024,
GPT-2's 50,257-token vocabulary, the head tied to the token embedding: 124M parameters), its
batch chosen at start so a step takes about 0.1 s (the low end of 100-300 ms, to fit the run's
time; at most 32 sequences of 1024 tokens), and a small one (width 256,
4 blocks, context 256, byte vocabulary) batched to about 10 ms; bf16 autocast, AdamW. On the CPU
one tiny GPT in fp32 stands in (the code path kept alive; the figures are not the device's).

Variants, as bench/overhead.py defines them, each training its own copy of the model (same initial
weights, same batches): ``none``; ``budget`` (``attach`` with its defaults: probe interval within a
1 % budget, the NaN guard ``auto``, the fused kernel ``auto``); ``every1`` (a probe every step);
``anchor`` (bench/overhead.py's ``TutorialHooks``: per leaf module mean, std, zero ratio and the
output-gradient norm with ``.item()``, every step); ``watch`` (:class:`WatchLike`: what
``wandb.watch(log="all", log_freq=10)`` computes, wandb itself not being installed on the device).
The agents report to a real ZeroMQ ROUTER socket in this process (bench/overhead.py's ``Sink``).

Time: the variants run in blocks of ``steps`` optimizer steps, round-robin with the order rotated
every round, after a warm-up (and the agent's background kernel compile; the budget variants run
until the NaN guard's ``auto`` has judged itself and the probe interval is measured); a block is
timed with CUDA events from before its first step to after its last (``torch.cuda.synchronize()``
before it, never inside). Per variant: the median block time per step, its ratio to ``none``'s
median, and the median of per-round paired ratios. Memory: one model at a time (the others freed),
``torch.cuda.max_memory_allocated()`` over a few steps after a warm-up, for ``none``, ``budget``
(probed when its interval falls within them) and ``every1`` (every step probed). Targets: ``budget`` <= 1.005x, ``every1`` <= 1.05x, peak
memory <= 1.01x.
"""

from __future__ import annotations

import gc
import statistics
import time
import warnings

from .common import NEEDS_CUDA, Context, Part, autocast, compile_threads_done, gpt, lm_loss, n_params, say, settle, \
    token_batch

TITLE = "overhead on the device: step time (CUDA events) and peak GPU memory, with and without the agent"
VARIANTS = ("none", "budget", "every1", "anchor", "watch")
TARGETS = {"budget": 1.005, "every1": 1.05}
MEM_TARGET = 1.01
MODELS = {
    "cuda": {
        "gpt2-124m": dict(arch=dict(width=768, layers=12, heads=12, context=1024, vocab=50257, tie=True),
                          precision="bf16", target_s=0.10, batch=(8, 4, 32), steps=10, share=0.6, rounds=(3, 10)),
        "small": dict(arch=dict(width=256, layers=4, heads=8, context=256, vocab=256),
                      precision="bf16", target_s=0.010, batch=(16, 4, 512), steps=50, share=1.0, rounds=(3, 15)),
    },
    "cpu": {
        "gpt-tiny": dict(arch=dict(width=64, layers=2, heads=4, context=64, vocab=256), precision="fp32",
                         target_s=None, batch=(8, 8, 8), steps=5, share=1.0, rounds=(2, 2), judge=False),
    },
}
GUARD_JUDGED_STEPS = 48  # budget variants: steps before timing (3 unmeasured + 32 judged unprobed + probes)


class WatchLike:
    """What ``wandb.watch(model, log="all", log_freq=10)`` computes on CUDA, without wandb: every
    ``every``-th optimizer step, for every parameter and every gradient, whether any value is
    finite and whether all are (``.item()`` each), min and max (``.item()``), a 64-bin
    ``torch.histc`` copied to the host; and the loss with ``.item()`` every step (``wandb.log``, as
    wandb's examples call it). wandb takes the gradients in tensor hooks during backward; here they
    are read at the optimizer step: the same reductions and host copies, in one place."""

    def __init__(self, model, opt, every: int = 10, bins: int = 64):
        self.model, self.every, self.bins, self.i = model, every, bins, 0
        self.out: dict = {}
        self.handle = opt.register_step_pre_hook(self._log)

    def _log(self, opt, args, kwargs) -> None:
        if self.i % self.every == 0:
            for name, p in self.model.named_parameters():
                self._stats(name, p.detach())
                if p.grad is not None:
                    self._stats(name + ".grad", p.grad)
        self.i += 1

    def _stats(self, name: str, t) -> None:
        import torch

        flat = t.reshape(-1).float()
        fin = torch.isfinite(flat)
        if not fin.any().item():
            return
        if not fin.all().item():
            flat = flat[fin]
        lo, hi = flat.min().item(), flat.max().item()
        self.out[name] = (flat.histc(bins=self.bins, min=lo, max=hi).cpu().tolist(), lo, hi)

    def log(self, loss) -> None:
        self.out["loss"] = loss.item()

    def close(self) -> None:
        self.handle.remove()


class Runner:
    """One variant: its own model, optimizer and attachment."""

    def __init__(self, variant: str, spec: dict, batches: list, dev, endpoint: str, tag: str, agent: dict | None = None):
        """``agent``: ``attach`` settings for a variant of another name (the budget and every1
        variants bring their own)."""
        import torch

        from gradwatch import agent as gw

        from bench.overhead import TutorialHooks

        self.variant, self.spec, self.batches, self.dev, self.i = variant, spec, batches, dev, 0
        torch.manual_seed(0)
        with torch.device(dev):  # initialised where it trains: GPT-2's 124M parameters in milliseconds
            self.model = gpt(**spec["arch"])
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.mon = self.hooks = self.watch = None
        if variant in ("budget", "every1"):
            agent = {"every": 1} if variant == "every1" else {}
        if agent is not None:
            self.mon = gw.attach(self.model, self.opt, endpoint=endpoint, job=f"cost-{tag}-{variant}", **agent)
            if not isinstance(self.mon, gw.Monitor):
                raise RuntimeError(f"the agent did not attach for {variant}")
        elif variant == "anchor":
            self.hooks = TutorialHooks(self.model)
        elif variant == "watch":
            self.watch = WatchLike(self.model, self.opt)
        self.blocks: list[tuple[float, float]] = []  # (device-timed s/step, wall s/step)

    def step(self) -> None:
        x, y = self.batches[self.i % len(self.batches)]
        self.i += 1
        with autocast(self.spec["precision"], self.dev.type):
            loss = lm_loss(self.model(x), y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.watch is not None:
            self.watch.log(loss)

    def info(self) -> dict:
        import torch

        m = self.mon
        if m is None:
            return {}
        s = m.schedule
        return {"steps": m.step, "probes": m.probes, "errors": m.errors, "sent": m.sender.sent, "drops": m.sender.drops,
                "probe_interval": s.interval, "agent_cost": s.fraction, "over_budget": s.over_budget,
                "nan_guard_kept": s.guard, "nan_guard_host_s": s.guard_s, "train_step_s": s.cost.train_s,
                "fused_kernel": {str(t).replace("torch.", ""): m.reducer.ready_for(self.dev, t)
                                 for t in (torch.float32, torch.bfloat16)}}

    def close(self) -> None:
        for a in (self.mon, self.hooks, self.watch):
            if a is not None:
                a.close()


def time_block(r: Runner, steps: int, cuda: bool) -> tuple[float, float]:
    """Seconds per step of one block: (timed by CUDA events, else wall; wall)."""
    import torch

    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    for _ in range(steps):
        r.step()
    if cuda:
        end.record()
        end.synchronize()
    wall = (time.perf_counter() - t0) / steps
    return (start.elapsed_time(end) / 1e3 / steps if cuda else wall), wall


def warm(runners: list, steps: int, cuda: bool, t_end: float, judge: bool = True) -> list[float]:
    """Warm-up after the first blocks and the background compile: with ``judge`` each agent whose
    probe interval the budget picks or whose NaN guard is ``auto``, past the guard's judgement and
    its first measured probes (while time allows), then one more block each; returns each
    runner's wall seconds per step in that block."""
    last = []
    for r in runners:
        if r.mon is not None and judge and (r.mon.cfg.every is None or r.mon.cfg.nan_guard == "auto"):
            while r.mon.step < GUARD_JUDGED_STEPS and time.monotonic() < t_end - 15:
                time_block(r, steps, cuda)
            settle(r.mon)
        last.append(time_block(r, steps, cuda)[1])
        settle(r.mon)
    return last


def _batches(spec: dict, batch: int, dev) -> list:
    a = spec["arch"]
    return [token_batch(a["vocab"], batch, a["context"], dev, seed=s) for s in range(4)]


def _free() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def calibrate(spec: dict, dev, endpoint: str) -> tuple[int, float]:
    """The batch whose step takes about ``target_s`` (CUDA), and the step time measured."""
    b0, lo, hi = spec["batch"]
    r = Runner("none", spec, _batches(spec, b0, dev), dev, endpoint, "calibrate")
    for _ in range(2):
        r.step()
    t, _ = time_block(r, 3, True)
    r.close()
    del r
    _free()
    want = b0 * spec["target_s"] / t
    return int(min(hi, max(lo, round(want / 4) * 4))), t


def peak_memory(spec: dict, batch: int, dev, endpoint: str, tag: str, ctx: Context) -> dict:
    """Peak allocated GPU memory (bytes) of ``none``, ``budget`` and ``every1``, one model at a time,
    over steps that include probed ones."""
    import torch

    out = {}
    for v in ("none", "budget", "every1"):
        _free()
        r = Runner(v, spec, _batches(spec, batch, dev), dev, endpoint, f"{tag}-mem")
        try:
            for _ in range(3):
                r.step()
            torch.cuda.synchronize()
            compile_threads_done(max(5.0, min(60.0, ctx.left() - 30)))
            probes0 = r.mon.probes if r.mon else 0
            torch.cuda.reset_peak_memory_stats()
            n = 0
            while n < 3 or (r.mon is not None and r.mon.probes == probes0 and n < 10):
                r.step()
                n += 1
            torch.cuda.synchronize()
            out[v] = {"peak_bytes": torch.cuda.max_memory_allocated(), "steps": n,
                      "probed": (r.mon.probes - probes0) if r.mon else 0}
        finally:
            r.close()
            del r
    _free()
    return out


def measure_model(ctx: Context, part: Part, name: str, spec: dict, sink, seconds: float) -> None:
    dev = ctx.torch_device()
    t_end = time.monotonic() + seconds
    t0 = time.perf_counter()
    batch, probe_s = spec["batch"][0], None
    if ctx.cuda:
        batch, probe_s = calibrate(spec, dev, sink.endpoint)
    res = {"batch": batch, "precision": spec["precision"], "calibration_step_s_at_first_batch": probe_s}
    part.numbers[name] = res
    if ctx.cuda:
        mem = peak_memory(spec, batch, dev, sink.endpoint, name, ctx)
        res["memory"] = mem
        base = mem["none"]["peak_bytes"]
        for v in ("budget", "every1"):  # every1's steps are all probed; budget's as its interval falls
            ratio = mem[v]["peak_bytes"] / base
            part.check(f"{name}: peak GPU memory, {v} against no agent",
                       ratio <= MEM_TARGET and (v == "budget" or mem[v]["probed"] > 0),
                       value=round(ratio, 5), target=f"<= {MEM_TARGET}",
                       detail=f"{mem[v]['peak_bytes'] / 2**30:.3f} GiB against {base / 2**30:.3f} GiB over "
                              f"{mem[v]['steps']} steps, {mem[v]['probed']} probed")
    else:
        part.skip(f"{name}: peak GPU memory with and without the agent", NEEDS_CUDA)
    runners = [Runner(v, spec, _batches(spec, batch, dev), dev, sink.endpoint, name) for v in VARIANTS]
    res["params"] = n_params(runners[0].model)
    res["describe"] = f"GPT {spec['arch']}, {res['params'] / 1e6:.1f}M parameters, batch {batch}, {spec['precision']}, AdamW"
    steps = spec["steps"]
    try:
        for r in runners:  # warm-up: allocator, autograd, the agent's first probe and schema
            time_block(r, steps, ctx.cuda)
            settle(r.mon)
        compile_threads_done(max(5.0, min(90.0, t_end - time.monotonic() - 20)))
        last = warm(runners, steps, ctx.cuda, t_end, spec.get("judge", True))
        per_round = sum(last) * steps
        lo, hi = spec["rounds"]
        rounds = int(max(lo, min(hi, (t_end - time.monotonic() - 3) / max(per_round * 1.15, 1e-3))))
        say(f"  [cost] {name}: {res['describe']}; {rounds} rounds x {len(VARIANTS)} variants x {steps} steps "
            f"(~{per_round:.1f}s a round)")
        probes0 = {r.variant: r.mon.probes for r in runners if r.mon is not None}
        for k in range(rounds):
            order = runners[k % len(runners):] + runners[:k % len(runners)]
            for r in order:
                r.blocks.append(time_block(r, steps, ctx.cuda))
                settle(r.mon)
        base = [b[0] for b in runners[0].blocks]
        med0 = statistics.median(base)
        res["rounds"], res["steps_per_block"], res["variants"] = rounds, steps, {}
        for r in runners:
            times = [b[0] for b in r.blocks]
            paired = [b / a for a, b in zip(base, times)]
            res["variants"][r.variant] = {
                "median_step_s": statistics.median(times), "ratio": statistics.median(times) / med0,
                "paired_ratio": statistics.median(paired), "paired_min": min(paired), "paired_max": max(paired),
                "median_wall_step_s": statistics.median(b[1] for b in r.blocks), "blocks_s": times, **r.info(),
                **({"probes_timed": r.mon.probes - probes0[r.variant]} if r.mon is not None else {})}
    finally:
        for r in runners:
            r.close()
        del runners
        _free()
    v = res["variants"]
    for variant, target in TARGETS.items():
        e = v[variant]
        detail = (f"paired {e['paired_ratio']:.4f} ({e['paired_min']:.3f}-{e['paired_max']:.3f}); no agent "
                  f"{v['none']['median_step_s'] * 1e3:.2f} ms/step; probe interval {e.get('probe_interval')}, "
                  f"{e.get('probes_timed')} probes in the timed blocks, NaN guard kept {e.get('nan_guard_kept')}, "
                  f"fused kernel {e.get('fused_kernel')}")
        if ctx.cuda:
            part.check(f"{name}: step time, {variant} against no agent", e["ratio"] <= target, value=round(e["ratio"], 5),
                       target=f"<= {target}", detail=detail)
        else:
            part.skip(f"{name}: step time, {variant} against no agent (ratio {e['ratio']:.3f})",
                      f"{NEEDS_CUDA}: the targets are the device's ({detail})")
    part.note(f"{name}: " + ", ".join(f"{k} {e['ratio']:.3f}x" for k, e in v.items())
              + f" ({res['describe']}; {rounds} rounds; {time.perf_counter() - t0:.0f} s)")


def run(ctx: Context, part: Part) -> None:
    import torch

    from bench.overhead import Sink

    if ctx.cuda:
        torch.cuda.set_device(0)
    # the anchor's full backward hook on an Embedding (integer input) warns once; it is expected
    warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")
    models = MODELS["cuda" if ctx.cuda else "cpu"]
    sink = Sink()
    try:
        for name, spec in models.items():
            seconds = (ctx.left() - 3) * spec["share"]
            if seconds < 10:
                part.skip(f"{name}: step time and memory", f"out of time ({ctx.left():.0f} s left)")
                continue
            measure_model(ctx, part, name, spec, sink, seconds)
    finally:
        part.numbers["sink"] = sink.close()
