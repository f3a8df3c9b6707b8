"""Load benchmark of the aggregator at fleet scale.

Sender processes (``multiprocessing``) play many simulated ranks of one or more healthy jobs: each
builds real wire frames with :func:`gradwatch.wire.encode` as the agent sends them (a schema per
rank at start, resent after ``--schema-every-s`` and then at doubling intervals up to 32 times
that, each up to its gap late at random, up to world / 1,024 times it past 1,024 ranks
(:func:`gradwatch.agent.transport.schema_spread`); the records of ``--coalesce`` consecutive unprobed steps per rank in one ``steps`` message, a
probe report every ``--every``-th step, after the pending records; a heartbeat per rank every
``--heartbeat-s`` unless the rank sent something within it) and pushes them over ZeroMQ to a real
aggregator process (``python -m gradwatch.aggregator``). The main process scrapes ``/metrics``
every ``--poll-s`` and reads the aggregator's RSS from ``/proc``.

Measured:

* **absorbed**: messages per second the aggregator counted, received or rejected, from its own
  ``gradwatch_messages_{received,rejected}_total``, and rank-steps per second it applied (its
  ``gradwatch_rank_steps_total`` summed over ranks, or ``gradwatch_job_steps_total``), between the
  first and last scrape while senders ran;
* **freshness**: per step, from the moment the last sender finished sending that step (wall clock,
  one machine) to the first scrape whose ``gradwatch_rank_step`` of every rank of the job has
  reached it (resolution: ``--poll-s`` plus one scrape); its p99 also over the steps sent
  ``--warmup-s`` or more after the job's first (the job's start puts every schema, the first
  probed step and the aggregator's first memory growth together);
* **scrape**: wall time, bytes and samples of each ``/metrics`` response;
* **RSS** of the aggregator over time (``VmRSS``);
* **accounting**: messages sent per kind against received per kind plus rejected by reason once
  the aggregator drained (none may be lost silently), active findings (none on a healthy job).

Two modes: ``--steps-per-s 0`` (the default) sends as fast as the senders can (max throughput;
ZeroMQ sends block at the high-water mark, so nothing is dropped on the way), ``--steps-per-s R``
paces every rank at R steps per second (freshness under a steady load).

``--inprocess`` instead feeds pre-encoded frames straight to ``Aggregator.handle`` in this process
(no sockets; the receive thread's work: decode, state, checks, reconcile; with ``--scrape`` also
the snapshot and the /metrics text once per step), optionally under cProfile (``--profile``): the
figures bench/README.md quotes per frame. Heartbeats (``--heartbeat-s`` > 0) go one per rank and step.

Usage::

    .venv/bin/python bench/load.py --ranks 64 --layers 100 --duration 30
    .venv/bin/python bench/load.py --ranks 4096 --layers 100 --steps-per-s 1 --layer-depth 2 --duration 60
    .venv/bin/python bench/load.py --ranks 256 --layers 100 --inprocess --reports 20000 --profile
    .venv/bin/python bench/load.py ... --json bench/results/load.json
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import multiprocessing as mp
import os
import re
import signal
import sys
import time
import urllib.request
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from typing import Optional

import msgpack
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.harness import AggregatorProcess  # noqa: E402
from gradwatch import wire  # noqa: E402
from gradwatch.agent.transport import SCHEMA_BACKOFF, SCHEMA_JITTER, schema_spread  # noqa: E402  (no torch)

#: distinct activation rows among a job's ranks (a prime: no alignment with --tp)
VARIANTS = 251

SUBS = ("ln_1", "attn.qkv", "attn.proj", "ln_2", "mlp.fc", "mlp.proj")


# --- the simulated job -------------------------------------------------------------------------


def model_layers(n: int) -> list[str]:
    """``n`` leaf modules of a GPT-style model: embed, blocks of 6, head (module paths)."""
    body = max(n - 2, 0)
    names = ["embed", *(f"blocks.{i // 6}.{SUBS[i % 6]}" for i in range(body)), "head"]
    return names[:n]


@dataclass
class Job:
    """One simulated job: its id, key and world size, and the frames' fixed parts."""

    name: str
    world: int
    layers: int
    #: tensor-parallel degree: > 0 makes the ranks a ("dp", "tp") device mesh with every parameter
    #: sharded along "tp", as FSDP2 or tensor parallelism reports it (one schema, each rank's place
    #: in its headers)
    tp: int = 0

    def __post_init__(self):
        mods = model_layers(self.layers)
        self.params = tuple(p for m in mods for p in ((f"{m}.weight", (64, 64), "float32"),
                                                      (f"{m}.bias", (64,), "float32")))
        self.slots = tuple((m, "", "Linear", "float32") for m in mods)
        self.mesh, self.shard = None, ()
        if self.tp:
            if self.world % self.tp:
                raise ValueError(f"--tp {self.tp} does not divide {self.world} ranks")
            self.mesh, self.shard = wire.Mesh(("dp", "tp"), (self.world // self.tp, self.tp)), tuple((1,) for _ in self.params)
        self.hash = wire.schema_hash(self.params, self.slots, self.mesh, self.shard)
        n_s, n_p = len(self.slots), len(self.params)
        # healthy (all-reduced gradients, replicas in sync): no check fires. Each rank's
        # activations and their gradients differ a little, as ranks reading different data do
        # (bounded noise, far from any outlier threshold): identical rows would make the medians
        # over ranks unrealistically cheap to sort. VARIANTS of them, chosen by rank.
        act = np.tile(np.array([0.0, 1.0, -3.0, 3.0, 0.1, 0.0], np.float32), (n_s, 1))
        act_grad = np.tile(np.array([0.5, 0.0], np.float32), (n_s, 1))
        rng = np.random.default_rng(len(self.name) + self.world)
        u = lambda a, scale: (a + rng.uniform(-1, 1, (VARIANTS, *a.shape)) * np.array(scale)).astype(np.float32)  # noqa: E731
        self.acts = u(act, [0.01, 0.01, 0.03, 0.03, 0.0, 0.0])
        self.act_grads = u(act_grad, [0.005, 0.0])
        self.act_count = np.tile(np.array([1.0, 4096.0], np.float32), (n_s, 1))
        self.param = np.tile(np.array([0.1, 8.0, 0.0], np.float32), (n_p, 1))
        self.fp = np.arange(1, n_p + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)


    def coord(self, rank: int) -> tuple:
        """A rank's place on the mesh (its headers carry it); () without one."""
        return (rank // self.tp, rank % self.tp) if self.tp else ()

    def grad_sq(self, g: float) -> Optional[tuple]:
        """A rank's sum of squares of its tp shard when the global norm is ``g`` (None without a mesh)."""
        return (((1,), g * g / self.tp),) if self.tp else None


def _header(job: Job, rank: int, seq: int) -> wire.Header:
    return wire.Header(job.name, rank, job.world, f"b{rank:x}", seq, time.time(), key=f"k-{job.name}", coord=job.coord(rank))


def schema_frame(job: Job, rank: int, seq: int) -> bytes:
    return wire.encode(wire.Schema(_header(job, rank, seq), "host", rank % 8, 0, job.params, job.slots,
                                   mesh=job.mesh, shard=job.shard))


def report_frame(job: Job, rank: int, seq: int, step: int, probe: bool, step_s: float) -> bytes:
    g = 1.0 + 0.01 * math.sin(step)  # the same global norm on every rank, no spike
    extra = dict(act=job.acts[rank % VARIANTS], act_grad=job.act_grads[rank % VARIANTS], param=job.param, act_count=job.act_count,
                 fp_grad=job.fp + np.uint64(step), fp_weight=job.fp + np.uint64(2 * step)) if probe else {}
    return wire.encode(wire.Report(
        _header(job, rank, seq), job.hash, step, step_s, g, 0, micro=1, probe=probe, grad_sq=job.grad_sq(g),
        local_grad_norm=g * math.sqrt(job.world) * (1 + 0.01 * ((rank * 7919) % 11 - 5) / 5),
        compute_time=0.05, loss=2.0, batch=8, probe_interval=0, **extra,
    ))


#: a frame of a protocol version nobody speaks: rejected as "version" (``--junk``)
JUNK = msgpack.packb({"v": 99, "kind": "report"})


def steps_frame(job: Job, rank: int, seq: int, steps: list[int], step_s: float) -> bytes:
    """The coalesced records of ``steps`` (unprobed, consecutive) of one rank, as the agent sends them."""
    s = np.asarray(steps, np.int64)
    n = len(s)
    g = 1.0 + 0.01 * np.sin(s)  # the same global norm on every rank, no spike
    sq = dict(grad_sq_dims=((1,),), grad_sq=(g * g / job.tp)[:, None]) if job.tp else {}
    return wire.encode(wire.Steps.columns(
        _header(job, rank, seq), job.hash, **sq, step=s, step_time=np.full(n, step_s), grad_norm=g,
        grad_nonfinite=np.zeros(n), local_grad_norm=g * math.sqrt(job.world) * (1 + 0.01 * ((rank * 7919) % 11 - 5) / 5),
        compute_time=np.full(n, 0.05), loss=np.full(n, 2.0), loss_scale=np.full(n, math.nan), skipped=np.zeros(n),
    ))


def heartbeat_frame(job: Job, rank: int, seq: int, step: int, sent: int) -> bytes:
    return wire.encode(wire.Heartbeat(_header(job, rank, seq), step, sent, 0, 0, in_step_s=0.01))


# --- senders ------------------------------------------------------------------------------------


@dataclass
class SenderResult:
    sent: dict = field(default_factory=dict)  # kind -> messages
    done: dict = field(default_factory=dict)  # job -> {step: wall time the sender finished it}
    last_step: dict = field(default_factory=dict)  # job -> last step sent
    cpu_s: float = 0.0


def die_with_parent(parent: int) -> None:
    """Have the kernel send this process SIGKILL when its parent (pid ``parent``) dies (Linux
    ``prctl``; nothing elsewhere): a bench killed mid-run must not leave its aggregator and senders
    loading the machine (a sender blocked at the high-water mark of a dead aggregator waits
    forever)."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before the request: nobody would send the signal
        os._exit(1)


def sender_main(idx: int, args, endpoint: str, t0: float, out, parent: int) -> None:
    """Send the ranks ``i`` with ``i % senders == idx`` (over all jobs), step-major; ``parent``:
    the bench's pid (:func:`die_with_parent`)."""
    import zmq

    die_with_parent(parent)

    jobs = [Job(f"load{j}", args.ranks, args.layers, args.tp) for j in range(args.jobs)]
    mine = [(job, r) for job in jobs for r in range(job.world)
            if (jobs.index(job) * job.world + r) % args.senders == idx]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, 10_000)
    sock.setsockopt(zmq.LINGER, -1)  # every frame sent is delivered: the accounting relies on it
    sock.connect(endpoint)
    seq: dict = defaultdict(int)
    res = SenderResult(sent=Counter(), done={j.name: {} for j in jobs}, last_step={j.name: -1 for j in jobs})
    n_steps = math.ceil(args.reports / max(1, args.ranks * args.jobs)) if args.reports else None
    deadline = t0 + args.duration if not args.reports else math.inf

    sent_at = defaultdict(float)  # (job, rank) -> when it last sent anything

    def send(job, rank, frame, kind, records=0):
        sock.send(frame)  # blocks at the high-water mark: nothing dropped on the way
        seq[(job.name, rank)] += 1
        res.sent[kind] += 1
        res.sent["records"] += records
        sent_at[(job.name, rank)] = time.time()

    pending: list[int] = []  # steps recorded but not sent yet (the same for every rank of this sender)

    def flush(step_s):
        for job, r in mine:
            send(job, r, steps_frame(job, r, seq[(job.name, r)], pending, step_s), "steps", len(pending))
        t = time.time()
        for job in jobs:
            for s in pending:
                res.done[job.name][s] = t
            res.last_step[job.name] = pending[-1]
        pending.clear()

    while time.time() < t0:
        time.sleep(0.01)
    next_beat = time.time()
    rng = np.random.default_rng(idx)
    next_schema = {(job.name, r): next_beat for job, r in mine}  # each rank's own schedule, as agents keep it
    schema_gap = {k: args.schema_every_s for k in next_schema}
    spread = schema_spread(args.ranks)  # every job's world
    top = SCHEMA_BACKOFF * args.schema_every_s
    step = 0
    step_s = 1.0 / args.steps_per_s if args.steps_per_s > 0 else 0.1
    while (n_steps is None or step < n_steps) and time.time() < deadline:
        if args.steps_per_s > 0:
            wait = t0 + step / args.steps_per_s - time.time()
            if wait > 0:
                time.sleep(wait)
        now = time.time()
        for job, r in mine:  # as the agent does: at start, then after 10 s, 20 s, ... (at most 32x), each up to SCHEMA_JITTER (100 %) of its gap late, x world / 1,024 past 1,024 ranks (at most the top gap)
            k = (job.name, r)
            if now >= next_schema[k]:
                send(job, r, schema_frame(job, r, seq[k]), "schema")
                late = SCHEMA_JITTER * min(schema_gap[k] * spread, top) * rng.random()  # as Sender._send_schema
                next_schema[k] = now + schema_gap[k] + late
                schema_gap[k] = min(2 * schema_gap[k], top)
        if args.heartbeat_s > 0 and now >= next_beat:  # only ranks that sent nothing for heartbeat_s
            for job, r in mine:
                if now - sent_at[(job.name, r)] >= args.heartbeat_s:
                    s = seq[(job.name, r)]
                    send(job, r, heartbeat_frame(job, r, s, step - 1, s), "heartbeat")
            next_beat = now + args.heartbeat_s
        if args.every > 0 and step % args.every == 0:  # a probe travels with its step, after the pending ones
            if pending:
                flush(step_s)
            for job, r in mine:
                send(job, r, report_frame(job, r, seq[(job.name, r)], step, True, step_s), "report", 1)
            t = time.time()
            for job in jobs:
                res.done[job.name][step] = t
                res.last_step[job.name] = step
        else:
            pending.append(step)
            if len(pending) >= args.coalesce:
                flush(step_s)
        for _ in range(args.junk):  # frames the aggregator must reject and count (reason "version")
            sock.send(JUNK)
            res.sent["junk"] += 1
        step += 1
    if pending:
        flush(step_s)
    for job, r in mine:  # the goodbye agents send at the end of training
        s = seq[(job.name, r)]
        send(job, r, wire.encode(wire.Heartbeat(_header(job, r, s), step - 1, s, 0, 0, closing=True, reason="finished")),
             "heartbeat")
    res.cpu_s = time.process_time()
    res.sent = dict(res.sent)
    sock.close()  # LINGER -1: waits until every queued frame went out
    ctx.term()
    out.put(asdict(res))


# --- the aggregator process and its /metrics ----------------------------------------------------


_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})? (\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass
class Scrape:
    t: float  # wall time the response was complete
    seconds: float
    nbytes: int
    samples: int
    received: dict  # kind -> total
    rejected: dict  # reason -> total
    min_step: dict  # job -> lowest gradwatch_rank_step over its ranks (or gradwatch_job_rank_step{agg="min"})
    ranks: dict  # job -> ranks exporting a step (or gradwatch_job_ranks_reporting)
    findings: int  # gradwatch_check_status{status="finding"} == 1
    steps: float  # rank-steps applied: gradwatch_job_steps_total (or gradwatch_rank_steps_total) summed


def scrape(url: str) -> Scrape:
    t = time.time()
    body = urllib.request.urlopen(url, timeout=60).read()
    done = time.time()
    received, rejected, min_step, ranks = Counter(), Counter(), {}, Counter()
    job_min, reporting = {}, {}
    rank_steps = job_steps = 0.0
    samples = findings = 0
    for line in body.decode().splitlines():
        if not line or line[0] == "#":
            continue
        samples += 1
        m = _LINE.match(line)
        if not m:
            continue
        name, labels, value = m.groups()
        if name == "gradwatch_rank_step":
            lab = dict(_LABEL.findall(labels))
            j, v = lab["job_id"], float(value)
            min_step[j] = min(min_step.get(j, math.inf), v)
            ranks[j] += 1
        elif name == "gradwatch_job_rank_step" and 'agg="min"' in labels:  # above --rank-series-max
            job_min[dict(_LABEL.findall(labels))["job_id"]] = float(value)
        elif name == "gradwatch_rank_steps_total":
            rank_steps += float(value)
        elif name == "gradwatch_job_steps_total":
            job_steps += float(value)
        elif name == "gradwatch_job_ranks_reporting":
            reporting[dict(_LABEL.findall(labels))["job_id"]] = int(float(value))
        elif name == "gradwatch_messages_received_total":
            received[dict(_LABEL.findall(labels))["kind"]] = float(value)
        elif name == "gradwatch_messages_rejected_total" and float(value):  # every reason is shown, 0 until seen
            rejected[dict(_LABEL.findall(labels))["reason"]] = float(value)
        elif name == "gradwatch_check_status" and 'status="finding"' in labels and float(value) == 1:
            findings += 1
    # a job above --rank-series-max exports per-rank steps for named ranks only: its job-level min
    for j, v in job_min.items():
        min_step[j], ranks[j] = v, reporting.get(j, 0)
    return Scrape(done, done - t, len(body), samples, dict(received), dict(rejected), min_step, dict(ranks), findings,
                  job_steps or rank_steps)


def rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return math.nan


def pct(xs, q):
    return float(np.percentile(xs, q)) if len(xs) else math.nan


def run_socket(args) -> dict:
    settings = ["--layer-depth", str(args.layer_depth),
                *(["--rank-series-max", str(args.rank_series_max)] if args.rank_series_max else []), *args.agg_arg]
    try:
        agg = AggregatorProcess(*settings, log=args.log or os.devnull,
                                preexec_fn=functools.partial(die_with_parent, os.getpid()))
    except RuntimeError as e:
        raise SystemExit(str(e)) from None
    try:
        return _drive(args, agg.proc, agg.endpoint, agg.base_url)
    finally:
        agg.stop()


def _drive(args, proc, endpoint: str, base: str) -> dict:
    ctx = mp.get_context("spawn")  # no zmq context or aggregator state inherited
    out = ctx.Queue()
    t0 = time.time() + 1.0 + 0.2 * args.senders  # spawned senders import gradwatch first
    senders = [ctx.Process(target=sender_main, args=(i, args, endpoint, t0, out, os.getpid()), daemon=True)
               for i in range(args.senders)]
    for p in senders:
        p.start()
    scrapes: list[Scrape] = []
    rss: list[tuple[float, float]] = []
    results: list[dict] = []
    while len(results) < len(senders):
        ts = time.time()
        try:
            s = scrape(base + "/metrics")
            scrapes.append(s)
        except OSError as e:
            print(f"scrape failed: {e}", file=sys.stderr)
        rss.append((time.time() - t0, rss_mib(proc.pid)))
        while not out.empty():
            results.append(out.get())
        time.sleep(max(0.0, args.poll_s - (time.time() - ts)))
        if any(p.exitcode not in (None, 0) for p in senders):
            raise SystemExit("a sender failed")
    t_end = time.time()
    sending = [s for s in scrapes if t0 <= s.t <= t_end]
    sent = Counter()
    for r in results:
        sent.update(r["sent"])
    total_sent = sum(v for k, v in sent.items() if k != "records")
    # drain: until every message sent is counted, received or rejected (or the timeout says lost)
    deadline = time.time() + args.drain_s
    while True:
        last = scrape(base + "/metrics")
        scrapes.append(last)
        rss.append((time.time() - t0, rss_mib(proc.pid)))
        counted = sum(last.received.values()) + sum(last.rejected.values())
        if counted >= total_sent or time.time() > deadline:
            break
        time.sleep(args.poll_s)
    drained_at = time.time()
    # one publish interval later the snapshot holds the newest state
    time.sleep(0.6)
    last = scrape(base + "/metrics")
    findings = json.loads(urllib.request.urlopen(base + "/api/findings?active=1", timeout=30).read())["findings"]

    done: dict = defaultdict(dict)
    for r in results:
        for j, steps in r["done"].items():
            for s, t in steps.items():
                done[j][int(s)] = max(done[j].get(int(s), 0.0), t)
    fresh_by_step, warm = freshness(done, scrapes, args.ranks, args.warmup_s)
    fresh = [f for _, _, f in fresh_by_step]
    # the job's newest complete step: senders stop on their own (--duration), the slowest decides
    last_step = {j: min(r["last_step"][j] for r in results) for j in done}
    rec = {k: v for k, v in last.received.items()}
    # absorbed: counted by the aggregator while the senders ran (between first and last scrape)
    if len(sending) >= 2:
        a, b = sending[0], sending[-1]
        dt = b.t - a.t
        msgs = (sum(b.received.values()) + sum(b.rejected.values()) - sum(a.received.values()) - sum(a.rejected.values())) / dt
        reps = (b.steps - a.steps) / dt
    else:
        msgs = reps = math.nan
    sizes = [s.nbytes for s in scrapes]
    rss_v = [v for _, v in rss]
    return dict(
        mode="paced" if args.steps_per_s > 0 else "max", ranks=args.ranks, layers=args.layers, jobs=args.jobs,
        every=args.every, steps_per_s=args.steps_per_s, senders=args.senders, layer_depth=args.layer_depth,
        duration_s=round(t_end - t0, 2), drain_s=round(drained_at - t_end, 2),
        sent=dict(sent), received=rec, rejected=dict(last.rejected),
        lost=int(total_sent - sum(rec.values()) - sum(last.rejected.values())), rank_steps_applied=last.steps,
        absorbed_msgs_per_s=msgs, absorbed_reports_per_s=reps,
        offered_reports_per_s=sent.get("records", 0) / max(1e-9, t_end - t0),
        freshness_p50_s=pct(fresh, 50), freshness_p99_s=pct(fresh, 99), freshness_n=len(fresh),
        freshness_warm_p99_s=pct(warm, 99), freshness_warm_n=len(warm), warmup_s=args.warmup_s,
        # (job, step, seconds): which steps wait (e.g. after a probed one)
        freshness_by_step=[(j, step, round(f, 3)) for j, step, f in fresh_by_step],
        last_step_sent=last_step, last_step_visible=last.min_step, ranks_visible=last.ranks,
        scrape_p50_s=pct([s.seconds for s in scrapes], 50), scrape_max_s=max(s.seconds for s in scrapes),
        scrape_bytes=sizes[-1], scrape_samples=last.samples,
        rss_start_mib=rss_v[0] if rss_v else math.nan, rss_end_mib=rss_v[-1] if rss_v else math.nan,
        rss_max_mib=max(rss_v) if rss_v else math.nan, rss=[(round(t, 2), round(v, 1)) for t, v in rss],
        findings=[f"{f['check']}: {f['summary']}" for f in findings],
        sender_cpu_s=[round(r["cpu_s"], 2) for r in results], load_avg=os.getloadavg(),
    )


def freshness(done: dict, scrapes: list, ranks: int, warmup_s: float) -> tuple[list, list]:
    """Per job and step, the seconds from the last sender's finish of the step to the first scrape
    showing it on every rank.

    Args:
        done: ``{job: {step: wall time its last sender finished sending it}}``.
        scrapes: :class:`Scrape` in time order.
        ranks: ranks per job (a scrape counts once it shows every one).
        warmup_s: seconds from the job's first step on that :data:`warm` leaves out.

    Returns:
        ``[(job, step, seconds)]`` for each step a scrape showed, and the seconds of those sent
        ``warmup_s`` or more after the job's first step was (its start brings every schema, the
        first probed step and the aggregator's first memory growth at once).
    """
    by_step, warm = [], []
    for j, steps in done.items():
        seen = [(s.t, s.min_step.get(j, -1)) for s in scrapes if s.ranks.get(j, 0) == ranks]
        start, k = min(steps.values()), 0
        for step in sorted(steps):
            while k < len(seen) and seen[k][1] < step:
                k += 1
            if k < len(seen):
                f = max(0.0, seen[k][0] - steps[step])
                by_step.append((j, step, f))
                if steps[step] - start >= warmup_s:
                    warm.append(f)
    return by_step, warm


def run_inprocess(args) -> dict:
    """Pre-encode the frames, then time ``Aggregator.handle`` over them (optionally profiled)."""
    from prometheus_client import generate_latest

    from gradwatch.aggregator import Aggregator, load

    now = [0.0]
    extra = dict(rank_series_max=args.rank_series_max) if args.rank_series_max else {}
    agg = Aggregator(load(listen="tcp://127.0.0.1:0", layer_depth=args.layer_depth, **extra), clock=lambda: now[0])
    jobs = [Job(f"load{j}", args.ranks, args.layers, args.tp) for j in range(args.jobs)]
    n_steps = math.ceil((args.reports or 10_000) / (args.ranks * args.jobs))
    frames, kinds = [], Counter()
    seq: Counter = Counter()
    for job in jobs:
        for r in range(job.world):
            frames.append(schema_frame(job, r, seq[(job.name, r)]))
            seq[(job.name, r)] += 1
    kinds["schema"] = len(frames)
    per_step = []  # the frames of one flush round: every rank's pending records (or probe)
    pending: list[int] = []

    def flush(batch):
        for job in jobs:
            for r in range(job.world):
                batch.append(steps_frame(job, r, seq[(job.name, r)], pending, 0.1))
                seq[(job.name, r)] += 1
        kinds["steps"] += args.ranks * args.jobs
        kinds["sentinel"] += len(pending) * args.ranks * args.jobs
        pending.clear()

    for step in range(n_steps):
        batch = []
        if args.every > 0 and step % args.every == 0:
            if pending:
                flush(batch)
            for job in jobs:
                for r in range(job.world):
                    batch.append(report_frame(job, r, seq[(job.name, r)], step, True, 0.1))
                    seq[(job.name, r)] += 1
            kinds["probe"] += args.ranks * args.jobs
        else:
            pending.append(step)
            if len(pending) >= args.coalesce or step == n_steps - 1:
                flush(batch)
        if batch and args.heartbeat_s > 0 and args.coalesce == 1:  # 1 step/s and nothing else sent for 1 s
            for job in jobs:
                for r in range(job.world):
                    batch.append(heartbeat_frame(job, r, seq[(job.name, r)], step, seq[(job.name, r)]))
                    seq[(job.name, r)] += 1
        if batch:
            per_step.append(batch)
    handle = agg.handle
    prof = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
    t = time.perf_counter()
    for f in frames:
        handle(f)
    if prof:
        prof.enable()
    t_rep = time.perf_counter()
    publish_s = scrape_s = 0.0
    for batch in per_step:
        for f in batch:
            handle(f)
        agg.state.finish_closing()  # the daemon runs a large round's slices between its batches of frames
        now[0] += 0.05
        agg.state.tick()
        if args.scrape:  # the writer's publish and an HTTP thread's scrape, once per step
            a = time.perf_counter()
            agg.publish()
            b = time.perf_counter()
            text = generate_latest(agg.registry)
            nbytes, nsamples = len(text), sum(1 for x in text.splitlines() if x and not x.startswith(b"#"))
            publish_s, scrape_s = publish_s + b - a, scrape_s + time.perf_counter() - b
    t_end = time.perf_counter()
    if prof:
        prof.disable()
    agg.publish()
    agg.runner.close()
    st = agg.state
    n = sum(len(b) for b in per_step)
    n_rep = kinds["probe"] + kinds["sentinel"]
    res = dict(mode="inprocess", ranks=args.ranks, layers=args.layers, jobs=args.jobs, every=args.every,
               layer_depth=args.layer_depth, frames=n, reports=n_rep, kinds=dict(kinds), schema_s=t_rep - t,
               reports_s=t_end - t_rep, reports_per_s=n_rep / (t_end - t_rep), us_per_frame=1e6 * (t_end - t_rep) / n,
               probes_per_s=kinds["probe"] / (t_end - t_rep),
               publish_s_per_step=publish_s / len(per_step), scrape_s_per_step=scrape_s / len(per_step),
               scrape_bytes=nbytes if args.scrape else 0, scrape_samples=nsamples if args.scrape else 0,
               received=dict(st.received), rejected=dict(st.rejected),
               findings=[f"{f.check}: {f.summary}" for f in agg.snapshot.checks.active])
    if prof:
        import io
        import pstats

        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)
        res["profile"] = s.getvalue()
    return res


# --- output -------------------------------------------------------------------------------------


def table(res: dict) -> str:
    def f(x, nd=0):
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:,.{nd}f}"

    if res["mode"] == "inprocess":
        rows = [("rank-steps handled (frames)", f"{f(res['reports'])} ({f(res['frames'])})"),
                ("rank-steps/s", f(res["reports_per_s"])), ("probe reports/s", f(res["probes_per_s"])),
                ("µs per frame", f(res["us_per_frame"], 1)),
                ("publish / scrape per flush round, s", f"{f(res['publish_s_per_step'], 3)} / {f(res['scrape_s_per_step'], 3)}"),
                ("scrape bytes / samples", f"{f(res['scrape_bytes'])} / {f(res['scrape_samples'])}"),
                ("rejected", str(res["rejected"] or "none")),
                ("active findings", str(len(res["findings"])))]
    else:
        rows = [
            ("mode", res["mode"] + (f" ({res['steps_per_s']} steps/s)" if res["mode"] == "paced" else "")),
            ("sent (schema/steps/report/heartbeat)", "/".join(f(res["sent"].get(k, 0)) for k in ("schema", "steps", "report", "heartbeat"))),
            ("offered rank-steps/s", f(res["offered_reports_per_s"])),
            ("absorbed rank-steps/s", f(res["absorbed_reports_per_s"])),
            ("absorbed messages/s (all kinds)", f(res["absorbed_msgs_per_s"])),
            ("lost (sent - received - rejected)", f(res["lost"])),
            ("rejected", str(res["rejected"] or "none")),
            ("drain after senders stopped, s", f(res["drain_s"], 1)),
            ("freshness p50 / p99, s", f"{f(res['freshness_p50_s'], 2)} / {f(res['freshness_p99_s'], 2)}"),
            (f"freshness p99 after the first {f(res['warmup_s'], 0)} s, s", f(res['freshness_warm_p99_s'], 2)),
            ("last step sent / visible", f"{res['last_step_sent']} / {res['last_step_visible']}"),
            ("scrape p50 / max, s", f"{f(res['scrape_p50_s'], 3)} / {f(res['scrape_max_s'], 3)}"),
            ("scrape bytes / samples", f"{f(res['scrape_bytes'])} / {f(res['scrape_samples'])}"),
            ("aggregator RSS start / max / end, MiB", f"{f(res['rss_start_mib'])} / {f(res['rss_max_mib'])} / {f(res['rss_end_mib'])}"),
            ("active findings", str(len(res["findings"]))),
            ("load average", " ".join(f"{x:.1f}" for x in res["load_avg"])),
        ]
    head = (f"{res['jobs']} job(s) x {res['ranks']:,} ranks x {res['layers']} layers, probe every {res['every']}, "
            f"layer-depth {res.get('layer_depth', 0)}")
    return "\n".join([f"### {head}", "", "| measure | value |", "|---|---|", *(f"| {a} | {b} |" for a, b in rows)])


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=64, help="ranks per job")
    p.add_argument("--layers", type=int, default=100, help="leaf modules (activation slots) per rank; 2 params each")
    p.add_argument("--every", type=int, default=10, help="probe every N-th step (0: never)")
    p.add_argument("--steps-per-s", type=float, default=0.0, help="paced steps per second per rank; 0: as fast as possible")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--tp", type=int, default=0, help="> 0: the ranks form a (dp, tp) mesh, every parameter sharded along tp (one schema, each rank's coordinates in its headers)")
    p.add_argument("--senders", type=int, default=1, help="sender processes")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of sending (unless --reports)")
    p.add_argument("--reports", type=int, default=0, help="send this many reports in all instead of --duration")
    p.add_argument("--coalesce", type=int, default=50, help="unprobed steps per steps message (the agent's coalesce_s times its step rate; 1 at 1 step/s)")
    p.add_argument("--heartbeat-s", type=float, default=1.0, help="heartbeat period per rank, s (0: none)")
    p.add_argument("--schema-every-s", type=float, default=10.0, help="first schema resend per rank, s (then doubling, up to 32x)")
    p.add_argument("--junk", type=int, default=0, help="per sender and step, frames the aggregator must reject")
    p.add_argument("--layer-depth", type=int, default=0, help="the aggregator's --layer-depth")
    p.add_argument("--rank-series-max", type=int, default=0, help="the aggregator's --rank-series-max (0: its default)")
    p.add_argument("--poll-s", type=float, default=0.5, help="seconds between scrapes of /metrics")
    p.add_argument("--warmup-s", type=float, default=10.0, help="freshness is also given over the steps sent this many seconds after the job's first")
    p.add_argument("--drain-s", type=float, default=120.0, help="longest wait for the aggregator to count every message")
    p.add_argument("--agg-arg", action="append", default=[], help="extra aggregator flag (repeat; --agg-arg=--x=1)")
    p.add_argument("--log", default="", help="aggregator log file")
    p.add_argument("--inprocess", action="store_true", help="feed Aggregator.handle in this process instead")
    p.add_argument("--profile", action="store_true", help="with --inprocess: cProfile the reports' handling")
    p.add_argument("--scrape", action="store_true", help="with --inprocess: publish and render /metrics every step")
    p.add_argument("--top", type=int, default=30, help="profile rows")
    p.add_argument("--json", default="", help="write the results as JSON to this path")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    res = run_inprocess(args) if args.inprocess else run_socket(args)
    print(table(res))
    if res.get("profile"):
        print(res["profile"])
    if res.get("findings"):
        print("findings:", *res["findings"], sep="\n  ")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=float)
    return res


if __name__ == "__main__":
    main()
