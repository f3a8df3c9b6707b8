"""The agent never slows training, whatever the aggregator does: with no aggregator,
one that comes late, one killed with SIGKILL and restarted, one stopped with SIGSTOP.

Deterministic under load: they bound what the sender thread *does* (its CPU time from the
kernel's per-thread accounting, its loop turns against what its timers allow, its drop count
against the reports it could not hand over), not how fast training runs; the timing ratios are
measured by bench/outage.py. Real parts: real ZeroMQ sockets, the real aggregator process.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gradwatch import agent

from .conftest import free_port, samples, start_aggregator, wait_for

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]  # real aggregator processes, seconds of training each


def thread_cpu_s(tid: int) -> float:
    """CPU time of one thread of this process, seconds (``/proc/self/task/<tid>/schedstat``:
    nanoseconds on CPU, the first field)."""
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


def retry_turns_bound(seconds: float, sender) -> int:
    """Most turns a blocked sender takes on its own in ``seconds``: backoffs double from
    ``backoff_min_s`` to ``backoff_max_s`` and stay there (plus one turn each side)."""
    n, t, b = 0, 0.0, sender.backoff_min_s
    while t < seconds:
        t += b
        b = min(2 * b, sender.backoff_max_s)
        n += 1
    return n + 2


class Trainer:
    """A small model trained with the agent in a background thread until stopped."""

    def __init__(self, endpoint: str, step_sleep_s: float = 0.0, **kw):
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.x, self.y = torch.randn(8, 16), torch.randn(8, 4)
        self.monitor = agent.attach(self.model, self.opt, endpoint=endpoint, job="outage", **kw)
        self.sender = self.monitor.sender
        self.steps = 0
        self.sleep = step_sleep_s
        self._stop = threading.Event()
        self._thread = None

    def step(self) -> None:
        F.mse_loss(self.model(self.x), self.y).backward()
        self.opt.step()
        self.opt.zero_grad()
        self.steps += 1

    def run_for(self, seconds: float, min_steps: int = 0, max_s: float = 60.0) -> None:
        """Train for ``seconds``, and on until ``min_steps`` steps (at most ``max_s`` seconds)."""
        start = time.monotonic()
        while (time.monotonic() - start < seconds or self.steps < min_steps) and time.monotonic() - start < max_s:
            self.step()

    def start(self) -> "Trainer":
        def loop():
            while not self._stop.is_set():
                self.step()
                time.sleep(self.sleep)
        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self.monitor.close()


@pytest.mark.filterwarnings("ignore:gradwatch. never connected:RuntimeWarning")  # expected: nothing listens
def test_no_aggregator_the_sender_thread_stays_idle_and_counts_each_lost_report_once():
    """Nothing listens for 3 s of back-to-back training steps. The sender thread builds nothing,
    hands nothing to ZeroMQ, uses under 5% of one core (it once spun at 100% holding the GIL),
    turns no more often than its backoff and the training thread's wake-ups allow, and counts
    exactly the reports pushed out of its full queue as dropped."""
    t = Trainer(f"tcp://127.0.0.1:{free_port()}", every=1000, heartbeat_s=0.5)
    sender = t.sender
    try:
        t.step()  # the probe at step 0: the schema becomes known (request_schema wakes the thread)
        tid = sender._thread.native_id
        cpu0, turns0, t0 = thread_cpu_s(tid), sender.turns, time.monotonic()
        t.run_for(3.0, min_steps=3 * sender._queue_size)  # fills the queue, also on a loaded machine
        elapsed = time.monotonic() - t0
        cpu, turns = thread_cpu_s(tid) - cpu0, sender.turns - turns0
        assert sender.alive
        assert sender.seq == 0 and sender.sent == 0 and sender.reports == 0
        assert sender._send_drops == 0, "a report was built for a peer that is not there"
        assert sender.drops == t.steps - len(sender._queue), "each report dropped is counted once"
        assert len(sender._queue) == min(sender._queue_size, t.steps)
        assert sender.drops > 0
        # wake-ups: its own backoff timer, plus the queue crossing its wake mark once
        assert turns <= retry_turns_bound(elapsed, sender) + 1, (turns, elapsed)
        assert cpu < 0.05 * elapsed, f"sender thread used {cpu:.3f} s of CPU in {elapsed:.1f} s"
        assert t.monitor.errors == 0 and sender.errors == 0
    finally:
        t.stop()
    assert not sender.alive


def test_an_agent_that_reaches_no_aggregator_says_so_during_the_run_and_again_once_one_answers(tmp_path, caplog,
                                                                                                 monkeypatch):
    """A wrong endpoint, or an aggregator not started, is said during the run, not only at close
    (a multi-day job would learn it at its end): once UNREACHED_WARN_S (1 s here) pass without any
    connection the agent warns, once, naming the endpoint; when an aggregator then answers, it
    says that too. Training never waits."""
    from gradwatch.agent import transport

    monkeypatch.setattr(transport, "UNREACHED_WARN_S", 1.0)
    caplog.set_level("WARNING", logger="gradwatch.agent")
    port = free_port()
    t = Trainer(f"tcp://127.0.0.1:{port}", step_sleep_s=0.005, every=5, heartbeat_s=0.2).start()
    agg = None
    try:
        def said(text):
            return [r.getMessage() for r in caplog.records if text in r.getMessage()]

        (msg,) = wait_for(lambda: said("no aggregator reached"), 30, what="the warning after 1 s unreached")
        assert f"tcp://127.0.0.1:{port}" in msg and "GRADWATCH_ENDPOINT" in msg
        time.sleep(1.0)
        assert len(said("no aggregator reached")) == 1  # once
        agg = start_aggregator(tmp_path, "--publish-interval-s", "0.05", port=port)
        wait_for(lambda: said("reached the aggregator at"), 30, what="the warning that it is reached now")
        assert len(said("reached the aggregator at")) == 1 and t.sender.connected
    finally:
        t.stop()
        if agg is not None:
            agg.stop()
    assert t.monitor.errors == 0 and t.sender.errors == 0


def _rank_step(agg) -> float:
    got = samples(agg.scrape(), "gradwatch_rank_step")
    return max((v for k, v in got.items() if ("job_id", "outage") in k), default=-1.0)


def _metrics_back_after(agg, t: Trainer, what: str, within_s: float = 5.0) -> float:
    """Seconds until /metrics shows a step the trainer took after the aggregator (re)appeared."""
    start, step = time.monotonic(), t.steps
    wait_for(lambda: _rank_step(agg) >= step, timeout=within_s, interval=0.05,
             what=f"metrics back within {within_s} s {what}")
    return time.monotonic() - start


def test_late_killed_and_stopped_aggregator_metrics_come_back_and_sender_stays_idle(tmp_path):
    """The agent trains with nothing listening, then a real aggregator comes up; it is killed
    (SIGKILL) for 3 s and restarted on the same port; then stopped (SIGSTOP) for 4 s. Each time
    the rank's step is back on /metrics within 5 s of the aggregator's return; during each
    outage the sender thread turns no more than its backoff allows; every report is sent,
    dropped (counted once) or still queued; nothing raises."""
    port = free_port()
    t = Trainer(f"tcp://127.0.0.1:{port}", step_sleep_s=0.005, every=5, heartbeat_s=0.5).start()
    sender, agg = t.sender, None
    try:
        time.sleep(1.5)
        agg = start_aggregator(tmp_path, "--publish-interval-s", "0.05", port=port)
        _metrics_back_after(agg, t, "of a late aggregator")

        agg.proc.send_signal(signal.SIGKILL)
        agg.proc.wait(10)
        turns0, t0 = sender.turns, time.monotonic()
        time.sleep(3.0)
        turns, elapsed = sender.turns - turns0, time.monotonic() - t0
        probes = 3.0 / (5 * 0.005) + 2  # urgent wake-ups (probes), at most one per 5 steps
        assert turns <= retry_turns_bound(elapsed, sender) + probes, (turns, elapsed)
        agg = start_aggregator(tmp_path, "--publish-interval-s", "0.05", port=port)
        _metrics_back_after(agg, t, "of a restarted aggregator")

        os.kill(agg.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(4.0)
        finally:
            os.kill(agg.proc.pid, signal.SIGCONT)
        _metrics_back_after(agg, t, "of an aggregator resumed after SIGSTOP")
    finally:
        t.stop()
        if agg is not None:
            agg.stop()
    assert sender.reports + sender.drops + sender.pending == t.steps
    assert sender.reports > 0 and not sender.alive
    assert t.monitor.errors == 0 and sender.errors == 0


def test_an_unready_report_holds_back_later_reports_not_heartbeats(collector):
    """A report whose data has not arrived (a CUDA event not yet reached: ``ready`` False) holds
    back the reports after it, in order, but never the heartbeats; once ready, all go out."""
    from gradwatch import wire
    from agent.transport import Sender

    def header(seq):
        return wire.Header("unready", 0, 1, "boot", seq, time.time())

    def beat(h):
        return wire.Heartbeat(h, step=0, sent=0, drops=0, errors=0)

    def report(step):
        return lambda h: wire.Heartbeat(h, step=step, sent=0, drops=0, errors=0)  # any message: its step marks it

    arrived = threading.Event()
    s = Sender(collector.endpoint, header, lambda h: None, beat, heartbeat_s=0.05).start()
    try:
        collector.wait(lambda: s.connected and s.sent, what="the sender connected")
        s.submit(report(7), ready=arrived.is_set, urgent=True)
        s.submit(report(8), urgent=True)
        n = len(collector.msgs)
        collector.wait(lambda: len(collector.msgs) >= n + 5, what="heartbeats while a report is unready")
        assert all(m.step == 0 for m in collector.msgs), "a report overtook or skipped the unready one"
        arrived.set()
        collector.wait(lambda: [m.step for m in collector.msgs if m.step] == [7, 8], what="both reports, in order")
    finally:
        s.close()
    assert s.reports == 2 and s.drops == 0 and s.errors == 0
