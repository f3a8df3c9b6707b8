"""Part 4, distributed on one GPU: DDP over NCCL with one rank, and two ranks on the one device over
gloo with CUDA tensors (NCCL refuses two ranks on one device), reporting to a real aggregator.

The aggregator is ``python -m gradwatch.aggregator`` (run through bench.gpu) in its own process on loopback at default
thresholds, writing its findings to a JSON-lines event log. Each job's ranks are processes
(``spawn``: CUDA forbids fork after it started) training the demo's GPT in DDP with the agent
attached (``every=5``, NaN guard on), with faults injected by the demo's injector
(``gradwatch.commands.demo.inject``, never through the agent) on the last rank: the loss times 1e6
at step ``EXPLODE``, and a NaN output of ``NAN_LAYER`` at step ``NAN`` (a probed step). After step
``CHECK`` every rank writes its float64 references and waits while the harness scrapes
``/metrics``: each rank's exported global gradient norm (``gradwatch_rank_grad_norm``) against
the float64 norm of the gradients its optimizer stepped with (the same tensors: rel 1e-6), and its
local norm (``gradwatch_rank_local_grad_norm``, before all-reduce) against the float64 norm of the
gradient of the rank's own batch taken on an agent-free twin of the model (other kernels' order
of summation: rel 1e-5). At the end: every step of every rank counted at the aggregator, and the
event log holds an ``explosion`` finding at ``EXPLODE`` and a ``nonfinite`` one at ``NAN``
naming the injected rank, the latter also the module. On the CPU only the gloo job runs, with
CPU tensors; the NCCL one is skipped.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

from bench.harness import AggregatorProcess, free_port

from .common import NEEDS_CUDA, Context, Part, gpt, lm_loss, norm64, rel_err, say, token_batch

TITLE = "distributed on one GPU: DDP over NCCL (one rank), two ranks over gloo with CUDA tensors, a real aggregator"
STEPS, EVERY, CHECK, EXPLODE, NAN = 30, 5, 8, 12, 25
NAN_LAYER = "blocks.0.mlp.fc"
SIZES = {"cuda": dict(width=128, layers=2, heads=4, context=64, batch=8),
         "cpu": dict(width=32, layers=2, heads=2, context=32, batch=4)}


def _rank_main(rank: int, job: str, backend: str, world: int, port: int, endpoint: str, device: str, out_dir: str,
               resume) -> None:
    """One rank: train ``STEPS`` steps with the agent attached and the faults injected on the last
    rank; write its references after step ``CHECK`` and wait for ``resume``."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), TORCHELASTIC_RUN_ID=job,
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import datetime

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradwatch import agent as gw
    from gradwatch.commands.demo.inject import Injector, parse

    torch.set_num_threads(1)
    cuda = device == "cuda"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    kw = {"device_id": dev} if backend == "nccl" else {}
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120), **kw)
    size = SIZES[device]
    status = {"rank": rank, "job": job}
    try:
        torch.manual_seed(0)
        model = gpt(size["width"], size["layers"], size["heads"], size["context"]).to(dev)
        twin = gpt(size["width"], size["layers"], size["heads"], size["context"]).to(dev)  # never hooked
        ddp = DDP(model, device_ids=[0] if cuda else None)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        last = world - 1
        faults = Injector([parse(f"explode@{EXPLODE}:rank={last}", world),
                           parse(f"nan@{NAN}:layer={NAN_LAYER}:rank={last}", world)], rank)
        now = {"step": -1}

        def reference(o, args, kwargs):  # the gradients the optimizer steps with (after all-reduce)
            if now["step"] == CHECK:
                status["global"] = norm64([p.grad for p in model.parameters() if p.grad is not None])

        handle = opt.register_step_pre_hook(reference)
        with gw.attach(ddp, opt, endpoint=endpoint, job=job, every=EVERY, nan_guard="on", heartbeat_s=0.5) as mon:
            for step in range(STEPS):
                now["step"] = step
                x, y = token_batch(256, size["batch"], size["context"], dev, seed=1_000 * rank + step)
                if step == CHECK:  # this rank's own gradient before all-reduce, on the twin
                    twin.load_state_dict(model.state_dict())
                    grads = torch.autograd.grad(lm_loss(twin(x), y), list(twin.parameters()))
                    status["local"] = norm64(list(grads))
                faults.train_step(step, model, ddp, opt, x, y, lm_loss, mon)
                if step == CHECK:
                    _dump(os.path.join(out_dir, f"{job}.{rank}.check.json"), status)
                    if not resume.wait(90):
                        raise TimeoutError("the harness never read the metrics at the check step")
            status.update(steps=mon.step, probes=mon.probes, errors=mon.errors, disabled=sorted(mon.disabled),
                          applied=faults.applied)
        handle.remove()
        del ddp, mon
        import gc

        gc.collect()
    except BaseException as e:
        import traceback

        status["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    finally:
        _dump(os.path.join(out_dir, f"{job}.{rank}.json"), status)
        try:
            dist.destroy_process_group()
        except Exception:
            pass
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # gloo's teardown at interpreter exit may abort a finished rank (see commands/demo/run.py)


def _dump(path: str, obj) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, default=str)
    os.replace(path + ".tmp", path)


def _load(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


class Aggregator(AggregatorProcess):
    """``python -m gradwatch.aggregator`` on loopback, its findings appended to ``events``."""

    def __init__(self, work: str):
        self.events = os.path.join(work, "events.jsonl")
        # python -m gradwatch.aggregator, through bench.gpu (which makes the tree's rooms importable
        # where gradwatch is not installed)
        start = "import runpy, bench.gpu; runpy.run_module('gradwatch.aggregator', run_name='__main__', alter_sys=True)"
        super().__init__("--events-path", self.events, "--publish-interval-s", "0.05", "--round-grace-s", "3",
                         log=os.path.join(work, "aggregator.log"), command=(sys.executable, "-c", start))

    def samples(self, name: str, job: str) -> dict[int, float]:
        """``{rank: value}`` of the per-rank metric ``name`` for ``job`` at /metrics now."""
        from prometheus_client.parser import text_string_to_metric_families

        out = {}
        for fam in text_string_to_metric_families(self.get("/metrics")):
            for s in fam.samples:
                if s.name == name and s.labels.get("job_id") == job and "rank" in s.labels:
                    out[int(s.labels["rank"])] = s.value
        return out

    def raised(self, job: str) -> list[dict]:
        out = []
        try:
            with open(self.events) as f:
                for line in f:
                    e = json.loads(line)
                    if e["job"] == job and e["event"] == "raised":
                        out.append({k: e[k] for k in ("check", "rank", "layer", "step", "summary")})
        except OSError:
            pass
        return out


def run(ctx: Context, part: Part) -> None:
    import tempfile

    import torch.multiprocessing as mp

    jobs = [("gloo2", "gloo", 2)]
    if ctx.cuda:
        jobs.insert(0, ("nccl1", "nccl", 1))
    else:
        part.skip("DDP over NCCL, one rank: reports, exported norms, findings", NEEDS_CUDA)
    work = tempfile.mkdtemp(prefix="gradwatch-gpu-ddp-")
    agg = Aggregator(work)
    mpc = mp.get_context("spawn")
    procs: dict[str, list] = {}
    resume: dict = {}
    try:
        for job, backend, world in jobs:
            resume[job] = mpc.Event()
            port = free_port()
            procs[job] = [mpc.Process(target=_rank_main, args=(r, job, backend, world, port, agg.endpoint, ctx.device,
                                                               work, resume[job]), daemon=True) for r in range(world)]
            for p in procs[job]:
                p.start()
        say(f"  [distributed] {sum(len(v) for v in procs.values())} ranks started, aggregator at {agg.endpoint}")
        pending = {job: world for job, _, world in jobs}
        checked: dict[str, dict] = {}
        while pending and ctx.left() > 5:
            for job, world in list(pending.items()):
                refs = [_load(os.path.join(work, f"{job}.{r}.check.json")) for r in range(world)]
                done = [_load(os.path.join(work, f"{job}.{r}.json")) for r in range(world)]
                if any(d is not None and "error" in d for d in done):
                    checked[job] = {"error": [d.get("error") for d in done if d]}
                    pending.pop(job)
                    resume[job].set()
                    continue
                if None in refs:
                    continue
                steps = agg.samples("gradwatch_rank_step", job)
                if len(steps) < world or any(steps.get(r) != CHECK for r in range(world)):
                    continue
                checked[job] = {"refs": refs, "global": agg.samples("gradwatch_rank_grad_norm", job),
                                "local": agg.samples("gradwatch_rank_local_grad_norm", job)}
                pending.pop(job)
                resume[job].set()
            time.sleep(0.05)
        for job in pending:
            checked[job] = {"error": f"the ranks did not reach step {CHECK} at the aggregator in time"}
            resume[job].set()
        for job, plist in procs.items():
            for p in plist:
                p.join(max(1.0, ctx.left() - 8))
        time.sleep(2.0)  # the aggregator's last rounds and checks
        for job, backend, world in jobs:
            _judge(part, agg, job, backend, world, checked.get(job, {}),
                   [_load(os.path.join(work, f"{job}.{r}.json")) or {} for r in range(world)])
    finally:
        for plist in procs.values():
            for p in plist:
                if p.is_alive():
                    p.kill()
        agg.stop()
    part.numbers["aggregator_log_tail"] = agg.tail(1500)


def _judge(part: Part, agg: Aggregator, job: str, backend: str, world: int, checked: dict, ranks: list[dict]) -> None:
    what = f"{backend}, {world} rank{'s' if world > 1 else ''}"
    errors = [r.get("error") for r in ranks if r.get("error")] + ([checked["error"]] if "error" in checked else [])
    steps = agg.samples("gradwatch_rank_steps_total", job)
    part.numbers[job] = {"ranks": ranks, "exported": {k: v for k, v in checked.items() if k != "refs"},
                         "steps_total": steps}
    part.check(f"{what}: every rank trained {STEPS} steps without error and the aggregator counted each",
               not errors and all(r.get("steps") == STEPS and r.get("errors") == 0 for r in ranks)
               and all(steps.get(r) == STEPS for r in range(world)),
               value={"steps counted": steps, "agent errors": [r.get("errors") for r in ranks]},
               detail="; ".join(str(e)[:400] for e in errors))
    if "refs" in checked:
        got_g, got_l = checked["global"], checked["local"]
        want = {r["rank"]: r for r in checked["refs"]}
        errs_g = {r: rel_err(got_g.get(r, math.nan), want[r]["global"]) for r in want}
        errs_l = {r: rel_err(got_l.get(r, math.nan), want[r]["local"]) for r in want}
        part.check(f"{what}: exported global gradient norm at step {CHECK} equals each rank's float64 reference",
                   all(e <= 1e-6 for e in errs_g.values()), value={"rel_err": errs_g, "exported": got_g},
                   target="rel 1e-6")
        part.check(f"{what}: exported local (pre-all-reduce) norm at step {CHECK} equals each rank's own gradient's",
                   all(e <= 1e-5 for e in errs_l.values()), value={"rel_err": errs_l, "exported": got_l},
                   target="rel 1e-5 (twin model)")
    found = agg.raised(job)
    part.numbers[job]["findings"] = found
    last = world - 1
    boom = [f for f in found if f["check"] == "explosion"]
    nan = [f for f in found if f["check"] == "nonfinite"]
    part.check(f"{what}: the explosion at step {EXPLODE} is found, naming rank {last}",
               bool(boom) and boom[0]["rank"] == last and boom[0]["step"] == EXPLODE, value=boom[:1],
               target={"rank": last, "step": EXPLODE})
    part.check(f"{what}: the NaN at step {NAN} is found, naming rank {last} and module {NAN_LAYER}",
               bool(nan) and nan[0]["rank"] == last and nan[0]["layer"] == NAN_LAYER and nan[0]["step"] == NAN,
               value=nan[:1], target={"rank": last, "layer": NAN_LAYER, "step": NAN},
               detail=f"other findings: {[(f['check'], f['rank'], f['step']) for f in found if f not in boom[:1] + nan[:1]]}")
