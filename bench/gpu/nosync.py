"""Part 2, no hidden synchronisation: on unprobed steps the agent makes the host wait for the device
no more often than the training step without it does.

A GPT (the truth part's CUDA size) trains in DDP over an in-process NCCL group of one rank (so the
communication hook's bucket observation runs; plain when NCCL will not start), bf16 autocast, and
again in fp16 with a ``GradScaler`` (whose own ``step`` reads its inf flag: a sync the step has
without the agent too). Three variants each: no agent; the agent probing only step 0 (``every``
huge) with the NaN guard on, so the measured steps are all unprobed and guarded; the agent probing
every step. After a warm-up (and the agent's background kernel compile), ``MEASURED`` steps run
twice: under ``torch.cuda.set_sync_debug_mode("warn")``, its warnings counted, and under
``torch.profiler``, the synchronising CUDA runtime calls counted (:data:`SYNC_CALLS`; the block's
one closing ``cudaDeviceSynchronize`` included alike in every variant), with kernel launches and
pinned host allocations beside them. Asserted: the unprobed agent's counts equal the no-agent
step's; the probed steps' counts are stated. On the CPU the same code runs at reduced size (the
profiler's CPU operators only) and every check is skipped: there is no device to wait for.
"""

from __future__ import annotations

import collections
import time
import warnings

from .common import NEEDS_CUDA, Capture, Context, Part, autocast, compile_threads_done, gpt, lm_loss, say, token_batch

TITLE = "no hidden synchronisation: unprobed steps add no device-to-host sync"
MEASURED, WARM = 10, 6
SYNC_CALLS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaMemcpy2D",
              "cudaFree", "cudaFreeHost")
SIZES = {"cuda": dict(width=384, layers=2, heads=6, context=128, batch=16),
         "cpu": dict(width=64, layers=1, heads=2, context=32, batch=4)}


def _count(prof) -> dict:
    names = collections.Counter(e.name for e in prof.events())
    return {"sync": {k: names[k] for k in SYNC_CALLS if names.get(k)},
            "sync_total": sum(names.get(k, 0) for k in SYNC_CALLS),
            "launches": names.get("cudaLaunchKernel", 0) + names.get("cudaLaunchKernelExC", 0) + names.get("cuLaunchKernel", 0),
            "memcpy_async": names.get("cudaMemcpyAsync", 0), "pinned_allocs": names.get("cudaHostAlloc", 0)}


def _variant(ctx: Context, cap: Capture, precision: str, variant: str, ddp_ok: bool) -> dict:
    """One variant's counts over ``MEASURED`` steps after the warm-up. On the CPU (the code path
    kept alive between lent GPUs) the profiler counts CPU operators only and the sync debug mode,
    which is CUDA's, is not run."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.profiler import ProfilerActivity, profile

    from gradwatch import agent as gw

    cuda = ctx.cuda
    dev = ctx.torch_device()
    size = SIZES["cuda" if cuda else "cpu"]
    measured, warm = (MEASURED, WARM) if cuda else (2, 2)
    torch.manual_seed(0)
    model = gpt(size["width"], size["layers"], size["heads"], size["context"]).to(dev)
    net = DDP(model, device_ids=[dev.index]) if ddp_ok else model
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler(dev.type) if precision == "fp16" else None
    mon = None
    if variant != "none":
        mon = gw.attach(net, opt, scaler=scaler, endpoint=cap.endpoint, job=f"nosync-{precision}-{variant}",
                        every=1 if variant == "probed" else 1 << 30, burst=0, nan_guard="on")
    batches = [token_batch(256, size["batch"], size["context"], dev, seed=s) for s in range(4)]
    i = 0

    def step():
        nonlocal i
        x, y = batches[i % len(batches)]
        i += 1
        with autocast(precision, dev.type):
            loss = lm_loss(net(x), y)
        if mon is not None:
            mon.observe_loss(loss)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad(set_to_none=True)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    syncs: list[str] = []
    try:
        for _ in range(warm):
            step()
        sync()
        compile_threads_done(max(5.0, min(90.0, ctx.left() - 20)))  # the fused kernel's check syncs its own thread
        for _ in range(2):
            step()
        sync()
        if cuda:  # 1: the sync debug mode, every synchronising call a warning
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    for _ in range(measured):
                        step()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            sync()
            syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
        # 2: the profiler's count of CUDA runtime calls (on the CPU once, its parse takes ~0.5 s)
        counts = {"sync": {}, "sync_total": 0, "launches": 0, "memcpy_async": 0, "pinned_allocs": 0}
        if cuda or (precision, variant) == ("bf16", "probed"):
            with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
                for _ in range(measured):
                    step()
                sync()
            counts = _count(prof)
    finally:
        if mon is not None:
            mon.close()
    out = {"debug_mode_syncs": len(syncs), "debug_mode_first": syncs[:3], **counts,
           "launches_per_step": counts["launches"] / measured, "steps": measured}
    if mon is not None:
        out.update(agent_errors=mon.errors, disabled=sorted(mon.disabled), probes=mon.probes,
                   fused_kernel=mon.reducer.ready_for(dev))
    net = model = opt = None  # noqa: F841 (freed before the next variant's model)
    if cuda:
        torch.cuda.empty_cache()
    return out


def run(ctx: Context, part: Part) -> None:
    import torch
    import torch.distributed as dist

    ddp_ok = False
    if ctx.cuda:
        torch.cuda.set_device(0)
        try:
            dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                    device_id=torch.device("cuda", 0))
            ddp_ok = True
        except Exception as e:
            part.note(f"NCCL did not start in-process ({e!r}); the model runs without DDP (no communication hook)")
    cap = Capture()
    try:
        for precision in ("bf16", "fp16"):
            what = (f"{precision}{'+GradScaler' if precision == 'fp16' else ''}: {MEASURED} unprobed guarded steps with "
                    f"the agent{' (DDP, NCCL)' if ddp_ok else ''} make no more synchronising calls than without it")
            if ctx.left() < 8:
                part.skip(what, f"out of time ({ctx.left():.0f} s left)")
                continue
            t0 = time.perf_counter()
            res = {v: _variant(ctx, cap, precision, v, ddp_ok) for v in ("none", "unprobed", "probed")}
            part.numbers[precision] = res
            none, unp, prb = res["none"], res["unprobed"], res["probed"]
            if not ctx.cuda:
                part.skip(what, NEEDS_CUDA)
                continue
            part.check(what, unp["debug_mode_syncs"] == none["debug_mode_syncs"] and unp["sync_total"] == none["sync_total"]
                       and unp["agent_errors"] == 0,
                       value={"debug_mode": [none["debug_mode_syncs"], unp["debug_mode_syncs"]],
                              "profiler": [none["sync"], unp["sync"]], "agent_errors": unp["agent_errors"]},
                       target="[no agent, agent] equal",
                       detail=f"kernel launches per step {none['launches_per_step']:.0f} -> {unp['launches_per_step']:.0f} "
                              f"unprobed, {prb['launches_per_step']:.0f} probed; first syncs with the agent: {unp['debug_mode_first']}")
            part.note(f"{precision}: probed steps (every=1): {prb['debug_mode_syncs'] - none['debug_mode_syncs']} "
                      f"synchronising calls more than without the agent by the sync debug mode, profiler {prb['sync']} "
                      f"against {none['sync']} over {MEASURED} steps; pinned allocations {prb['pinned_allocs']}, fused "
                      f"kernel {prb.get('fused_kernel')}, agent errors {prb['agent_errors']}")
            say(f"  [nosync] {precision} done in {time.perf_counter() - t0:.1f}s")
    finally:
        cap.close()
        if ddp_ok:
            dist.destroy_process_group()
