#!/usr/bin/env python
"""Detection quality of gradwatch's checks: a fault matrix over real gloo DDP jobs.

Each run is one job: ``world`` rank processes (forked from this one, gloo on loopback, one torch
thread each) train a model with the real agent attached, reporting to one real aggregator
process (``python -m gradwatch.aggregator``, default thresholds) that writes its findings to a
JSON-lines event log. At most one fault is injected per run, by the harness into the job's own
tensors (:mod:`gradwatch.commands.demo.inject`, the demo's injector; never through the agent):

  explode        loss x 1e6 on one rank at STEP
  nan_fwd_*      NaN in one module's output on one rank at STEP (two modules per model)
  nan_bwd_*      NaN in the gradient arriving at one module's output on one rank at STEP
  desync         1e-3 added to one rank's gradient of one parameter after all-reduce
  bitflip        one mantissa bit (10) of one weight flipped on one rank after the optimizer step
  straggler10/30/100  one rank sleeps 0.1/0.3/1.0 x its median step time before every forward
  hang           one rank's training thread sleeps HOLD_S seconds at STEP (its agent keeps beating)
  silent         one rank's process stops (SIGSTOP) at STEP; resumed (SIGCONT) after HOLD_S seconds
  dead           a layer's bias set to -1e3 on every rank at STEP: the activation after it dies (the
                 CNN's ReLU, the GPT's GELU: its tail rounds to exact zeros)
  vanish         loss x 1e-12 on every rank from STEP on
  shard          one rank's input batches replaced by noise from STEP on (world >= 3: outlier_rank
                 compares a rank with the others' median)
  clean          no fault

The agents run with a fixed probe cadence of 10 and the NaN guard on (``--nan-guard``), default
settings otherwise. Axes: fault x injected rank (0 or the last) x injection step (30, probed at
that cadence, or 35, not probed) x world size (2, 3, 4, 8) x model (``gpt``: the demo's GPT, tiny; ``cnn``:
bench/overhead.py's CNN on scikit-learn's digits) x load (``idle``: nothing added; ``busy``: two
processes spinning on the CPUs beside the job) x repeats. Rank and step are sampled, not crossed:
run i of a cell (world, model, load, repeat) takes rank and step from a rotation, so the four
combinations recur every four repeats. Every cell also runs CLEAN_RUNS clean jobs.

Per check: recall (runs of a fault the check is meant for where it raised a finding), precision
(its findings that belong to the injected fault: a fault it is meant for or one whose knock-on
effects it rightly reports, naming the injected rank or none), attribution (the first finding of
a detected fault names the injected rank and, for a fault in a module, that module), time to
detect in steps (finding step - injection step) and seconds (event time - the moment the fault
was first applied), p50/p95, and false findings per 1000 clean job-steps.

    .venv/bin/python bench/faultmatrix.py                        # full matrix (see bench/README.md)
    .venv/bin/python bench/faultmatrix.py --quick                # world 2, cnn, idle, 4 faults + clean
    .venv/bin/python bench/faultmatrix.py --worlds 2,3 --repeats 2 --json bench/results/faultmatrix.json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import multiprocessing as mp
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
import torch.nn as nn

HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.dirname(HERE) not in sys.path:
    sys.path.insert(0, os.path.dirname(HERE))

from bench.harness import AggregatorProcess, free_port  # noqa: E402
STEPS_AT = (30, 35)  # injection steps: 30 is probed at the agent's default cadence (10), 35 is not
HOLD_S = 6.0  # hang and silent last this long, then the rank resumes and the job ends normally
EVERY = 10  # the agents' fixed probe cadence here (the agent's default lets its budget pick one)
CLEAN_RUNS = 2  # clean runs per cell
POST = {"straggler": 64, "default": 36}  # steps after injection: 3 straggler windows of 16 steps; 3 probes
LINGER_S = 1.5  # after the ranks exit, seconds the aggregator gets to finish rounds and checks


@dataclass(frozen=True)
class Fault:
    """One fault variant: the inject spec (without step and rank), the check meant to find it,
    checks whose findings are its rightful knock-on effects, and the module a finding should name."""

    name: str
    spec: str  # KIND[:options] for gradwatch.commands.demo.inject, '' for a clean run
    expect: str  # the check meant to find it
    allow: tuple[str, ...] = ()  # knock-on findings that belong to the fault (not false)
    layer: str = ""  # module a finding should name ('' when none)
    all_ranks: bool = False  # injected on every rank: findings name no rank
    min_world: int = 2
    vote: bool = False  # the check names a rank by majority: with two ranks it names none
    models: tuple[str, ...] = ("gpt", "cnn")


# modules per model: two for NaN (an early and a late one), and the activation after a Linear for dead units
NAN_LAYERS = {"gpt": ("blocks.0.mlp.fc", "blocks.1.attn.proj"), "cnn": ("0", "6")}
DEAD = {"cnn": ("6", "7"), "gpt": ("blocks.0.mlp.fc", "blocks.0.mlp.act")}  # bias of the Linear -> the activation after it dead

# a NaN spreads to every weight at the next optimizer step (all-reduce carries it to every rank):
# explosion sees the spike of the step before, and the NaN run trips the checks that read
# statistics of non-finite weights; all of these name the same fault
_NAN_ALLOW = ("explosion",)


def faults(model: str) -> list[Fault]:
    """The fault variants for ``model``, clean excluded."""
    a, b = NAN_LAYERS[model]
    out = [
        Fault("explode", "explode", "explosion"),
        Fault("nan_fwd_early", f"nan:layer={a}", "nonfinite", _NAN_ALLOW, layer=a),
        Fault("nan_fwd_late", f"nan:layer={b}", "nonfinite", _NAN_ALLOW, layer=b),
        Fault("nan_bwd_early", f"nan:layer={a}:pass=backward", "nonfinite", _NAN_ALLOW, layer=a),
        Fault("nan_bwd_late", f"nan:layer={b}:pass=backward", "nonfinite", _NAN_ALLOW, layer=b),
        # the rank's weights differ after the step that applied its perturbed gradient
        Fault("desync", "desync:param=" + ("head.weight" if model == "gpt" else "8.weight"), "grad_agreement",
              ("replica_drift",), vote=True),
        Fault("bitflip", "drift:param=" + ("head.weight" if model == "gpt" else "8.weight"), "replica_drift", vote=True),
        Fault("straggler10", "straggler:factor=0.1", "straggler"),
        Fault("straggler30", "straggler:factor=0.3", "straggler"),
        Fault("straggler100", "straggler:factor=1.0", "straggler"),
        Fault("hang", f"hang:seconds={HOLD_S:g}", "training_stalled"),
        # its peers wait for it in all-reduce: training stalls at the silent rank
        Fault("silent", f"silent:seconds={HOLD_S:g}", "rank_silent", ("training_stalled",)),
        Fault("vanish", "vanish", "vanishing", all_ranks=True),
        Fault("shard", "shard", "outlier_rank", min_world=3),
    ]
    if model in DEAD:
        lin, relu = DEAD[model]
        out.append(Fault("dead", f"dead:layer={lin}", "dead_units", layer=relu, all_ranks=True))
    return out


CLEAN = Fault("clean", "", "")
TIME_BASED = ("rank_silent", "training_stalled")  # judged on the clock: their findings' steps are the last seen
QUICK_FAULTS = ("explode", "nan_fwd_late", "bitflip", "silent")


# --- the job ----------------------------------------------------------------------------------


class DigitsCNN(nn.Sequential):
    """bench/overhead.py's CNN: conv-relu-conv-relu-pool-fc-relu-fc, 8x8 digit images."""

    def __init__(self):
        super().__init__(
            nn.Conv2d(1, 24, 3, padding=1), nn.ReLU(), nn.Conv2d(24, 32, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 16, 128), nn.ReLU(), nn.Linear(128, 10),
        )


@dataclass(frozen=True)
class Run:
    job: str
    model: str
    world: int
    load: str
    repeat: int
    fault: str  # Fault.name
    inject: str  # full inject spec, '' for clean
    rank: Optional[int]  # injected rank (None: clean, or every rank)
    step: Optional[int]  # injection step
    steps: int
    nan_guard: str = "on"  # the agent's nan_guard setting


def _digits():
    from sklearn.datasets import load_digits

    d = load_digits()
    return d.images.astype("float32") / 16.0, d.target.astype("int64")


def _rank_main(rank: int, run: Run, port: int, endpoint: str, progress, out_dir: str, digits) -> None:
    """One rank: train ``run.steps`` steps with the agent attached and the faults applied."""
    from gradwatch.commands.demo.alloc import steady_allocator

    steady_allocator()  # before the first step: every rank's allocator alike (see steady_allocator)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(run.world), LOCAL_RANK=str(rank), TORCHELASTIC_RUN_ID=run.job,
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import datetime

    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradwatch import agent
    from gradwatch.commands.demo.inject import Injector, parse
    from gradwatch.commands.demo.model import GPT, GPTConfig, batch, stdlib_text

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=run.world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        torch.manual_seed(0)
        # steps of 15-20 ms of compute on one idle core, several times that under load: a 30 %
        # straggler is a few milliseconds idle, just past straggler_min_s (3 ms), the straggler
        # check's floor against scheduler jitter, and well past it under load
        if run.model == "gpt":  # the demo's GPT at its default size
            model = GPT(GPTConfig(context=64, width=64, layers=2, heads=4))
            text = stdlib_text()

            def data(step):
                return batch(text, 0, rank, step, 16, 64)

            def loss_of(out, y):
                return F.cross_entropy(out.flatten(0, 1), y.flatten())
        else:
            model = DigitsCNN()
            x_all, y_all = torch.from_numpy(digits[0]).unsqueeze(1), torch.from_numpy(digits[1])
            n = 256  # images a step, drawn from the rank's own shard (with replacement: 1,797 images)
            per = len(x_all) // run.world

            def data(step):
                i = rank * per + torch.randint(0, per, (n,), generator=torch.Generator().manual_seed(step))
                return x_all[i], y_all[i]

            loss_of = F.cross_entropy
        ddp = DDP(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        faults_ = Injector([parse(run.inject, run.world)] if run.inject else [], rank)
        with agent.attach(ddp, opt, endpoint=endpoint, job=run.job, every=EVERY, nan_guard=run.nan_guard) as mon:
            for step in range(run.steps):
                faults_.train_step(step, model, ddp, opt, *data(step), loss_of, mon)
                progress[rank] = step + 1
        with open(os.path.join(out_dir, f"{run.job}.{rank}.json"), "w") as f:
            json.dump({"applied": faults_.applied}, f)
        del ddp, mon  # the DDP freed while its group is registered (see train_rank in commands/demo/run.py)
        gc.collect()
    finally:
        dist.destroy_process_group()


@dataclass
class Outcome:
    run: Run
    ok: bool
    wall_s: float
    applied: Optional[float]  # time.time() the fault was first applied
    findings: list = field(default_factory=list)  # raised events of this job, in order
    error: str = ""


def run_job(run: Run, endpoint: str, events_path: str, out_dir: str, digits, timeout_s: float) -> Outcome:
    """Run one job to its end (a stopped rank resumes itself after HOLD_S) and collect its findings."""
    ctx = mp.get_context("fork")  # torch is imported once, here; the ranks start at once
    progress = ctx.Array("i", run.world, lock=False)
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, run, port, endpoint, progress, out_dir, digits), daemon=True)
             for r in range(run.world)]
    t0 = time.time()
    for p in procs:
        p.start()
    error = ""
    while any(p.is_alive() for p in procs):
        if time.time() - t0 > timeout_s:
            error = f"timed out after {timeout_s:.0f} s at steps {list(progress)}"
            break
        time.sleep(0.05)
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
        p.join(5)
    if not error and any(p.exitcode != 0 for p in procs):
        error = f"rank exit codes {[p.exitcode for p in procs]}"
    time.sleep(LINGER_S)
    times = []  # when each rank first applied the fault
    for r in range(run.world):
        try:
            with open(os.path.join(out_dir, f"{run.job}.{r}.json")) as f:
                times += json.load(f)["applied"].values()
        except OSError:
            pass
    found = []
    with open(events_path) as f:
        for line in f:
            e = json.loads(line)
            if e["job"] == run.job and e["event"] == "raised":
                found.append({k: e[k] for k in ("check", "rank", "layer", "step", "time", "summary")})
    return Outcome(run, not error, time.time() - t0, min(times, default=None), found, error)


# --- the matrix ---------------------------------------------------------------------------------


def plan(worlds, models, loads, repeats, names: Optional[set], steps_at=STEPS_AT,
         clean_runs: int = CLEAN_RUNS, nan_guard: str = "on") -> list[tuple[Run, Fault]]:
    """Every run of the matrix, in order (grouped by load, so hogs start and stop once per load)."""
    runs = []
    for load in loads:
        for rep in range(repeats):
            for world in worlds:
                for model in models:
                    variants = [f for f in faults(model) if world >= f.min_world]
                    if names is not None:
                        variants = [f for f in variants if f.name in names]
                    for i, f in enumerate(variants):
                        k = i + rep + world  # rotates rank and step over repeats and variants
                        rank = None if f.all_ranks else (0 if k % 2 == 0 else world - 1)
                        step = steps_at[(k // 2) % len(steps_at)]
                        spec = f"{f.spec.split(':')[0]}@{step}" + "".join(":" + o for o in f.spec.split(":")[1:])
                        spec += ":rank=all" if f.all_ranks else f":rank={rank}"
                        post = POST["straggler"] if f.expect == "straggler" else POST["default"]
                        job = f"fm-{load}-r{rep}-w{world}-{model}-{f.name}"
                        runs.append((Run(job, model, world, load, rep, f.name, spec, rank, step, step + post, nan_guard), f))
                    if names is None or "clean" in names:
                        for c in range(clean_runs):
                            job = f"fm-{load}-r{rep}-w{world}-{model}-clean{c}"
                            runs.append((Run(job, model, world, load, rep, "clean", "", None, None,
                                             max(steps_at) + POST["straggler"], nan_guard), CLEAN))
    return runs


def _true(f: Fault, run: Run, e: dict) -> bool:
    """A finding belongs to the injected fault: its check is meant for it or reports its knock-on
    effects, and it names the injected rank or none."""
    if not f.expect or e["check"] not in (f.expect, *f.allow):
        return False
    return e["rank"] is None or run.rank is None or e["rank"] == run.rank


def _attributable(f: Fault, run: Run) -> bool:
    """Whether a finding can name the injected rank: a majority of two does not exist."""
    return not (f.vote and run.world < 3)


def _rank_ok(f: Fault, run: Run, e: dict) -> bool:
    return e["rank"] is None if f.all_ranks else e["rank"] == run.rank


def _attributed(f: Fault, run: Run, e: dict) -> bool:
    return _rank_ok(f, run, e) and (not f.layer or e["layer"] == f.layer)


def _q(xs: list[float], q: float) -> Optional[float]:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, math.ceil(q * len(xs)) - 1)]  # nearest rank


def score(outcomes: list[Outcome], fault_of: dict[str, Fault]) -> dict:
    """Per check and per fault: counts and the figures of the module docstring."""
    checks: dict[str, dict] = {}
    per_fault: dict[str, dict] = {}

    def c(name):
        return checks.setdefault(name, {"runs": 0, "detected": 0, "attributable": 0, "attributed": 0,
                                        "rank_attributed": 0, "findings": 0, "true": 0,
                                        "clean_findings": 0, "steps_to_detect": [], "seconds_to_detect": []})

    clean_steps = 0
    for o in outcomes:
        if not o.ok:
            continue
        f = fault_of[o.run.job]
        for e in o.findings:
            s = c(e["check"])
            s["findings"] += 1
            s["true"] += _true(f, o.run, e)
            if f is CLEAN:
                s["clean_findings"] += 1
        if f is CLEAN:
            clean_steps += o.run.steps
            continue
        s = c(f.expect)
        s["runs"] += 1
        pf = per_fault.setdefault(f.name, {"check": f.expect, "runs": 0, "found": 0, "detected": 0, "attributable": 0,
                                           "attributed": 0, "rank_attributed": 0, "extra_findings": 0,
                                           "steps_to_detect": [], "seconds_to_detect": []})
        pf["runs"] += 1
        pf["found"] += any(_true(f, o.run, e) for e in o.findings)  # by its check or a knock-on one
        hit = next((e for e in o.findings if e["check"] == f.expect and _true(f, o.run, e)), None)
        pf["extra_findings"] += len(o.findings) - (hit is not None)
        if hit is None:
            continue
        for d in (s, pf):
            d["detected"] += 1
            if _attributable(f, o.run):
                d["attributable"] += 1
                d["attributed"] += _attributed(f, o.run, hit)
                d["rank_attributed"] += _rank_ok(f, o.run, hit)
            if f.expect not in TIME_BASED and hit["step"] is not None and hit["step"] >= 0:
                d["steps_to_detect"].append(hit["step"] - o.run.step)
            if o.applied is not None:
                d["seconds_to_detect"].append(hit["time"] - o.applied)
    for d in [*checks.values(), *per_fault.values()]:
        d["recall"] = d["detected"] / d["runs"] if d["runs"] else None
        d["attribution"] = d["attributed"] / d["attributable"] if d["attributable"] else None
        d["rank_attribution"] = d["rank_attributed"] / d["attributable"] if d["attributable"] else None
        for k in ("steps_to_detect", "seconds_to_detect"):
            d[k.replace("_to_detect", "_p50")] = _q(d[k], 0.5)
            d[k.replace("_to_detect", "_p95")] = _q(d[k], 0.95)
    for d in checks.values():
        d["precision"] = d["true"] / d["findings"] if d["findings"] else None
        d["false_per_1000_clean_steps"] = 1000 * d["clean_findings"] / clean_steps if clean_steps else None
    return {"checks": checks, "faults": per_fault, "clean_steps": clean_steps}


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f} %"


def _num(x, fmt="{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def table(scores: dict) -> str:
    """The markdown tables: per check, then per fault."""
    lines = [
        "| check | fault runs | recall | precision | attribution | steps to detect p50 / p95 | seconds p50 / p95 | false per 1000 clean steps |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, d in sorted(scores["checks"].items()):
        lines.append(
            f"| `{name}` | {d['runs']} | {_pct(d['recall'])} | {_pct(d['precision'])} ({d['true']}/{d['findings']}) | "
            f"{_pct(d['attribution'])} | {_num(d['steps_p50'], '{:.0f}')} / {_num(d['steps_p95'], '{:.0f}')} | "
            f"{_num(d['seconds_p50'])} / {_num(d['seconds_p95'])} | {_num(d['false_per_1000_clean_steps'], '{:.2f}')} |"
        )
    lines += [
        "",
        "| fault | check | runs | recall | found by any check | attribution (rank only) | other findings per run | steps p50 / p95 | seconds p50 / p95 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, d in scores["faults"].items():
        lines.append(
            f"| {name} | `{d['check']}` | {d['runs']} | {_pct(d['recall'])} | {_pct(d['found'] / d['runs'])} | "
            f"{_pct(d['attribution'])} "
            f"({_pct(d['rank_attribution'])}) | "
            f"{d['extra_findings'] / d['runs']:.2f} | {_num(d['steps_p50'], '{:.0f}')} / {_num(d['steps_p95'], '{:.0f}')} | "
            f"{_num(d['seconds_p50'])} / {_num(d['seconds_p95'])} |"
        )
    lines.append(f"\nclean job-steps: {scores['clean_steps']}")
    return "\n".join(lines)


def collect(runs: list[tuple[Run, Fault]], tmp: str) -> list[Outcome]:
    """Outcomes of the planned runs that completed in ``tmp`` (every rank wrote its file), from the
    event log left there: scores a matrix that was stopped early."""
    events: dict[str, list] = {}
    with open(os.path.join(tmp, "events.jsonl")) as f:
        for line in f:
            e = json.loads(line)
            if e["event"] == "raised":
                events.setdefault(e["job"], []).append({k: e[k] for k in ("check", "rank", "layer", "step", "time", "summary")})
    out = []
    for run, _ in runs:
        files = [os.path.join(tmp, f"{run.job}.{r}.json") for r in range(run.world)]
        if not all(os.path.exists(p) for p in files):
            continue
        times = [t for p in files for t in json.load(open(p))["applied"].values()]
        out.append(Outcome(run, True, math.nan, min(times, default=None), events.get(run.job, [])))
    return out


def load(paths: list[str]) -> tuple[list[Outcome], dict[str, Fault]]:
    """The outcomes of the runs saved by ``--json`` in ``paths``, and each job's fault (a job name
    is unique across files: it names load, repeat, world, model and fault)."""
    outcomes, fault_of = [], {}
    known = {f.name: f for m in NAN_LAYERS for f in faults(m)}
    for path in paths:
        with open(path) as fp:
            for r in json.load(fp)["runs"]:
                fields = {k: r[k] for k in Run.__dataclass_fields__ if k in r}
                run = Run(**fields)
                if run.job in fault_of:
                    raise SystemExit(f"{path}: job {run.job} also in an earlier file")
                model_faults = {f.name: f for f in faults(run.model)}
                fault_of[run.job] = CLEAN if run.fault == "clean" else model_faults.get(run.fault, known.get(run.fault))
                outcomes.append(Outcome(run, r["ok"], r.get("wall_s", math.nan), r["applied"], r["findings"], r.get("error", "")))
    return outcomes, fault_of


def start_aggregator(events_path: str, log_path: str, extra=()) -> AggregatorProcess:
    """The real aggregator process at default thresholds; ranks forgotten 20 s after their goodbye
    so the matrix's many jobs never fill ``max_jobs``."""
    try:
        return AggregatorProcess("--events-path", events_path, "--rank-ttl-s", "20", *extra, log=log_path)
    except RuntimeError as e:
        raise SystemExit(str(e)) from None


def hogs(n: int) -> list[subprocess.Popen]:
    """``n`` processes spinning on the CPUs (the busy load)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", default="2,3,4,8", help="comma list of world sizes (default 2,3,4,8)")
    p.add_argument("--models", default="gpt,cnn", help="comma list of: gpt, cnn")
    p.add_argument("--load", default="idle,busy", help="comma list of: idle, busy (two CPU-spinning processes)")
    p.add_argument("--faults", help="comma list of fault names (default all, and clean); see the module docstring")
    p.add_argument("--repeats", type=int, default=1, help="repeats of every cell (default 1)")
    p.add_argument("--clean-runs", type=int, default=CLEAN_RUNS, help=f"clean runs per cell (default {CLEAN_RUNS})")
    p.add_argument("--at", default=",".join(map(str, STEPS_AT)),
                   help="comma list of injection steps the runs rotate over (default 30,35: probed and not)")
    p.add_argument("--quick", action="store_true",
                   help=f"world 2, cnn, idle, faults {','.join(QUICK_FAULTS)} and clean: a smoke test")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds one run may take before it is killed and counted as failed")
    p.add_argument("--json", metavar="PATH", help="write runs, findings and scores as JSON to PATH")
    p.add_argument("--from-dir", metavar="DIR",
                   help="run nothing: score the runs that completed in DIR, the directory a matrix with the same "
                   "selection flags printed (one stopped early)")
    p.add_argument("--nan-guard", choices=("on", "off", "auto"), default="on",
                   help="the agents' nan_guard (default on: a forward NaN is located at any step; 'auto' would "
                   "still be measuring itself at the injection steps, so it reads as on here)")
    p.add_argument("--from-json", nargs="+", metavar="PATH",
                   help="run nothing: score together the runs of these --json files (e.g. a matrix run in parts)")
    p.add_argument("--aggregator-arg", action="append", default=[], metavar="ARG",
                   help="extra aggregator argument, e.g. --aggregator-arg=--checks.straggler-score=0.8 (repeatable; "
                   "the published figures use none: default thresholds)")
    a = p.parse_args(argv)
    if a.quick:
        a.worlds, a.models, a.load, a.faults = "2", "cnn", "idle", ",".join((*QUICK_FAULTS, "clean"))
    worlds = [int(w) for w in a.worlds.split(",")]
    models = a.models.split(",")
    loads = a.load.split(",")
    names = set(a.faults.split(",")) if a.faults else None
    known = {f.name for m in NAN_LAYERS for f in faults(m)} | {"clean"}
    if bad := [x for x in [*models] if x not in NAN_LAYERS] + [x for x in loads if x not in ("idle", "busy")] \
            + sorted((names or set()) - known):
        raise SystemExit(f"unknown: {bad}; faults are {sorted(known)}")
    runs = plan(worlds, models, loads, a.repeats, names, tuple(int(x) for x in a.at.split(",")), a.clean_runs, a.nan_guard)
    fault_of = {r.job: f for r, f in runs}
    if a.from_json:
        outcomes, fault_of = load(a.from_json)
        print(f"{len(outcomes)} runs from {', '.join(a.from_json)}\n")
        scores = score(outcomes, fault_of)
        print(table(scores))
        if a.json:
            with open(a.json, "w") as fp:
                json.dump({"env": {"from_json": a.from_json}, "scores": scores}, fp, indent=1)
        return 0
    if a.from_dir:
        outcomes = collect(runs, a.from_dir)
        print(f"{len(outcomes)} of {len(runs)} runs completed in {a.from_dir}\n")
        scores = score(outcomes, fault_of)
        print(table(scores))
        if a.json:
            with open(a.json, "w") as fp:
                json.dump({"env": {"from_dir": a.from_dir, "argv": sys.argv[1:]}, "scores": scores,
                           "runs": [dict(asdict(o.run), ok=o.ok, applied=o.applied, findings=o.findings)
                                    for o in outcomes]}, fp, indent=1)
        return 0
    digits = _digits() if "cnn" in models else None
    tmp = tempfile.mkdtemp(prefix="faultmatrix-")
    events = os.path.join(tmp, "events.jsonl")
    agg = start_aggregator(events, os.path.join(tmp, "aggregator.log"), a.aggregator_arg)
    endpoint = agg.endpoint
    print(f"gradwatch fault matrix: {len(runs)} runs; aggregator {endpoint}; events {events}", flush=True)
    outcomes: list[Outcome] = []
    spinning: list[subprocess.Popen] = []
    t0 = time.time()
    try:
        for i, (run, f) in enumerate(runs):
            want = 2 if run.load == "busy" else 0
            if len(spinning) != want:
                for h in spinning:
                    h.kill()
                    h.wait()
                spinning = hogs(want)
            o = run_job(run, endpoint, events, tmp, digits, a.timeout)
            outcomes.append(o)
            hit = [e for e in o.findings if e["check"] == f.expect]
            print(f"[{i + 1}/{len(runs)}] {run.job} {run.inject or 'clean'}: {o.wall_s:.0f} s, "
                  f"{'ERROR ' + o.error if not o.ok else ''}findings "
                  f"{[(e['check'], e['rank'], e['layer'], e['step']) for e in o.findings]}"
                  + ("" if f is CLEAN or hit else "  MISSED"), flush=True)
    finally:
        for h in spinning:
            h.kill()
        agg.stop()
    scores = score(outcomes, fault_of)
    print()
    print(table(scores))
    failed = [o.run.job for o in outcomes if not o.ok]
    print(f"\n{len(outcomes)} runs ({len(failed)} failed{': ' + ', '.join(failed) if failed else ''}) in "
          f"{time.time() - t0:.0f} s; load average at the end {os.getloadavg()[0]:.1f}")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        env = {"torch": torch.__version__, "aggregator_args": a.aggregator_arg, "nan_guard": a.nan_guard,
               "python": platform.python_version(), "cpu_count": os.cpu_count(),
               "argv": sys.argv[1:], "wall_s": time.time() - t0}
        with open(a.json, "w") as fp:
            json.dump({"env": env, "scores": scores,
                       "runs": [dict(asdict(o.run), ok=o.ok, error=o.error, wall_s=o.wall_s, applied=o.applied,
                                     findings=o.findings) for o in outcomes]}, fp, indent=1)
        print(f"wrote {a.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
