"""Part 3, torch.compile together: the user's model compiled while the agent's fused kernel compiles
in the agent's thread.

The same six AdamW steps of a compiled GPT run without the agent, with it (``fused="on"``: its
kernel starts compiling at attach, in its thread, for the CPU, and on CUDA for the device too,
while the training thread compiles the model's first step; ``every=3``: probing starts and stops, which must recompile nothing), and, where the two
differ, once more without it (an A/A control: whether the compiled step is bit-reproducible at all). The
backend is inductor on CUDA, wrapped to record every graph it is handed (operations in order,
inputs as a set: the agent's root pre-hook may make dynamo list the input first); on the CPU the
graphs run as dynamo captured them (no inductor: seconds instead of a minute). Asserted: the same
graphs in the same number (no recompilation, no extra graph) and the same graph-break count with
the agent as without; no error; every report arrived with a finite gradient norm; losses and
final weights bit-identical to the run without the agent (when the A/A control is itself
bit-identical; else within its difference, said so).
"""

from __future__ import annotations

import time

from .common import Capture, Context, Part, compile_threads_done, gpt, lm_loss, say, token_batch

TITLE = "torch.compile together: the same graphs, breaks and recompiles, bit-identical results"
STEPS, EVERY = 6, 3
SIZES = {"cuda": dict(width=256, layers=2, heads=4, context=128, batch=8),
         "cpu": dict(width=64, layers=1, heads=2, context=32, batch=4)}


def _signature(gm) -> tuple:
    nodes = gm.graph.nodes
    return (tuple(sorted(n.name for n in nodes if n.op == "placeholder")),
            tuple((n.op, str(n.target), str(n.args)) for n in nodes if n.op != "placeholder"))


def _run(ctx: Context, cap: Capture, with_agent: bool, fused: str, tag: str) -> dict:
    import torch
    from torch._dynamo.utils import counters

    from gradwatch import agent as gw

    dev = ctx.torch_device()
    size = SIZES["cuda" if ctx.cuda else "cpu"]
    compile_threads_done(max(5.0, min(90.0, ctx.left() - 20)))  # no compile of an earlier agent left running
    torch._dynamo.reset()
    counters.clear()
    graphs: list = []

    def backend(gm, example_inputs):
        graphs.append(_signature(gm))
        if ctx.cuda:
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, example_inputs)
        return gm.forward

    torch.manual_seed(0)
    model = gpt(size["width"], size["layers"], size["heads"], size["context"]).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cm = torch.compile(model, backend=backend)
    job = f"compiled-{tag}"
    mon = gw.attach(cm, opt, endpoint=cap.endpoint, job=job, every=EVERY, burst=0, fused=fused) if with_agent else None
    if mon is not None and fused == "on" and ctx.cuda:
        # the compiled model hands the agent's hooks no tensor: start the kernel's CUDA compile as
        # its first CUDA tensor would, beside the CPU one begun at attach, while the model compiles
        mon.reducer.moments(torch.zeros(8, device=dev))
    losses, times = [], []
    try:
        for s in range(STEPS):
            x, y = token_batch(256, size["batch"], size["context"], dev, seed=s)
            t = time.perf_counter()
            loss = lm_loss(cm(x), y)
            if mon is not None:
                mon.observe_loss(loss)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach().clone())
            if ctx.cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        out = {"graphs": graphs, "breaks": sum(counters["graph_break"].values()),
               "losses": torch.stack(losses).cpu(), "params": [p.detach().cpu().clone() for p in model.parameters()],
               "first_step_s": times[0], "later_step_s": sorted(times[1:])[len(times[1:]) // 2]}
        if mon is not None:
            got = cap.wait_steps(job, STEPS, timeout_s=max(5.0, min(30.0, ctx.left() - 10)))
            out["reports"] = {s: got[s].grad_norm for s in sorted(got)}
            out["probed"] = sorted(s for s, r in got.items() if r.probe)
            out["compiled_seen"] = mon.recorder.compiled  # (close() resets it)
            compile_threads_done(max(5.0, min(90.0, ctx.left() - 20)))
            out["fused_ready"] = mon.reducer.ready_for(dev)
    finally:
        if mon is not None:
            mon.close()
    if mon is not None:
        out.update(agent_errors=mon.errors, disabled=sorted(mon.disabled))
    return out


def _max_diff(a: dict, b: dict) -> float:
    d = float((a["losses"] - b["losses"]).abs().max())
    for p, q in zip(a["params"], b["params"]):
        d = max(d, float((p - q).abs().max()))
    return d


def _identical(a: dict, b: dict) -> bool:
    import torch

    return torch.equal(a["losses"], b["losses"]) and all(torch.equal(p, q) for p, q in zip(a["params"], b["params"]))


def run(ctx: Context, part: Part) -> None:
    import math

    import torch

    if ctx.cuda:
        torch.cuda.set_device(0)
        torch.use_deterministic_algorithms(True, warn_only=True)  # the A/A control says whether it sufficed
    fused = "on" if "on" in ctx.fused else "off"
    cap = Capture()
    try:
        t0 = time.perf_counter()
        base = _run(ctx, cap, False, fused, "none")
        say(f"  [compiled] without the agent: {len(base['graphs'])} graphs, {base['breaks']} breaks, first step "
            f"{base['first_step_s']:.1f}s ({time.perf_counter() - t0:.0f}s)")
        agent = _run(ctx, cap, True, fused, "agent")
        say(f"  [compiled] with the agent: {len(agent['graphs'])} graphs, {agent['breaks']} breaks, first step "
            f"{agent['first_step_s']:.1f}s")
        # the A/A control only where the runs differ: is the compiled step bit-reproducible at all?
        control = _run(ctx, cap, False, fused, "control") if not _identical(base, agent) and ctx.left() > 15 else None
    finally:
        cap.close()
    part.numbers.update({
        "graphs": [len(base["graphs"]), len(agent["graphs"])], "breaks": [base["breaks"], agent["breaks"]],
        "first_step_s": [base["first_step_s"], agent["first_step_s"]], "step_s": [base["later_step_s"], agent["later_step_s"]],
        "backend": "inductor" if ctx.cuda else "dynamo graphs run as captured", "agent_fused": fused,
        "agent_fused_ready": agent.get("fused_ready"), "probed": agent.get("probed"),
    })
    part.check("the same graphs with the agent as without it (no recompilation, no extra graph)",
               agent["graphs"] == base["graphs"], value=len(agent["graphs"]), target=len(base["graphs"]))
    part.check("the same graph-break count", agent["breaks"] == base["breaks"], value=agent["breaks"], target=base["breaks"])
    reports = agent.get("reports", {})
    part.check("the agent ran without error, every step reported with a finite gradient norm, probing started and stopped",
               agent["agent_errors"] == 0 and not agent["disabled"] and sorted(reports) == list(range(STEPS))
               and all(math.isfinite(v) for v in reports.values()) and agent["probed"] == list(range(0, STEPS, EVERY))
               and agent.get("compiled_seen", False),
               value={"errors": agent["agent_errors"], "disabled": agent["disabled"], "reported": sorted(reports),
                      "probed": agent.get("probed"), "hooks stepped aside for dynamo": agent.get("compiled_seen")})
    if fused == "on":
        part.check(f"the agent's fused kernel compiled for {ctx.device} in its thread meanwhile", bool(agent.get("fused_ready")),
                   value=agent.get("fused_ready"))
    same = _identical(base, agent)
    if control is None or _identical(base, control):
        part.check("losses and final weights bit-identical to the run without the agent", same,
                   value="identical" if same else f"max abs difference {_max_diff(base, agent):.3g}",
                   detail="" if control is None else "the A/A control (two runs without the agent) is bit-identical")
    else:
        aa = _max_diff(base, control)
        part.check("losses and final weights within the A/A control's difference (the compiled step is not "
                   "bit-reproducible here, so bit-identity cannot be asserted)", _max_diff(base, agent) <= aa,
                   value=_max_diff(base, agent), target=aa)
