#!/usr/bin/env python
"""Fuzz the aggregator's receive path: malformed, mutated and forged frames beside a real job.

Every frame goes through ``Aggregator.handle`` (decode + apply, the receive thread's work) in this
process, without sockets, interleaved with the steps of a legitimate 3-rank job; ``tick`` and a
full ``/metrics`` rendering run along the way. Afterwards the legitimate job's exported series
(all but wall-clock timestamps) must equal those of the same job run without the fuzz, no
exception may have escaped (nor been swallowed as ``internal``), and memory must stay bounded.

Frame families (:func:`frames`), each drawn with equal probability:

  flip       1-8 random bit flips in a valid schema, steps batch, probe report or heartbeat of
             another job
  truncate   a valid frame cut short, or with random bytes appended
  types      a map with every right key and random wrong-typed values (None, huge ints, NaN,
             strings, bytes, nested lists and maps)
  forge      a well-formed message under the legitimate job's id and world without its key, and
             under other ids: step 0, step 2**62, batches of records far ahead or behind, other
             world sizes, goodbyes, schemas
  huge       headers that claim huge arrays, maps, strings or bins; deep nesting; schemas over
             the name cap; probe arrays of the wrong size
  random     random bytes
  control    the control channel's kinds: stacks and acks answering no command asked (under the
             legitimate job's id, with right and wrong keys), commands sent to the aggregator
             (refused: "direction"), and each of them with bit flips

The attacker knows what ``/metrics`` shows (ids, world sizes, ranks, steps), not the job's key.

With ``--daemon`` the frames go over TCP instead, to a real aggregator process at its defaults
(:func:`run_daemon`), from ``--senders`` loopback addresses (each a source of its own) beside the
legitimate job on its own connection, ``--frames`` a round for ``--rounds`` rounds: its resident
memory after each round (the RSS curve, and its peak) is what bench/README.md logs, and the
legitimate job must count every step.

    .venv/bin/python bench/fuzz.py                 # a million frames
    .venv/bin/python bench/fuzz.py --frames 100000 --seed 3
    .venv/bin/python bench/fuzz.py --daemon --frames 500000 --rounds 6
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import random
import struct
import time

import msgpack
import numpy as np
from prometheus_client import generate_latest

from gradwatch import wire
from gradwatch.aggregator.checks import Thresholds
from gradwatch.aggregator.config import load
from gradwatch.aggregator.daemon import Aggregator

JOB, WORLD, KEY = "none", 3, "5f1c0e7d2a9b4c68"
PARAMS = (("fc1.weight", (8, 4), "float32"), ("fc1.bias", (8,), "float32"), ("fc2.weight", (2, 8), "float32"))
SLOTS = (("fc1", "", "Linear", "float32"), ("act", "", "ReLU", "float32"), ("fc2", "", "Linear", "float32"))
FAMILIES = ("flip", "truncate", "types", "forge", "huge", "random", "control")


class Clock:
    """The aggregator's monotonic clock, advanced by the driver: runs are reproducible."""

    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def rss_bytes() -> int:
    """Resident set size of this process, bytes (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _probe(rng: np.random.Generator, n_slots=3, n_params=3) -> dict:
    return dict(
        probe=True,
        act=np.round(np.abs(rng.standard_normal((n_slots, 6))), 3).astype(np.float32) * [1, 1, 1, 1, 0, 0],
        act_grad=np.round(np.abs(rng.standard_normal((n_slots, 2))), 3).astype(np.float32) * [1, 0],
        param=np.round(np.abs(rng.standard_normal((n_params, 3))), 3).astype(np.float32) * [1, 1, 0],
        fp_grad=np.zeros(n_params, np.uint64), fp_weight=np.zeros(n_params, np.uint64),
    )


class LegitJob:
    """A 3-rank job under torchrun's default id, with its key; deterministic boots and values."""

    def __init__(self, every: int = 5):
        self.boots = [f"legit-boot-{r}" for r in range(WORLD)]
        self.seq = [0] * WORLD
        self.step, self.every = 0, every
        self.hash = wire.schema_hash(PARAMS, SLOTS)

    def _h(self, r):
        h = wire.Header(JOB, r, WORLD, self.boots[r], self.seq[r], 1.7e9, KEY)
        self.seq[r] += 1
        return h

    def start(self):
        return [wire.encode(wire.Schema(self._h(r), "node", r, self.every, PARAMS, SLOTS)) for r in range(WORLD)]

    def next_step(self):
        """The frames the ranks send for the next step, as agents do: a probed step's report (after
        the records held since the last one, as one ``steps`` batch), and a heartbeat."""
        rng = np.random.default_rng(self.step)
        out = []
        if self.step % self.every == 0:
            for r in range(WORLD):
                held = range(self.step - self.every + 1, self.step)
                if held:
                    out.append(wire.encode(wire.Steps.of(
                        [wire.Report(self._h(r), self.hash, s, 0.05, 1.0 + r, 0) for s in held])))
                out.append(wire.encode(wire.Report(self._h(r), self.hash, self.step, 0.05, 1.0 + r, 0, **_probe(rng))))
        for r in range(WORLD):
            out.append(wire.encode(wire.Heartbeat(self._h(r), self.step, self.seq[r], 0, 0)))
        self.step += 1
        return out

    def finish(self):
        """The records held since the last probe, as each agent sends them when it closes."""
        held = range(self.step - (self.step - 1) % self.every, self.step)
        return [wire.encode(wire.Steps.of([wire.Report(self._h(r), self.hash, s, 0.05, 1.0 + r, 0) for s in held]))
                for r in range(WORLD)] if held else []


def _templates(rng: np.random.Generator) -> list[bytes]:
    """Valid frames of a job the fuzz owns ("victim"), the raw material of flips and cuts."""
    h = wire.Header("victim", 1, 2, "victimboot", 7, 1.7e9)
    return [
        wire.encode(wire.Schema(h, "host", 1, 5, PARAMS, SLOTS)),
        wire.encode(wire.Report(h, wire.schema_hash(PARAMS, SLOTS), 10, 0.05, 1.0, 0, **_probe(rng))),
        wire.encode(wire.Report(h, wire.schema_hash(PARAMS, SLOTS), 11, 0.05, 1.0, 0)),
        wire.encode(wire.Steps.of([wire.Report(h, wire.schema_hash(PARAMS, SLOTS), s, 0.05, 1.0, 0,
                                               grad_norms=np.ones(3, np.float32)) for s in range(12, 20)])),
        wire.encode(wire.Heartbeat(h, 11, 12, 0, 0, closing=True, reason="closed")),
    ]


_HEADER_KEYS = ("job", "rank", "world", "boot", "seq", "time", "key")
_BODY_KEYS = {
    "steps": ("schema", *(c.name for c in wire.STEP_COLUMNS), "grad_norms", "grad_sq_dims", "grad_sq", "drops",
              "agent_cost", "probe_interval", "over_budget"),
    "schema": ("hash", "host", "local_rank", "every", "params", "slots"),
    "report": ("schema", "step", "step_time", "grad_norm", "grad_nonfinite", "micro", "drops", "probe",
               "local_grad_norm", "compute_time", "compute_wait", "loss", "loss_scale", "skipped", "batch", "burst",
               "act", "act_grad", "param", "fp_grad", "fp_weight"),
    "heartbeat": ("step", "sent", "drops", "errors", "closing", "in_step_s", "waiting", "reason", "run_s", "schema"),
}


def _wild(py: random.Random, depth: int = 0):
    pick = py.randrange(16)
    if pick == 0:
        return None
    if pick == 1:
        return py.choice([True, False])
    if pick == 2:
        return py.choice([0, -1, 1, 2**31, 2**62, 2**64 - 1, -(2**63)])
    if pick == 3:
        return py.choice([math.nan, math.inf, -math.inf, -0.0, 1e308, 0.5])
    if pick == 4:
        return "x" * py.choice([0, 1, 65, 257, 5000])
    if pick == 5:
        return py.randbytes(py.choice([0, 1, 7, 8, 24, 100]))
    if pick == 6 and depth < 3:
        return [_wild(py, depth + 1) for _ in range(py.randrange(4))]
    if pick == 7 and depth < 3:
        return {str(py.randrange(9)): _wild(py, depth + 1) for _ in range(py.randrange(3))}
    if pick == 8:
        return py.choice(["schema", "report", "heartbeat", JOB, "victim", "finished", "bogus"])
    if pick == 9:
        return py.randrange(-5, 10)
    if pick == 10:
        return [["a", [1], "float32"], ["b", [-1], 3]]
    if pick == 11:
        return [["m", "", "Linear", "float32"], ["m", 1, "x"]]
    return py.randrange(0, 4)


def _types(py: random.Random) -> bytes:
    kind = py.choice(tuple(_BODY_KEYS))
    h = {"job": py.choice([JOB, "victim", "t"]), "rank": py.randrange(4), "world": 4, "boot": "b", "seq": 0, "time": 1.0}
    for k in _HEADER_KEYS:
        if py.random() < 0.3 or k not in h:
            h[k] = _wild(py)
    m = {"v": wire.PROTOCOL_VERSION if py.random() < 0.9 else _wild(py), "kind": kind,
         "header": h if py.random() < 0.9 else _wild(py)}
    for k in _BODY_KEYS[kind]:
        m[k] = _wild(py)
    if py.random() < 0.2:
        del m[py.choice(list(m))]
    return msgpack.packb(m, use_bin_type=True)


def _forge(py: random.Random, rng: np.random.Generator) -> bytes:
    job = JOB if py.random() < 0.7 else py.choice(["victim", f"inv{py.randrange(500)}"])
    key = py.choice(["", "0" * 16, py.randbytes(8).hex()])
    world = py.choice([WORLD, WORLD, 1, 2, 4, 1 << 20, 70_000])
    rank = py.randrange(min(world, 8))
    boot = py.choice(["legit-boot-0", "legit-boot-1", py.randbytes(8).hex(), ""])
    h = wire.Header(job, rank, world, boot, py.choice([0, 1, 2**40]), 1.7e9, key)
    step = py.choice([0, 1, 2**62, 2**31, py.randrange(10_000)])
    kind = py.randrange(6)
    if kind == 5:  # a batch of records: far ahead, behind, or across a restart
        first = py.choice([0, 1, 2**40, py.randrange(10_000)])
        n = py.choice([1, 7, wire.MAX_STEPS])
        return wire.encode(wire.Steps.columns(h, wire.schema_hash(PARAMS, SLOTS), step=np.arange(first, first + n),
                                      step_time=np.full(n, 0.05), grad_norm=np.full(n, py.choice([1.0, 1e30, math.nan])),
                                      grad_nonfinite=np.full(n, py.choice([0, 7]))))
    if kind == 0:
        return wire.encode(wire.Heartbeat(h, step, 0, 0, 0, closing=py.random() < 0.5,
                                          reason=py.choice(wire.CLOSE_REASONS)))
    if kind == 1:
        return wire.encode(wire.Report(h, wire.schema_hash(PARAMS, SLOTS), step, 0.05, 1e30, 7))
    if kind == 2:
        return wire.encode(wire.Report(h, wire.schema_hash(PARAMS, SLOTS), step, 0.05, math.nan, 0, **_probe(rng)))
    if kind == 3:
        n = py.choice([1, 50, 400])
        slots = tuple((f"{'x' * py.choice([1, 300])}{i}", "", "Linear", "float32") for i in range(n))
        return wire.encode(wire.Schema(h, "h" * py.choice([1, 500]), 0, 1, PARAMS, slots))
    return wire.encode(wire.Schema(h, "node", 0, 5, PARAMS, SLOTS))


def _huge(py: random.Random) -> bytes:
    head = msgpack.packb({"v": wire.PROTOCOL_VERSION, "kind": "schema", "header": {"job": "h", "rank": 0, "world": 1,
                          "boot": "b", "seq": 0, "time": 1.0}, "hash": "0" * 16, "host": "h", "local_rank": 0, "every": 1},
                         use_bin_type=True)
    pick = py.randrange(7)
    if pick == 0:  # a map that claims 2**32-1 entries
        return b"\xdf\xff\xff\xff\xff" + head[1:40]
    if pick == 1:  # an array / bin / str claiming 2**32-1 elements or bytes
        return b"\x81\xa6params" + py.choice([b"\xdd", b"\xc6", b"\xdb"]) + b"\xff\xff\xff\xff" + b"\x00" * 16
    if pick == 2:  # deep nesting
        return b"\x91" * 100_000 + b"\xc0"
    if pick == 3:  # a schema over the name cap, or a batch over the record cap
        m = msgpack.unpackb(head)
        if py.random() < 0.5:
            m.update(params=[], slots=[["m", "", "L", "f"]] * 10_001)
        else:
            n = wire.MAX_STEPS + 1
            m.update(kind="steps", schema="0" * 16, records=np.zeros(n, wire.RECORD).tobytes())
        return msgpack.packb(m, use_bin_type=True)
    if pick == 4:  # probe arrays that do not fit the schema
        m = msgpack.unpackb(_templates(np.random.default_rng(0))[1])
        m[py.choice(["act", "act_grad", "param", "fp_grad", "fp_weight"])] = b"\x00" * py.choice([0, 4, 4096, 1 << 20])
        return msgpack.packb(m, use_bin_type=True)
    if pick == 5:  # ext types, which no field holds
        return b"\x81\xa1v" + b"\xc7\xff\x01" + b"\x00" * 255
    return struct.pack("<Q", py.getrandbits(64)) * py.randrange(1, 64)


def _control(py: random.Random) -> bytes:
    key = py.choice([KEY, "", "0" * 16])
    h = wire.Header(py.choice([JOB, "victim"]), py.randrange(WORLD), WORLD, py.choice(["legit-boot-0", "x"]), 5, 1.7e9, key)
    cid = py.getrandbits(63)
    pick = py.randrange(4)
    if pick == 0:
        frames = tuple(wire.Frame("x" * py.choice([1, 512]), py.randrange(1 << 20), "f") for _ in range(py.choice([0, 3, 64])))
        m = wire.Stack(h, cid, frames, 1.0, py.random() < 0.5, (wire.FlightEntry("gloo:all_reduce", "scheduled", "3"),))
    elif pick == 1:
        m = wire.Ack(h, cid, py.random() < 0.5, py.choice([-1, 0, 2**62]), py.choice(wire.ACK_REASONS))
    else:
        args = py.choice([wire.StacksArgs(True), wire.ProbeArgs(5, 10, ("a*",)), wire.BudgetArgs(0.1, 60.0),
                          wire.HaltArgs(7, "nonfinite", "s")])
        m = wire.Command(cid, JOB, py.choice([-1, 0]), "", 1.7e9, 1.7e9 + 60, args)
    b = bytearray(wire.encode(m))
    if pick == 3:  # the aggregator's own kind, mutated
        for _ in range(py.randrange(1, 5)):
            b[py.randrange(len(b))] ^= 1 << py.randrange(8)
    return bytes(b)


def frames(n: int, seed: int = 0):
    """``n`` fuzz frames, deterministic for a seed; yields ``(family, frame)``."""
    py = random.Random(seed)
    rng = np.random.default_rng(seed)
    templates = _templates(rng)
    for _ in range(n):
        fam = py.choice(FAMILIES)
        if fam == "flip":
            b = bytearray(py.choice(templates))
            for _ in range(py.randrange(1, 9)):
                b[py.randrange(len(b))] ^= 1 << py.randrange(8)
            yield fam, bytes(b)
        elif fam == "truncate":
            t = py.choice(templates)
            yield fam, t[: py.randrange(len(t))] if py.random() < 0.7 else t + py.randbytes(py.randrange(1, 20))
        elif fam == "types":
            yield fam, _types(py)
        elif fam == "forge":
            yield fam, _forge(py, rng)
        elif fam == "huge":
            yield fam, _huge(py)
        elif fam == "control":
            yield fam, _control(py)
        else:
            yield fam, py.randbytes(py.randrange(0, 200))


def legit_series(text: str) -> dict:
    """The legitimate job's samples of a /metrics text, but wall-clock timestamps and ages."""
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or f'job_id="{JOB}"' not in line or "timestamp" in line or "age_seconds" in line:
            continue
        name, _, value = line.rpartition(" ")
        out[name] = value
    return out


def run(n_frames: int, seed: int = 0, steps: int = 200, scrape_every: int = 20_000) -> dict:
    """Drive one aggregator with ``n_frames`` fuzz frames beside the legitimate job, and one
    without them; return what the caller asserts on (see the module docstring)."""

    def aggregator():
        clock = Clock()
        cfg = load(listen="tcp://127.0.0.1:0", metrics_port=0, checks=Thresholds(silent_after_s=1e6))
        return Aggregator(cfg, clock=clock), clock

    def drive(fuzz):
        agg, clock = aggregator()
        job = LegitJob()
        per_step = max(1, n_frames // steps) if fuzz is not None else 0
        for f in job.start():
            agg.handle(f)
        done = 0
        peak = 0
        for s in range(steps):
            for f in job.next_step():
                agg.handle(f)
            for _ in range(per_step):
                fam, frame = next(fuzz, (None, None))
                if frame is None:
                    break
                agg.handle(frame)
                done += 1
                if done % scrape_every == 0:
                    agg.publish()
                    generate_latest(agg.registry)
                    peak = max(peak, rss_bytes())
            clock.t += 0.05
            agg.state.tick()
        for f in job.finish():
            agg.handle(f)
        for fam, frame in fuzz or ():  # what did not fit the steps
            agg.handle(frame)
            done += 1
        clock.t += 0.05
        agg.state.tick()
        agg.publish()
        text = generate_latest(agg.registry).decode()
        agg.runner.close()
        return agg, text, done, peak

    _, base_text, _, _ = drive(None)
    rss0 = rss_bytes()
    t0 = time.perf_counter()
    agg, text, done, peak = drive(frames(n_frames, seed))
    seconds = time.perf_counter() - t0
    st = agg.state
    return dict(
        frames=done, seconds=seconds, rss_before=rss0, rss_peak=max(peak, rss_bytes()),
        internal=st.rejected.get("internal", 0), rejected=dict(st.rejected), jobs=len(st.jobs),
        max_jobs=agg.cfg.max_jobs + agg.cfg.max_pending_jobs,
        legit_equal=legit_series(text) == legit_series(base_text), legit=legit_series(text),
        legit_base=legit_series(base_text),
    )


def _memory(pid: int) -> tuple[int, int]:
    """``(resident, peak resident)`` bytes of process ``pid`` (Linux /proc: VmRSS, VmHWM)."""
    got = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                got[key] = int(value.split()[0]) * 1024
    return got["VmRSS"], got["VmHWM"]


def run_daemon(n_frames: int, rounds: int = 1, seed: int = 0, senders: int = 4, steps: int = 200,
               log: str = "", settle_s: float = 2.0) -> dict:
    """``rounds`` rounds of ``n_frames`` fuzz frames each, over TCP, to a real aggregator process
    at its defaults, from ``senders`` loopback addresses (127.0.0.10 on: each a source of its own),
    beside the legitimate job (``steps`` steps a round, on its own connection); ``log``: the
    aggregator's output file (default a temporary one).

    Returns: ``rss`` (the aggregator's resident bytes before the fuzz and ``settle_s`` after each
    round), ``rss_peak`` (its peak resident bytes), ``frames`` sent, ``seconds``, ``internal``
    (failures of its own), ``legit_steps`` (the legitimate job's steps counted, per rank) and
    ``steps`` (sent), ``samples`` of its last scrape, ``rejected`` by reason.
    """
    import sys
    import tempfile

    import zmq
    from prometheus_client.parser import text_string_to_metric_families

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:  # run as a script: the bench package is the checkout's
        sys.path.insert(0, root)
    from bench.harness import AggregatorProcess

    log = log or tempfile.mkstemp(prefix="gradwatch-fuzz-", suffix=".log")[1]
    agg = AggregatorProcess(log=log)
    ctx = zmq.Context()
    try:
        host_port = agg.endpoint[len("tcp://"):]
        socks = []
        for i in range(senders):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"tcp://127.0.0.{10 + i}:0;{host_port}")
            socks.append(s)
        legit = ctx.socket(zmq.DEALER)
        legit.setsockopt(zmq.LINGER, 5000)
        legit.connect(agg.endpoint)
        job = LegitJob()
        for f in job.start():
            legit.send(f)
        time.sleep(0.5)
        curve, sent = [_memory(agg.proc.pid)[0]], 0
        t0 = time.perf_counter()
        for rnd in range(rounds):
            fuzz = frames(n_frames, seed + rnd)
            per_step = max(1, n_frames // steps)
            for _ in range(steps):
                for f in job.next_step():
                    legit.send(f)
                for k in range(per_step):
                    fam, frame = next(fuzz, (None, None))
                    if frame is None:
                        break
                    socks[sent % senders].send(frame)
                    sent += 1
            for fam, frame in fuzz:  # what did not fit the steps
                socks[sent % senders].send(frame)
                sent += 1
            time.sleep(settle_s)
            agg.get("/metrics", timeout=60)
            curve.append(_memory(agg.proc.pid)[0])
        seconds = time.perf_counter() - t0
        for f in job.finish():
            legit.send(f)

        def scrape() -> dict:
            out: dict = {}
            for fam in text_string_to_metric_families(agg.get("/metrics", timeout=60)):
                for x in fam.samples:
                    out.setdefault(x.name, {})[tuple(sorted(x.labels.items()))] = x.value
            return out

        deadline = time.monotonic() + 30
        while True:  # the legitimate job's last records handled
            m = scrape()
            counted = {r: m.get("gradwatch_rank_steps_total", {}).get((("job_id", JOB), ("rank", str(r))), 0)
                       for r in range(WORLD)}
            if all(v == job.step for v in counted.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        rejected = {dict(k)["reason"]: int(v) for k, v in m.get("gradwatch_messages_rejected_total", {}).items() if v}
        return dict(rss=curve, rss_peak=_memory(agg.proc.pid)[1], frames=sent, seconds=seconds,
                    internal=rejected.get("internal", 0), legit_steps=counted, steps=job.step,
                    samples=sum(len(v) for v in m.values()), rejected=rejected)
    finally:
        ctx.destroy(linger=0)
        agg.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--frames", type=int, default=1_000_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--daemon", action="store_true", help="over TCP to an aggregator process: its RSS curve")
    ap.add_argument("--rounds", type=int, default=1, help="with --daemon: rounds of --frames")
    ap.add_argument("--senders", type=int, default=4, help="with --daemon: loopback addresses the fuzz comes from")
    a = ap.parse_args()
    logging.getLogger("gradwatch").setLevel(logging.ERROR)  # findings on forged jobs, by the thousand
    if a.daemon:
        r = run_daemon(a.frames, a.rounds, a.seed, a.senders)
        mib = [f"{x / 2**20:.0f}" for x in r["rss"]]
        print(f"{r['frames']:,} frames in {r['seconds']:.1f} s over TCP from {a.senders} senders; aggregator RSS (MiB) "
              f"before and after each round of {a.frames:,}: {' '.join(mib)}; peak {r['rss_peak'] / 2**20:.0f} MiB; "
              f"internal errors {r['internal']}; legitimate job's steps counted {r['legit_steps']} of {r['steps']}; "
              f"scrape {r['samples']:,} samples")
        print("rejected:", ", ".join(f"{k} {v:,}" for k, v in sorted(r["rejected"].items(), key=lambda kv: -kv[1])))
        if r["internal"] or any(v != r["steps"] for v in r["legit_steps"].values()):
            raise SystemExit(1)
        return
    r = run(a.frames, a.seed, steps=max(200, a.frames // 2000))
    print(f"{r['frames']:,} frames in {r['seconds']:.1f} s ({r['frames'] / r['seconds']:,.0f}/s); "
          f"internal errors {r['internal']}; jobs held {r['jobs']} (cap {r['max_jobs']}); "
          f"RSS {r['rss_before'] / 2**20:.0f} -> peak {r['rss_peak'] / 2**20:.0f} MiB; "
          f"legitimate job unchanged: {r['legit_equal']}")
    print("rejected:", ", ".join(f"{k} {v:,}" for k, v in sorted(r["rejected"].items(), key=lambda kv: -kv[1])))
    if r["internal"] or not r["legit_equal"] or r["jobs"] > r["max_jobs"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
