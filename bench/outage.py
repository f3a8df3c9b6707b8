"""Training speed with the agent while the aggregator is away, against the same job without the
agent, in one run.

Two 2-rank gloo DDP jobs (bench/faultjob.py), one with the agent and one without, run at the
same time in one network namespace and take turns on the cores: a baton file names the job
that trains (``agent:<phase>`` / ``none:<phase>``), handed over every ``--turn-s`` seconds, so
both see the same machine load within each phase. The aggregator runs in a second namespace
joined by veth. Phases, in order: ``absent`` (nothing ever listened yet), ``up``, ``killed``
(SIGKILL, 30 s), ``restarted``, ``stopped`` (SIGSTOP, 20 s), ``resumed`` (the 10 s after
SIGCONT), ``partitioned`` (link down, 20 s), ``healed`` (the 10 s after). Prints steps/s per job
and phase and their ratio (agent / none); the target is >= 0.99 for every phase.

Needs root and iproute2 (``ip netns``). Usage: ``.venv/bin/python bench/outage.py [--scale 0.5]``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import netns  # noqa: E402
from bench.faultjob import MALLOC_FIXED  # noqa: E402

PHASES = [("absent", 20), ("up", 10), ("killed", 30), ("restarted", 10), ("stopped", 20), ("resumed", 10),
          ("partitioned", 20), ("healed", 10)]
PORT, METRICS_PORT = 5555, 9100


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", type=float, default=1.0, help="multiply every phase's length")
    p.add_argument("--turn-s", type=float, default=0.5, help="seconds each job trains before handing over")
    p.add_argument("--width", type=int, default=256, help="hidden width of the 2-layer MLP")
    p.add_argument("--batch", type=int, default=32, help="batch size")
    p.add_argument("--every", type=int, default=10, help="agent probe cadence; 0: the agent's default budget")
    p.add_argument("--control", action="store_true",
                   help="A/A calibration: the 'agent' job runs without the agent too (every ratio should be 1)")
    p.add_argument("--malloc", choices=("fixed", "glibc"), default="fixed",
                   help="fixed (default): both jobs run with glibc's heap trimming and mmap threshold held "
                   f"({MALLOC_FIXED}), so the ratio is the agent's cost, not which of glibc's trim regimes "
                   "each job fell into; glibc: its defaults (see docs/agent.md: CPU jobs and the allocator)")
    p.add_argument("--json", default="", help="also write the results here")
    a = p.parse_args()
    reason = netns.unavailable()
    if reason:
        print(f"bench/outage.py: {reason}", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="gw-outage-"))
    pair = netns.NetnsPair("b").up()
    baton = tmp / "baton"
    baton.write_text("none:warmup".ljust(64))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    job_env = {**env, **(MALLOC_FIXED if a.malloc == "fixed" else {})}
    agg_log = (tmp / "aggregator.log").open("a")

    def aggregator():
        # the namespaces' private veth link: plain TCP beyond loopback, said so
        return subprocess.Popen(pair.cmd(pair.agg, sys.executable, "-m", "gradwatch.aggregator", "--listen",
                                         f"tcp://{netns.AGG_ADDR}:{PORT}", "--insecure-plaintext", "--metrics-host", "127.0.0.1",
                                         "--metrics-port", str(METRICS_PORT)), stdout=agg_log, stderr=subprocess.STDOUT, env=env)

    def job(name, endpoint, gloo_port):
        return subprocess.Popen(
            pair.cmd(pair.train, sys.executable, str(ROOT / "bench" / "faultjob.py"), "--endpoint", endpoint,
                     "--port", str(gloo_port), "--baton", str(baton), "--name", name, "--job", "outage",
                     "--every", str(a.every), "--heartbeat-s", "1.0", "--width", str(a.width), "--batch", str(a.batch),
                     "--progress", str(tmp / f"{name}.progress"), "--out", str(tmp / name)),
            stdout=(tmp / f"{name}.log").open("w"), stderr=subprocess.STDOUT, env=job_env)

    def hand(owner, phase):
        # one pwrite of a fixed-size record: the jobs never read half a baton
        fd = os.open(baton, os.O_WRONLY)
        try:
            os.pwrite(fd, f"{owner}:{phase}".ljust(64).encode(), 0)
        finally:
            os.close(fd)

    agg = None
    jobs = {"agent": job("agent", "" if a.control else f"tcp://{netns.AGG_ADDR}:{PORT}", 29541), "none": job("none", "", 29542)}
    try:
        deadline = time.monotonic() + 180
        while not all((tmp / f"{n}.progress.{r}").exists() for n in jobs for r in (0, 1)):
            if time.monotonic() > deadline or any(j.poll() is not None for j in jobs.values()):
                raise RuntimeError(f"jobs did not start; see {tmp}")
            time.sleep(0.2)
        for owner in ("agent", "none"):  # warm both up
            hand(owner, "warmup")
            time.sleep(2.0)
        actions = {
            "up": lambda: aggregator(),
            "killed": lambda: (agg.send_signal(signal.SIGKILL), agg.wait(10)),
            "restarted": lambda: aggregator(),
            "stopped": lambda: agg.send_signal(signal.SIGSTOP),
            "resumed": lambda: agg.send_signal(signal.SIGCONT),
            "partitioned": pair.partition,
            "healed": pair.heal,
        }
        for phase, length in PHASES:
            got = actions.get(phase, lambda: None)()
            if isinstance(got, subprocess.Popen):
                agg = got
            print(f"phase {phase}: {length * a.scale:.0f} s", file=sys.stderr, flush=True)
            end, turn = time.monotonic() + length * a.scale, 0
            while time.monotonic() < end:
                hand(("agent", "none")[turn % 2], phase)
                turn += 1
                time.sleep(min(a.turn_s, max(0.0, end - time.monotonic())))
        hand("stop", "")
        for n, j in jobs.items():
            if j.wait(120) != 0:
                raise RuntimeError(f"job {n} failed: {(tmp / f'{n}.log').read_text()}")
    finally:
        hand("stop", "")
        for j in jobs.values():
            if j.poll() is None:
                j.kill()
        if agg is not None and agg.poll() is None:
            agg.send_signal(signal.SIGCONT)
            agg.kill()
        pair.close()
    info = {n: json.loads((tmp / f"{n}.0.json").read_text()) for n in jobs}
    rows = []
    print(f"\n2-rank gloo DDP, MLP 64-{a.width}-8, batch {a.batch}, probe every {a.every}; turns of {a.turn_s} s"
          + (" (control: no agent in either job)" if a.control else "") + f"; allocator: {a.malloc}")
    print("ratio: median over consecutive turn pairs of (agent steps/s) / (none steps/s); totals beside it\n")
    print("| phase | s | turn pairs | none steps/s | agent steps/s | ratio of totals | median ratio |")
    print("|---|---|---|---|---|---|---|")
    for phase, length in PHASES:
        tn, ta = info["none"]["phases"].get(phase, []), info["agent"]["phases"].get(phase, [])
        # a turn cut short by the phase's end is not a fair sample
        pairs = [(x, y) for x, y in zip(ta, tn) if x[1] > a.turn_s / 2 and y[1] > a.turn_s / 2]
        rn = sum(y[0] for _, y in pairs) / max(1e-9, sum(y[1] for _, y in pairs))
        ra = sum(x[0] for x, _ in pairs) / max(1e-9, sum(x[1] for x, _ in pairs))
        med = statistics.median([(x[0] / x[1]) / (y[0] / y[1]) for x, y in pairs if y[0]]) if pairs else float("nan")
        rows.append({"phase": phase, "seconds": length * a.scale, "pairs": len(pairs), "none": rn, "agent": ra,
                     "ratio": ra / rn if rn else float("nan"), "median_ratio": med})
        print(f"| {phase} | {length * a.scale:.0f} | {len(pairs)} | {rn:.1f} | {ra:.1f} | {ra / rn if rn else float('nan'):.3f} | **{med:.3f}** |")
    print("\nsender thread CPU (agent job, rank 0), share of one core over each whole phase:")
    for phase, _ in PHASES:
        c, w = info["agent"]["sender_cpu"].get(phase, (0.0, 0.0))
        rows_cpu = f"{100 * c / w:.2f}%" if w else "-"
        print(f"  {phase:12s} {rows_cpu}")
        for row in rows:
            if row["phase"] == phase:
                row["sender_cpu_share"] = c / w if w else None
    print("\nminor page faults per step, training thread of rank 0: "
          + ", ".join(f"{n} {info[n].get('faults_per_step', float('nan')):.0f}" for n in jobs))
    ag = info["agent"]
    if a.control:
        print("\ncontrol run: no agent in either job")
    else:
        print(f"\nagent, rank 0: {ag['reports']} reports sent, {ag['drops']} dropped, sender turns {ag['turns']} "
              f"({ag['blocked']} refused), errors {ag['errors']}")
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "agent": ag, "malloc": a.malloc,
                                            "faults_per_step": {n: info[n].get("faults_per_step") for n in jobs}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
