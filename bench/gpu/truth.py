"""Part 1, truth: every statistic the agent sends equals a float64 reference taken from the same tensors.

A GPT (the demo's model) in DDP over an in-process gloo group of one rank (so the communication hook
and its local norms run; gloo takes CUDA tensors) trains ``STEPS`` optimizer steps in fp32, in bf16
autocast, and in fp16 autocast with a ``GradScaler`` (one iteration's loss times 2**16 overflows
float16 in backward: the scaler skips it), each with the fused statistics kernel off and on. The
agent reports to a real ZeroMQ ROUTER socket bound here, every second step probed (``every=2``, no
bursts), the NaN guard on, and told ``world_size=2`` so it also sends fingerprints and per-parameter
norms every step. The harness's own hooks capture every leaf module's outputs and their gradients,
each parameter's gradient before the optimizer step and its value after: the very tensors the
agent reduced, so the reference (float64, on the device) needs no twin model and no deterministic
kernels. The last two steps (fp32 and bf16) carry a NaN and an Inf injected into
``blocks.0.mlp.fc``'s output at a probed step, then the step after (NaN weights), where the NaN
guard must name the first module in call order.

Compared, per step: ``act`` (mean, std, min, max, zero ratio, non-finite count per slot), ``act_count``
(calls, elements), ``act_grad`` (output-gradient norm unscaled, non-finite count), ``param`` (gradient
norm, weight norm, non-finite count), fingerprints of gradients and weights, the global norm and its
non-finite count, per-parameter norms, the local norm, loss, loss scale, skipped steps, micro-steps,
batch and the guard's verdict. Tolerances (:data:`TOL`, :data:`NORM_TOL`): norms rel 1e-6 in fp32,
1e-5 under bf16 and fp16 autocast (the agent sums squares in float32 within 8192-element chunks and
in float64 across; on the CPU its chunk sums of bf16 models' gradients reach 1.1e-6); means and
standard deviations rel 1e-5 plus 1e-5 (mean) or 1e-6 (std) of the mean |x|, a float32 sum's
rounding (as tests/test_agent_stats.py); min, max, counts, fingerprints, loss scale exact; a
non-finite reference must be reported non-finite alike.
"""

from __future__ import annotations

import math
import time

from .common import Context, Capture, Part, autocast, compile_threads_done, fingerprint64, gpt, lm_loss, moments64, \
    nonfinite64, norm64, rel_err, say, token_batch, wait_fused

TITLE = "truth on the device: every statistic against a float64 reference of the same tensors"
STEPS, EVERY = 8, 2
NAN_STEP = 6  # probed: a NaN and an Inf in blocks.0.mlp.fc's output; step 7 then runs on NaN weights
NAN_LAYER = "blocks.0.mlp.fc"
OVERFLOW_ITER = 3  # fp16: this iteration's loss times 2**16 overflows in backward; the scaler skips it
TOL = {"norm": 1e-6, "mean": 1e-5, "mean_abs": 1e-5, "std": 1e-5, "std_abs": 1e-6}
#: norms of tensors computed in reduced precision (bf16/fp16 matmuls' outputs and gradients, exact
#: in float32): the agent's float32 sums within 8192-element chunks reach 1.1e-6 on the CPU here
NORM_TOL = {"fp32": 1e-6, "bf16": 1e-5, "fp16": 1e-5}
SIZES = {  # chosen so every norm path runs: one chunk, views, and rows past SPLIT_MAX (CPU: 4) chunks
    "cuda": dict(width=384, layers=2, heads=6, context=128, batch=16),
    "cpu": dict(width=96, layers=1, heads=4, context=32, batch=4),
}


class Reference:
    """The harness's own hooks: every leaf module's floating outputs and their gradients, each
    parameter's gradient at the optimizer's step (pre-hook) and its value after (post-hook), as
    clones of the tensors themselves."""

    def __init__(self, model, opt):
        import torch

        self._torch = torch
        leaves = [(n, m) for n, m in model.named_modules() if n and next(m.children(), None) is None]
        self.handles = [m.register_forward_hook(self._forward(n)) for n, m in leaves]
        self.params = list(model.named_parameters())
        self.handles.append(opt.register_step_pre_hook(self._pre))
        self.handles.append(opt.register_step_post_hook(self._post))
        self.begin()

    def begin(self) -> None:
        self.outs: dict[str, list] = {}
        self.grads: dict[str, list] = {}
        self.order: list[str] = []
        self.pgrads: dict | None = None
        self.weights: dict | None = None

    def _forward(self, name):
        def hook(module, args, out):
            if isinstance(out, self._torch.Tensor) and out.is_floating_point():
                self.order.append(name)
                self.outs.setdefault(name, []).append(out.detach().clone())
                if out.requires_grad:
                    out.register_hook(lambda g: self.grads.setdefault(name, []).append(g.detach().clone()))

        return hook

    def _pre(self, opt, args, kwargs) -> None:
        self.pgrads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in self.params}

    def _post(self, opt, args, kwargs) -> None:
        self.weights = {n: p.detach().clone() for n, p in self.params}

    @property
    def stepped(self) -> bool:
        return self.weights is not None

    def summary(self, scale: float) -> dict:
        """float64 reference of everything the agent reports for this step; ``scale`` the loss
        scale the output gradients carry (1 without a scaler)."""
        grads = [g for g in self.pgrads.values() if g is not None]
        first = next((n for n in self.order if nonfinite64(self.outs[n]) > 0), None)
        return {
            "act": {n: moments64(ts) for n, ts in self.outs.items()},
            "count": {n: (len(ts), sum(t.numel() for t in ts)) for n, ts in self.outs.items()},
            "act_grad": {n: (norm64(gs) / scale, nonfinite64(gs)) for n, gs in self.grads.items()},
            "param": {n: (norm64(g) if g is not None else math.nan, norm64(self.weights[n]),
                          nonfinite64(g) if g is not None else None,
                          fingerprint64(g) if g is not None else None, fingerprint64(self.weights[n]))
                      for n, g in self.pgrads.items()},
            "grad_norm": norm64(grads), "grad_nonfinite": sum(nonfinite64(g) > 0 for g in grads),
            "local_norm": norm64(grads),  # one rank: the bucket holds the gradient before all-reduce
            "first_nonfinite": first,
        }

    def close(self) -> None:
        for h in self.handles:
            h.remove()


class Compare:
    """Collects the largest relative error per family and every mismatch."""

    def __init__(self):
        self.worst: dict[str, float] = {}
        self.mismatches: list[str] = []
        self.n = 0

    def num(self, family: str, what: str, got: float, want: float, rtol: float, atol: float = 0.0) -> None:
        got, want = float(got), float(want)
        self.n += 1
        err = rel_err(got, want)
        if math.isfinite(want) and math.isfinite(got):
            ok = abs(got - want) <= rtol * abs(want) + atol
        else:
            ok = err == 0.0
        self.worst[family] = max(self.worst.get(family, 0.0), err)
        if not ok:
            self.mismatches.append(f"{what}: got {got!r}, want {want!r}")

    def exact(self, family: str, what: str, got, want) -> None:
        self.n += 1
        same = got == want or (isinstance(got, float) and isinstance(want, float) and math.isnan(got) and math.isnan(want))
        self.worst.setdefault(family, 0.0)
        if not same:
            self.worst[family] = math.inf
            self.mismatches.append(f"{what}: got {got!r}, want {want!r}")


def compare_step(c: Compare, step: int, r, ref: dict, schema, batch: int, ntol: float) -> None:
    """One step's record ``r`` (a probed report or a sentinel record) against its reference;
    ``ntol`` the norms' relative tolerance."""
    tag = f"step {step}"
    names = [p[0] for p in schema.params]
    c.num("grad_norm", f"{tag} grad_norm", r.grad_norm, ref["grad_norm"], ntol)
    c.exact("grad_nonfinite", f"{tag} grad_nonfinite", int(r.grad_nonfinite), ref["grad_nonfinite"])
    c.num("local_norm", f"{tag} local_grad_norm", r.local_grad_norm, ref["local_norm"], ntol)
    if r.grad_norms is None:
        c.mismatches.append(f"{tag}: no per-parameter gradient norms (the agent was told world_size=2)")
    else:
        for i, name in enumerate(names):
            c.num("grad_norms", f"{tag} grad_norms[{name}]", r.grad_norms[i], ref["param"][name][0], ntol)
    if not r.probe:
        return
    c.exact("micro", f"{tag} micro", r.micro, 1)
    c.exact("batch", f"{tag} batch", r.batch, batch)
    for i, name in enumerate(names):
        gn, wn, nf, fpg, fpw = ref["param"][name]
        row = r.param[i]
        c.num("param_grad_norm", f"{tag} param[{name}].grad_norm", row[0], gn, ntol)
        c.num("weight_norm", f"{tag} param[{name}].weight_norm", row[1], wn, ntol)
        c.exact("param_nonfinite", f"{tag} param[{name}].nonfinite", float(row[2]), float(nf))
        c.exact("fp_grad", f"{tag} fp_grad[{name}]", int(r.fp_grad[i]), fpg)
        c.exact("fp_weight", f"{tag} fp_weight[{name}]", int(r.fp_weight[i]), fpw)
    slots = {(s[0], s[1]): k for k, s in enumerate(schema.slots)}
    for path, m in ref["act"].items():
        k = slots.get((path, ""))
        if k is None:
            c.mismatches.append(f"{tag}: module {path} has no slot in the schema")
            continue
        mean, std, mn, mx, zr, nf = (float(v) for v in r.act[k])
        w = f"{tag} act[{path}]"
        c.exact("act_nonfinite", f"{w}.nonfinite", nf, float(m["nonfinite"]))
        c.num("act_zero_ratio", f"{w}.zero_ratio", zr, m["zero_ratio"], 0.0, 1e-7)
        if m["nonfinite"]:
            if math.isfinite(mean):
                c.mismatches.append(f"{w}.mean: finite ({mean!r}) for a tensor holding NaN/Inf")
        else:
            c.num("act_mean", f"{w}.mean", mean, m["mean"], TOL["mean"], TOL["mean_abs"] * m["scale"])
            c.num("act_std", f"{w}.std", std, m["std"], TOL["std"], TOL["std_abs"] * m["scale"])
            c.exact("act_min", f"{w}.min", mn, m["min"])
            c.exact("act_max", f"{w}.max", mx, m["max"])
        calls, elements = ref["count"][path]
        c.exact("act_count", f"{w}.count", tuple(float(v) for v in r.act_count[k]), (float(calls), float(elements)))
    for path, (norm, nf) in ref["act_grad"].items():
        k = slots[(path, "")]
        c.num("act_grad_norm", f"{tag} act_grad[{path}].norm", r.act_grad[k][0], norm, ntol)
        c.exact("act_grad_nonfinite", f"{tag} act_grad[{path}].nonfinite", float(r.act_grad[k][1]), float(nf))


def run_case(ctx: Context, cap: Capture, part: Part, precision: str, fused: str) -> None:
    import torch
    from torch._dynamo.utils import counters
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradwatch import agent as gw

    dev = ctx.torch_device()
    size = SIZES["cuda" if ctx.cuda else "cpu"]
    case = f"{precision}/fused={fused}"
    t0 = time.perf_counter()
    torch.manual_seed(0)
    model = gpt(size["width"], size["layers"], size["heads"], size["context"]).to(dev)
    ddp = DDP(model, device_ids=[dev.index] if ctx.cuda else None)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(dev.type) if precision == "fp16" else None
    ref = Reference(model, opt)
    job = f"truth-{precision}-{fused}"
    mon = gw.attach(ddp, opt, scaler=scaler, endpoint=cap.endpoint, job=job, every=EVERY, burst=0, nan_guard="on",
                    fused=fused, world_size=2, rank=0, heartbeat_s=0.5)
    if not isinstance(mon, gw.Monitor):
        part.check(f"{case}: the agent attaches", False, detail=f"attach returned {type(mon).__name__}")
        return
    fused_ready = graphs_before = None
    if fused == "on":
        # the kernel's compile for a device and dtype starts at its first tensor (the CPU's float32
        # at attach): start those of this case's outputs (float32, and the autocast dtype), and let
        # every compile finish, so that any graph compiled from here on was compiled on this, the
        # training, thread
        dtypes = [torch.float32] + ([{"bf16": torch.bfloat16, "fp16": torch.float16}[precision]] if precision != "fp32" else [])
        for dt in dtypes:
            mon.reducer.moments(torch.zeros(8, device=dev, dtype=dt))
        fused_ready = all(wait_fused(mon.reducer, dev, max(5.0, min(150.0, ctx.left() - 40)), dt) for dt in dtypes)
        compile_threads_done(max(5.0, min(60.0, ctx.left() - 40)))
        graphs_before = counters["stats"]["unique_graphs"]
    truths: dict[int, dict] = {}
    scales: dict[int, float] = {}
    losses: dict[int, float] = {}
    skipped_after: dict[int, int] = {}  # optimizer step -> iterations skipped just before it
    pending_skips = 0
    it = step = 0
    try:
        while step < STEPS:
            x, y = token_batch(256, size["batch"], size["context"], dev, seed=1000 + it)
            inject = precision != "fp16" and step == NAN_STEP
            overflow = precision == "fp16" and it == OVERFLOW_ITER
            ref.begin()
            poison = None
            if inject:
                def bad(m, a, out):
                    out = out.clone()
                    out[0, 0, 0] = float("nan")
                    out[1, 1, 1] = float("inf")
                    return out

                poison = dict(model.named_modules())[NAN_LAYER].register_forward_hook(bad, prepend=True)
            with autocast(precision, dev.type):
                loss = lm_loss(ddp(x), y)
            if poison is not None:
                poison.remove()
            mon.observe_loss(loss)
            scale = float(scaler.get_scale()) if scaler is not None else 1.0
            if scaler is not None:
                scaler.scale(loss * (2.0**16 if overflow else 1.0)).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
            if ref.stepped:
                truths[step] = ref.summary(scale)
                scales[step], losses[step] = scale, float(loss.detach())
                skipped_after[step] = pending_skips
                pending_skips = 0
                step += 1
            else:
                pending_skips += 1
            opt.zero_grad(set_to_none=True)
            it += 1
        if ctx.cuda:
            torch.cuda.synchronize()
        graphs_after = counters["stats"]["unique_graphs"]
        got = cap.wait_steps(job, STEPS, timeout_s=max(5.0, min(30.0, ctx.left() - 10)))
    finally:
        mon.close()
        ref.close()
    errors, disabled = mon.errors, sorted(mon.disabled)
    schemas = cap.schemas(job)
    missing = [s for s in range(STEPS) if s not in got]
    c = Compare()
    for s in range(STEPS):
        r = got.get(s)
        if r is None:
            continue
        schema = schemas.get(r.schema)
        if schema is None:
            c.mismatches.append(f"step {s}: schema {r.schema} never received")
            continue
        compare_step(c, s, r, truths[s], schema, size["batch"], NORM_TOL[precision])
        c.num("loss", f"step {s} loss", r.loss, losses[s], 1e-6)
        if scaler is not None:
            c.exact("loss_scale", f"step {s} loss_scale", float(r.loss_scale), scales[s])
        c.exact("skipped", f"step {s} skipped", int(r.skipped), skipped_after[s])
    ok = not missing and not c.mismatches and errors == 0 and not disabled
    part.numbers.setdefault("cases", {})[case] = {
        "max_rel_err": c.worst, "values_compared": c.n, "mismatches": c.mismatches[:20],
        "mismatch_count": len(c.mismatches), "missing_steps": missing, "agent_errors": errors,
        "disabled": disabled, "wall_s": round(time.perf_counter() - t0, 2),
    }
    part.check(f"{case}: every statistic of {STEPS} steps equals the float64 reference", ok,
               value={"values": c.n, "mismatches": len(c.mismatches), "worst_norm_rel": max(
                   (v for k, v in c.worst.items() if "norm" in k), default=0.0)},
               target=f"norms rel {NORM_TOL[precision]:g}, moments rel {TOL['mean']:g}, the rest exact",
               detail="; ".join(c.mismatches[:3] + ([f"missing steps {missing}"] if missing else [])
                                + ([f"agent errors {errors}, disabled {disabled}"] if errors or disabled else [])))
    probed = sorted(s for s, r in got.items() if r.probe)
    want_probed = list(range(0, STEPS, EVERY))
    part.check(f"{case}: probed exactly at steps {', '.join(map(str, want_probed))} (every={EVERY}, no bursts)",
               probed == want_probed, value=probed)
    unprobed = [s for s in range(STEPS) if s in got and not got[s].probe]
    verdicts = {s: got[s].nonfinite_slot for s in unprobed}
    if precision != "fp16":
        schema = schemas.get(got[NAN_STEP + 1].schema) if NAN_STEP + 1 in got else None
        first = truths[NAN_STEP + 1]["first_nonfinite"]
        want_slot = next((k for k, sl in enumerate(schema.slots) if sl[0] == first and sl[1] == ""), None) if schema else None
        want = {s: (want_slot if s == NAN_STEP + 1 else -1) for s in unprobed}
        part.check(f"{case}: the NaN guard's verdict on unprobed steps", verdicts == want, value=verdicts, target=want,
                   detail=f"after the NaN step the first non-finite output is {first}")
    else:
        want = {s: -1 for s in unprobed}
        part.check(f"{case}: the NaN guard's verdict on unprobed steps", verdicts == want, value=verdicts, target=want)
        skips = {s: n for s, n in skipped_after.items() if n}
        part.check(f"{case}: the overflowing iteration is skipped by the scaler, counted in the next report, not reported",
                   bool(skips) and sum(skips.values()) == 1 and it == STEPS + 1, value={"skipped_before_step": skips,
                                                                                    "iterations": it})
    if fused == "on":
        part.check(f"{case}: the fused kernel was ready for {dev.type} before step 0, and nothing compiled on the "
                   f"training thread (autocast, grad mode, dtypes)", bool(fused_ready) and graphs_after == graphs_before,
                   value={"ready": fused_ready, "graphs_compiled_during_steps": graphs_after - (graphs_before or 0)})
    say(f"  [truth] {case} done in {time.perf_counter() - t0:.1f}s")


def run(ctx: Context, part: Part) -> None:
    import torch
    import torch.distributed as dist

    if ctx.cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cap = Capture()
    try:
        for precision in ("fp32", "bf16", "fp16"):
            for fused in ctx.fused:
                if ctx.left() < (40 if fused == "on" else 10):
                    part.skip(f"{precision}/fused={fused}", f"out of time ({ctx.left():.0f} s left)")
                    continue
                run_case(ctx, cap, part, precision, fused)
    finally:
        cap.close()
        dist.destroy_process_group()
