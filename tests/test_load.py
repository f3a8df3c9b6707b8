"""bench/load.py in small (64 ranks x 20 layers, a few seconds) as a correctness test of
the aggregator under load: real sender processes, real ZeroMQ, the real aggregator process. Every
message sent is counted by the aggregator, received by kind or rejected by reason (none lost
silently); the healthy simulated job raises no finding; /metrics shows every rank at the newest
step. No timing is asserted (the figures are bench/README.md's)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.load import main

from .conftest import children

pytestmark = pytest.mark.ddp


@pytest.mark.parametrize("mode", ["max", "paced", "mesh"])
def test_every_message_is_counted_and_the_healthy_job_stays_healthy(tmp_path, mode):
    argv = ["--ranks", "64", "--layers", "20", "--every", "5", "--senders", "2", "--junk", "3",
            "--poll-s", "0.2", "--log", str(tmp_path / "aggregator.log")]
    # max: as fast as the senders go (reports queue up); paced: 64 ranks at 10 steps/s; mesh: paced,
    # a (dp, tp) mesh of 16 x 4 ranks sending one schema, each placed by its headers
    argv += ["--reports", str(64 * 40)] if mode == "max" else ["--steps-per-s", "10", "--duration", "3"]
    argv += ["--tp", "4"] if mode == "mesh" else []
    res = main(argv)
    sent = res["sent"]
    assert sent["records"] >= 64 * 30 and sent["steps"] > 0 and sent["schema"] >= 64 and sent["junk"] > 0
    # none lost: what was sent is what the aggregator counted, each kind as itself, every record applied
    assert res["lost"] == 0, res
    for kind in ("schema", "steps", "report", "heartbeat"):
        assert res["received"].get(kind, 0) == sent.get(kind, 0), (kind, res)
    assert res["rank_steps_applied"] == sent["records"], res
    assert res["rejected"] == {"version": sent["junk"]}, res
    assert res["findings"] == [], res["findings"]
    assert res["ranks_visible"] == {"load0": 64}
    assert res["last_step_visible"] == {"load0": res["last_step_sent"]["load0"]}
    assert res["freshness_n"] > 0 and res["scrape_samples"] > 64 * 6
    assert res["warmup_s"] == 10.0 and "freshness_warm_p99_s" in res  # the after-warm-up figure is reported


def test_freshness_per_step_and_after_the_warm_up():
    """bench/load.py's freshness: a step counts from its last sender's finish to the first scrape
    that shows it on every rank; the warm figure leaves out the steps sent within warmup_s of the
    job's first step."""
    from bench.load import Scrape, freshness

    def at(t, step, ranks=4):
        return Scrape(t, 0.01, 0, 0, {}, {}, {"j": step}, {"j": ranks}, 0, 0.0)

    done = {"j": {0: 100.0, 1: 101.0, 2: 102.0, 3: 103.0}}
    scrapes = [at(100.5, 0), at(101.2, 0, ranks=3), at(101.7, 1), at(103.9, 3)]  # 101.2: a rank missing
    by_step, warm = freshness(done, scrapes, ranks=4, warmup_s=2.0)
    assert [(j, s, round(f, 6)) for j, s, f in by_step] == [("j", 0, 0.5), ("j", 1, 0.7), ("j", 2, 1.9), ("j", 3, 0.9)]
    assert [round(f, 6) for f in warm] == [1.9, 0.9]  # steps 2 and 3: sent 2 s and more after step 0


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_bench_takes_its_aggregator_and_senders_with_it(tmp_path):
    """SIGKILL of bench/load.py mid-run: its aggregator process and its sender processes die with
    it (a sender blocked on a dead aggregator would otherwise wait forever, loading the machine
    for the next run)."""
    root = Path(__file__).resolve().parents[1]
    bench = subprocess.Popen([sys.executable, str(root / "bench" / "load.py"), "--ranks", "64", "--layers", "4",
                              "--senders", "2", "--steps-per-s", "5", "--duration", "120",
                              "--log", str(tmp_path / "aggregator.log")],
                             cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        kids: set[int] = set()
        while len(kids) < 3:  # the aggregator and two senders (and the spawn resource tracker)
            assert bench.poll() is None, "the bench exited early"
            assert time.monotonic() < deadline, f"no aggregator and senders started: {kids}"
            time.sleep(0.2)
            kids = {k for k, cmd in children(bench.pid).items() if b"resource_tracker" not in cmd}
    finally:
        bench.kill()
        bench.wait()
    deadline = time.monotonic() + 20
    while any(_alive(k) for k in kids):
        assert time.monotonic() < deadline, f"outlived the bench: {[k for k in kids if _alive(k)]}"
        time.sleep(0.1)
