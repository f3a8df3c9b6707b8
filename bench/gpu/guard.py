"""Part 6, the NaN guard's ``auto`` decision on the device, and what the guard costs there.

The cost part's small model (about 10 ms steps on the device, batch calibrated the same way) trains
in four copies, interleaved in blocks timed with CUDA events: no agent, and the agent probing only
step 0 (``every`` huge: every measured step is unprobed) with ``nan_guard`` ``off``, ``on`` and
``auto``. After :data:`.cost.GUARD_JUDGED_STEPS` warm-up steps ``auto`` has judged itself on its
host time (``ProbeSchedule``: kept when its median host time per step is at most a quarter of the
1 % budget). Measured: the guard's cost on the device, (``on`` - ``off``) / no agent from the
paired per-round ratios, against that same share; ``auto``'s decision, its measured host time and
the share it allows. Asserted: the decision agrees with the measured device cost (kept when the
guard costs at most the share, dropped when more), unless the cost lies within the measurement's
resolution of the share (half the spread of the per-round ratios), where either is right; and
``auto`` steps at the cost of the setting it chose.
"""

from __future__ import annotations

import statistics
import time

from .common import Context, Part, say, settle

TITLE = "the NaN guard's auto decision on the device, and its cost"
SETTINGS = ("off", "on", "auto")


def run(ctx: Context, part: Part) -> None:
    import torch

    from gradwatch.agent.schedule import GUARD_SHARE

    from bench.overhead import Sink

    from .cost import MODELS, Runner, _batches, _free, calibrate, time_block, warm

    if ctx.cuda:
        torch.cuda.set_device(0)
    name = "small" if ctx.cuda else "gpt-tiny"
    spec = MODELS["cuda" if ctx.cuda else "cpu"][name]
    dev = ctx.torch_device()
    sink = Sink()
    runners = []
    try:
        batch = calibrate(spec, dev, sink.endpoint)[0] if ctx.cuda else spec["batch"][0]
        batches = _batches(spec, batch, dev)
        runners = [Runner("none", spec, batches, dev, sink.endpoint, "guard")]
        runners += [Runner(f"guard-{g}", spec, batches, dev, sink.endpoint, "guard", agent={"every": 1 << 30, "nan_guard": g})
                    for g in SETTINGS]
        steps = spec["steps"]
        t_end = ctx.deadline - 3
        for r in runners:
            time_block(r, steps, ctx.cuda)
        last = warm(runners, steps, ctx.cuda, t_end)
        per_round = sum(last) * steps
        rounds = int(max(2, min(20 if ctx.cuda else 2, (t_end - time.monotonic() - 2) / max(per_round * 1.15, 1e-3))))
        say(f"  [guard] {name}, batch {batch}: {rounds} rounds x {len(runners)} variants x {steps} steps")
        for k in range(rounds):
            for r in runners[k % len(runners):] + runners[:k % len(runners)]:
                r.blocks.append(time_block(r, steps, ctx.cuda))
                settle(r.mon)
        none = [b[0] for b in runners[0].blocks]
        med = {r.variant: statistics.median(b[0] for b in r.blocks) for r in runners}
        on, off, auto = (runners[1 + SETTINGS.index(g)] for g in ("on", "off", "auto"))
        # the guard's cost per round: (on - off) over the no-agent step of the same round
        costs = [(a[0] - b[0]) / n for a, b, n in zip(on.blocks, off.blocks, none)]
        cost = statistics.median(costs)
        q = statistics.quantiles(costs, n=4) if len(costs) >= 2 else [cost, cost, cost]
        resolution = (q[2] - q[0]) / 2
        s = auto.mon.schedule
        share = GUARD_SHARE * s.budget
        kept = bool(s.guard)
        judged = not s._judge_guard  # private: whether auto has judged (bench only)
        part.numbers.update({
            "model": name, "batch": batch, "rounds": rounds, "steps_per_block": steps,
            "median_step_s": med, "guard_device_cost": cost, "guard_device_cost_quartiles": [q[0], q[2]],
            "share_allowed": share, "auto_kept": kept, "auto_judged": judged, "auto_guard_host_s": s.guard_s,
            "auto_train_step_s": s.cost.train_s, "auto_host_share": s.guard_s / s.cost.train_s if s.cost.train_s else None,
        })
        part.check("auto judged itself within the warm-up", judged, value={"kept": kept, "host_s_per_step": s.guard_s,
                                                                        "train_step_s": s.cost.train_s})
        if abs(cost - share) <= resolution:
            agrees, why = True, "the cost is within the measurement's resolution of the share: either decision is right"
        else:
            agrees, why = kept == (cost <= share), ""
        target = "kept" if cost <= share else "dropped"
        detail = (f"the guard costs {cost:.3%} of the step on the device ({q[0]:.3%}-{q[2]:.3%} over rounds), the "
                  f"share is {share:.3%}; auto measured {s.guard_s * 1e3:.3g} ms host time per step "
                  f"({(s.guard_s / s.cost.train_s if s.cost.train_s else float('nan')):.3%} of its step) and "
                  f"{'kept' if kept else 'dropped'} it" + (f"; {why}" if why else ""))
        if ctx.cuda:
            part.check("auto's decision agrees with the guard's measured cost on the device", agrees,
                       value="kept" if kept else "dropped", target=target, detail=detail)
            chosen = on if kept else off
            ratio = med[auto.variant] / med[chosen.variant]
            part.check("auto steps at the cost of the setting it chose", abs(ratio - 1) <= max(0.01, 2 * resolution),
                       value=round(ratio, 4), target=f"1 +- {max(0.01, 2 * resolution):.3f}",
                       detail=f"auto against nan_guard={'on' if kept else 'off'}")
        else:
            part.skip("auto's decision agrees with the guard's measured cost on the device", f"skipped: needs CUDA ({detail})")
        part.note(f"NaN guard on the device: {detail}; step times {', '.join(f'{k} {v * 1e3:.2f} ms' for k, v in med.items())}")
    finally:
        for r in runners:
            r.close()
        runners.clear()
        _free()
        sink.close()
