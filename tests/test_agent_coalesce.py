"""The agent's side of a large job: a bounded message rate per rank, schema traffic bounded.

The sender coalesces the records of unprobed steps into ``wire.Steps`` messages (``coalesce_s``),
sends a probe's report right after the steps before it, flushes at once at an anomaly, sends
heartbeats only when nothing else went out, and backs its schema resends off. Real ZeroMQ sockets
bound here, real monitors on real models; the timing rules are checked on the sender's own
(injectable) clock or as properties of what was sent, so they hold on a loaded machine.
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch
import torch.nn as nn
import zmq

from gradwatch import agent, wire
from gradwatch.agent.transport import BATCH_BYTES, SCHEMA_BACKOFF, SCHEMA_JITTER, SCHEMA_RANKS, Sender, schema_spread

from .conftest import free_port

pytestmark = pytest.mark.timeout(120)


# --- harness ---------------------------------------------------------------------------------------


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def train(model, opt, steps: int, x=None, sleep_s: float = 0.0, monitor=None, scale=None) -> None:
    """``steps`` optimizer steps; ``scale(step)`` multiplies the loss (NaN, a spike)."""
    x = torch.randn(4, 8) if x is None else x
    for _ in range(steps):
        loss = model(x).square().mean()
        if scale is not None:
            loss = loss * scale(monitor.step)
        if monitor is not None:
            monitor.observe_loss(loss)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if sleep_s:
            time.sleep(sleep_s)


def stream(collector) -> list:
    """Reports and steps messages received, in order (schemas and heartbeats left out)."""
    return [m for m in collector.msgs if isinstance(m, (wire.Report, wire.Steps))]


def layout(msgs) -> list:
    """Each message as ``("report", step)`` or ``("steps", first, last)``."""
    return [("report", m.step) if isinstance(m, wire.Report) else ("steps", int(m.step[0]), int(m.step[-1])) for m in msgs]


def same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


class Refusing:
    """A socket whose ``send`` ZeroMQ refuses (``zmq.Again``, as at the high-water mark) while
    ``refuse`` is set; everything else is the real socket's."""

    def __init__(self, sock):
        self._sock = sock
        self.refuse = False

    def send(self, frame, flags=0):
        if self.refuse:
            raise zmq.Again()
        return self._sock.send(frame, flags)

    def __getattr__(self, name):
        return getattr(self._sock, name)


def header(seq: int) -> wire.Header:
    return wire.Header("coalesce", 0, 1, "boot", seq, time.time())


def record(step: int, *, schema: str = "s", norms: int = 0, sq_dims=None, grad_norm: float = 1.0, nonfinite: int = 0,
           probe: bool = False):
    """A builder of one step's report, unprobed unless ``probe`` (then with empty probe arrays)."""
    def build(h):
        arrays = {}
        if probe:
            arrays = dict(act=np.zeros((0, 6)), act_grad=np.zeros((0, 2)), param=np.zeros((0, 3)),
                          fp_grad=np.zeros(0, np.uint64), fp_weight=np.zeros(0, np.uint64))
        return wire.Report(h, schema, step, 0.001 * (step + 1), grad_norm, nonfinite, probe=probe, loss=float(step),
                           grad_norms=np.full(norms, step, np.float32) if norms else None,
                           grad_sq=tuple((d, float(step)) for d in sq_dims) if sq_dims is not None else None, **arrays)
    return build


def sender(collector, clock=None, **kw) -> Sender:
    """A sender to ``collector`` whose heartbeats say ``closing`` once it stops; ``beat_at`` keeps
    the clock's time of each heartbeat it built (built only to go out at once)."""
    s: Sender = None  # type: ignore[assignment]
    clock = clock or time.monotonic

    def beat(h):
        s.beat_at.append(clock())
        return wire.Heartbeat(h, step=0, sent=s.sent, drops=s.drops, errors=0, closing=s._stop.is_set())

    s = Sender(collector.endpoint, header, kw.pop("schema", lambda h: None), beat, clock=clock, **kw)
    s.beat_at = []
    return s


def turn(s: Sender, clock: Clock | None = None, dt: float = 0.0, timeout_s: float = 20.0) -> None:
    """Move ``clock`` on by ``dt`` and return once the sender has finished a whole turn after it."""
    if clock is not None:
        clock.t += dt
    n, deadline = s.turns, time.monotonic() + timeout_s
    while s.turns < n + 2:  # turn n+1 started after the move; n+2 starts once it finished
        assert time.monotonic() < deadline, "the sender thread took no turn"
        s._wake.set()
        time.sleep(0.001)


def connected(s: Sender, collector, clock: Clock | None = None, timeout_s: float = 30.0) -> None:
    """Wait until the sender reached the collector and sent its first heartbeat. The clock moves
    on meanwhile (10 ms a turn): a sender refused while the connection completes retries after a
    backoff on its own clock."""
    deadline = time.monotonic() + timeout_s
    while not (s.connected and collector.of(wire.Heartbeat)):
        assert time.monotonic() < deadline, "the sender did not connect"
        turn(s, clock, 0.01)
        collector.pump(0.01)
    turn(s, clock)  # the connect event's heartbeat and schema, if any, are out


def move_to(s: Sender, clock: Clock, t: float) -> None:
    """Set ``clock`` to ``t`` and wait for a whole turn of the sender after it."""
    turn(s, clock, t - clock.t)


# --- coalescing on a real monitor -----------------------------------------------------------------


def test_fast_steps_go_out_a_few_messages_a_second_every_record_once_in_order_with_its_values(collector):
    """1 ms steps for 1 s (a rank of 2, so each record carries per-parameter norms): at most
    elapsed / coalesce_s + 2 steps messages (one more at close, one cut short at the probe), every
    step's record exactly once and in order, each value (every column, the norms bit for bit)
    what the step's own report held; sequence numbers one per message."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    # a deep queue: a sender starved on a loaded machine must not drop what this test counts
    monitor = agent.attach(model, opt, endpoint=collector.endpoint, every=100_000, rank=0, world_size=2,
                           job="fast", heartbeat_s=0.5, queue_size=10_000)
    built = {}
    finalise = monitor._finalise

    def capture(h, partial, host):  # the report each step would have travelled as
        r = finalise(h, partial, host)
        built[r.step] = r
        return r

    monitor._finalise = capture
    try:
        collector.wait(lambda: collector.of(wire.Heartbeat), what="the agent connected")
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.0:
            train(model, opt, 1, sleep_s=0.001, monitor=monitor)
        elapsed = time.monotonic() - t0
        n = monitor.step
    finally:
        monitor.close()
    collector.wait(lambda: len(collector.records()) >= n, what=f"the records of {n} steps")
    steps = collector.of(wire.Steps)
    assert n > 100, "the steps were not fast"
    assert len(steps) <= elapsed / monitor.cfg.coalesce_s + 2, (len(steps), n, elapsed)
    got = collector.records()
    assert [r.step for r in got] == list(range(n)), "a record missing, repeated or out of order"
    assert got[0].probe and not any(r.probe for r in got[1:])
    for r in got[1:]:
        want = built[r.step]
        for c in wire.STEP_COLUMNS:
            assert same(getattr(r, c.name), getattr(want, c.name)), (r.step, c.name)
        assert r.grad_norms.tobytes() == want.grad_norms.tobytes(), r.step
        assert r.schema == want.schema and r.schema
    assert not math.isnan(got[-1].loss)
    seqs = [m.header.seq for m in collector.msgs]
    assert seqs == list(range(len(seqs)))
    assert monitor.sender.reports == n and monitor.sender.drops == 0 and monitor.sender.errors == 0


def test_steps_before_a_probe_go_out_first_and_the_probe_right_after(collector):
    """every=5 with coalesce_s 10: nothing but the probes (and close) sends the batch, so the
    stream is exactly report 0, steps 1-4, report 5, steps 6-9, report 10, steps 11 (at close),
    each probe's report the message right after the steps before it."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with agent.attach(model, opt, endpoint=collector.endpoint, every=5, coalesce_s=10.0, job="probe") as monitor:
        collector.wait(lambda: collector.of(wire.Heartbeat), what="the agent connected")
        train(model, opt, 12)
        collector.wait(lambda: 10 in collector.reports(), what="the probe of step 10")
        assert 11 not in collector.reports(), "the batch went out before its time"
    collector.wait(lambda: 11 in collector.reports(), what="step 11, flushed at close")
    msgs = stream(collector)
    assert layout(msgs) == [("report", 0), ("steps", 1, 4), ("report", 5), ("steps", 6, 9), ("report", 10), ("steps", 11, 11)]
    for before, probe in ((msgs[1], msgs[2]), (msgs[3], msgs[4])):
        assert probe.probe and probe.header.seq == before.header.seq + 1
    assert monitor.sender.batches == 3 and monitor.sender.reports == 12


@pytest.mark.parametrize("fault", ["nan", "spike"])
def test_an_anomalous_step_goes_out_at_once(collector, fault):
    """coalesce_s 10 and no burst: a step with a NaN gradient, or a gradient norm 10^4 times the
    recent median (the schedule's spike), sends the batch it joins at once, ending at that step,
    while the steps after it wait for their time."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights stay: only step 6 is odd
    bad = {"nan": math.nan, "spike": 1e4}[fault]
    with agent.attach(model, opt, endpoint=collector.endpoint, every=100_000, burst=0, coalesce_s=10.0,
                      job=fault) as monitor:
        def clean(o, args, kwargs):  # after the agent's hook saw them: NaN * lr 0 would still be NaN weights
            for p in model.parameters():
                p.grad.nan_to_num_(0.0)

        opt.register_step_pre_hook(clean)
        collector.wait(lambda: collector.of(wire.Heartbeat), what="the agent connected")
        train(model, opt, 10, monitor=monitor, scale=lambda step: bad if step == 6 else 1.0)
        t0 = time.monotonic()
        collector.wait(lambda: 6 in collector.reports(), timeout_s=8.0, what="the anomalous step, before coalesce_s")
        waited = time.monotonic() - t0
        assert 7 not in collector.reports()
    rec = collector.reports()[6]
    assert (rec.grad_nonfinite > 0) if fault == "nan" else (rec.grad_norm > 1e3), rec
    assert layout(stream(collector))[:2] == [("report", 0), ("steps", 1, 6)], waited
    collector.wait(lambda: 9 in collector.reports(), what="the rest, at close")
    assert layout(stream(collector))[2:] == [("steps", 7, 9)]


def test_close_sends_the_batch_and_then_the_goodbye(collector):
    """A batch far from its time (coalesce_s 10) goes out at close, then the goodbye, last."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    monitor = agent.attach(model, opt, endpoint=collector.endpoint, every=100_000, coalesce_s=10.0, job="close")
    collector.wait(lambda: collector.of(wire.Heartbeat), what="the agent connected")
    train(model, opt, 20)
    t0 = time.monotonic()
    monitor.close()
    assert time.monotonic() - t0 < 2.0
    collector.wait(lambda: 19 in collector.reports() and collector.msgs[-1].__class__ is wire.Heartbeat,
                   what="the batch and the goodbye")
    assert [r.step for r in collector.records()] == list(range(20))
    assert layout(stream(collector)) == [("report", 0), ("steps", 1, 19)]
    bye = collector.msgs[-1]
    assert bye.closing and bye.reason == "closed" and bye.schema == collector.records()[0].schema
    assert monitor.sender.pending == 0 and monitor.sender.drops == 0


def test_heartbeats_carry_the_schema_hash_only_when_quiet_and_a_goodbye_always(collector):
    """While steps flow every heartbeat came at least heartbeat_s after the message before it (the
    rule, checked on the send times, holds however loaded the machine is), and far fewer
    heartbeats than steps messages went out; each carries the hash of the schema ("" before the
    first probe); the goodbye comes last, right after the final steps if need be."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    hb = 0.3
    monitor = agent.attach(model, opt, endpoint=collector.endpoint, every=100_000, heartbeat_s=hb, coalesce_s=0.02,
                           job="quiet")
    try:
        first = collector.wait(lambda: collector.of(wire.Heartbeat), what="the agent connected")[0]
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.5:
            train(model, opt, 1, sleep_s=0.002)
    finally:
        monitor.close()
    collector.wait(lambda: collector.msgs[-1].__class__ is wire.Heartbeat and collector.msgs[-1].closing, what="the goodbye")
    assert first.schema == ""
    digest = collector.records()[0].schema
    msgs = collector.msgs
    flowing = next(k for k, m in enumerate(msgs) if isinstance(m, wire.Steps))
    beats = [k for k, m in enumerate(msgs) if isinstance(m, wire.Heartbeat) and k > flowing]
    assert beats[-1] == len(msgs) - 1 and sum(m.closing for m in collector.of(wire.Heartbeat)) == 1
    for k in beats[:-1]:  # the goodbye does not wait
        gap = msgs[k].header.time - msgs[k - 1].header.time
        assert gap >= hb * 0.9, f"a heartbeat {gap:.3f} s after the message before it, while steps flowed"
    assert all(msgs[k].schema == digest for k in beats)
    assert len(beats) - 1 < len(collector.of(wire.Steps)) / 4, (len(beats), len(collector.of(wire.Steps)))


# --- the sender on its own clock ------------------------------------------------------------------


def test_heartbeats_wait_for_a_quiet_heartbeat_s_on_the_senders_clock(collector):
    """Fake clock, heartbeat_s 1, coalesce_s 0.25: 2 s of records every 10 ms send steps messages
    every 0.25 s and no heartbeat; once they stop the batch goes out at its time and a heartbeat
    comes 1 s after it, not before; close sends the goodbye after it."""
    clock = Clock()
    s = sender(collector, clock, heartbeat_s=1.0, coalesce_s=0.25).start()
    try:
        connected(s, collector, clock)
        beats, start = len(s.beat_at), len(collector.msgs)
        for k in range(200):
            s.submit(record(k))
            turn(s, clock, 0.01)
        assert len(s.beat_at) == beats, f"a heartbeat while steps flowed, at {s.beat_at[beats:]}"
        assert 7 <= s.batches <= 8, s.batches
        turn(s, clock, 0.3)  # the last batch's time
        assert s.pending == 0 and s.reports == 200
        flushed = clock.t
        turn(s, clock, 0.9)
        assert len(s.beat_at) == beats, "a heartbeat before heartbeat_s of quiet"
        turn(s, clock, 0.2)
        assert s.beat_at[beats:] == [pytest.approx(flushed + 1.1)]
    finally:
        s.close()
    collector.wait(lambda: collector.of(wire.Heartbeat)[-1].closing, what="the goodbye")
    tail = [type(m).__name__ for m in collector.msgs[start:]]
    assert tail == ["Steps"] * s.batches + ["Heartbeat", "Heartbeat"], tail
    assert [r.step for r in collector.records()] == list(range(200))
    assert s.drops == 0 and s.errors == 0


def test_schema_resends_back_off_from_schema_every_s_to_32_times_it_and_restart_on_a_change(collector):
    """Fake clock, schema_every_s 10: after the one sent on connect the schema goes out again 10,
    20, 40, ... 320, 320 s later, never in between; a change (request_schema) sends it at once
    and starts the backoff over at 10 s."""
    clock = Clock()
    params = (("w", (2,), "float32"),)
    sent_at = []

    def schema(h):
        sent_at.append(clock.t)
        return wire.Schema(h, "host", 0, 0, params, ())

    s = sender(collector, clock, schema=schema, schema_every_s=10.0, schema_jitter=0.0, heartbeat_s=1e9).start()
    try:
        connected(s, collector, clock)
        start = len(sent_at)
        assert start >= 1 and collector.of(wire.Schema)
        gaps = [10.0 * min(2 ** k, SCHEMA_BACKOFF) for k in range(8)]
        assert gaps[-2:] == [320.0, 320.0]
        for gap in gaps:
            move_to(s, clock, sent_at[-1] + gap - 0.5)
            assert len(sent_at) == start, f"a resend before its {gap} s"
            move_to(s, clock, sent_at[-1] + gap)
            assert len(sent_at) == start + 1, f"no resend after {gap} s"
            start += 1
        turn(s, clock, 100.0)
        s.request_schema()
        turn(s, clock)
        assert len(sent_at) == start + 1 and sent_at[-1] == clock.t, "a changed schema waits"
        move_to(s, clock, sent_at[-1] + 9.5)
        assert len(sent_at) == start + 1
        move_to(s, clock, sent_at[-1] + 10.0)
        assert len(sent_at) == start + 2, "the backoff did not start over"
    finally:
        s.close()
    diffs = np.diff(sent_at[-len(gaps) - 3:-2])
    assert diffs.tolist() == pytest.approx(gaps)
    collector.wait(lambda: len(collector.of(wire.Schema)) >= len(sent_at), what="every schema sent")


def test_attach_gives_the_sender_its_world_for_the_resend_spread(collector):
    """attach passes the job's world size on: a rank of a 4,096-rank job spreads its resends 4
    times as wide."""
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = agent.attach(model, opt, endpoint=collector.endpoint, rank=3, world_size=4096, schema_every_s=10.0)
    try:
        assert monitor.sender.schema_timer.spread == 4.0 and monitor.sender.schema_timer.jitter == SCHEMA_JITTER
    finally:
        monitor.close()


def test_schema_spread_is_1_up_to_schema_ranks_then_world_over_it():
    assert [schema_spread(w) for w in (1, 8, SCHEMA_RANKS)] == [1.0, 1.0, 1.0]
    assert [schema_spread(w) for w in (2 * SCHEMA_RANKS, 16 * SCHEMA_RANKS)] == [2.0, 16.0]


class _Draws:
    """A random source that always draws ``u``: 1.0 puts each resend as late as it may come, 0.0
    as early."""

    def __init__(self, u: float):
        self.u = u

    def random(self) -> float:
        return self.u


@pytest.mark.parametrize("world, u, gaps", [
    # a small job: the gap and up to the gap late, the gap doubling to 320 s
    (8, 1.0, (20.0, 40.0, 80.0, 160.0, 320.0, 640.0, 640.0)),
    # 16,384 ranks (spread 16): up to min(gap x 16, 320 s) late, never more than 320 s late
    (16_384, 1.0, (170.0, 340.0, 360.0, 400.0, 480.0, 640.0, 640.0)),
    # the earliest draws: the stretch never brings a resend sooner than its gap
    (16_384, 0.0, (10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 320.0)),
])
def test_schema_resends_come_gap_plus_jitter_x_min_gap_x_spread_top_apart(collector, world, u, gaps):
    """Fake clock, schema_every_s 10, jitter 1, every draw ``u``: the resends come exactly
    ``gaps`` apart, never sooner; a change still goes out at once and starts the gaps over."""
    clock = Clock()
    sent_at = []

    def schema(h):
        sent_at.append(clock.t)
        return wire.Schema(h, "host", 0, 0, (("w", (2,), "float32"),), ())

    s = sender(collector, clock, schema=schema, schema_every_s=10.0, world=world, schema_jitter=1.0,
               heartbeat_s=1e9)
    s.schema_timer.rng = _Draws(u)
    s.start()
    try:
        connected(s, collector, clock)
        start = len(sent_at)
        assert start >= 1
        for k, gap in enumerate(gaps):
            move_to(s, clock, sent_at[-1] + gap - 0.5)
            assert len(sent_at) == start + k, f"a resend before its {gap} s"
            move_to(s, clock, sent_at[-1] + gap)
            assert len(sent_at) == start + k + 1, f"no resend after {gap} s"
        done = len(sent_at)
        turn(s, clock, 1.0)
        s.request_schema()
        turn(s, clock)
        assert len(sent_at) == done + 1 and sent_at[-1] == clock.t, "a changed schema waits"
        move_to(s, clock, sent_at[-1] + gaps[0] - 0.5)
        assert len(sent_at) == done + 1, "a resend before the first gap after the change"
        move_to(s, clock, sent_at[-1] + gaps[0])
        assert len(sent_at) == done + 2, "the gaps did not start over after the change"
    finally:
        s.close()


def test_a_schema_change_requested_while_the_schema_is_built_is_not_lost(collector):
    """request_schema() from the training thread while the sender builds the schema: the new
    schema goes out at the next turn, not at the next timed resend."""
    clock = Clock()
    built = []
    s = None

    def schema(h):
        built.append(clock.t)
        if len(built) == 2:  # the first send on demand after connect: a change comes meanwhile
            s.request_schema()
        return wire.Schema(h, "host", 0, 0, (("w", (2,), "float32"),), ())

    s = sender(collector, clock, schema=schema, schema_every_s=10.0, heartbeat_s=1e9)
    s.start()
    try:
        connected(s, collector, clock)
        assert len(built) == 1
        s.request_schema()
        turn(s, clock)
        turn(s, clock)
        assert len(built) == 3 and built[2] == built[1] == clock.t, built
    finally:
        s.close()


def test_a_negative_schema_jitter_is_refused(collector):
    with pytest.raises(ValueError, match="schema_jitter"):
        sender(collector, schema_jitter=-0.5)


def test_schema_resends_come_up_to_schema_jitter_of_each_gap_late_at_random(collector):
    """With the default jitter each resend comes 0-100 % of its gap late, drawn at random: the
    ranks of a job that started together do not resend as one wave."""
    clock = Clock()
    sent_at = []

    def schema(h):
        sent_at.append(clock.t)
        return wire.Schema(h, "host", 0, 0, (("w", (2,), "float32"),), ())

    s = sender(collector, clock, schema=schema, schema_every_s=10.0, heartbeat_s=1e9).start()
    try:
        connected(s, collector, clock)
        start = len(sent_at)
        assert start >= 1
        most = 1 + SCHEMA_JITTER
        for k in range(4):  # resends 10, 20, 40, 80 s apart, each up to SCHEMA_JITTER of that later
            gap = 10.0 * 2 ** k
            move_to(s, clock, sent_at[-1] + gap - 0.5)
            assert len(sent_at) == start + k, f"a resend before its {gap} s"
            for t in np.arange(gap, most * gap + 1.0, gap / 50):
                move_to(s, clock, sent_at[start + k - 1] + t)
                if len(sent_at) > start + k:
                    break
            assert len(sent_at) == start + k + 1, f"no resend within {most} x {gap} s"
    finally:
        s.close()
    late = [(b - a) / (10.0 * 2 ** k) for k, (a, b) in enumerate(zip(sent_at[start - 1:], sent_at[start:]))]
    assert all(1.0 <= x <= most + 0.03 for x in late) and len({round(x, 3) for x in late}) > 1, late


def test_a_refused_steps_message_drops_each_of_its_records_once(collector):
    """ZeroMQ refuses (the high-water mark) the batch of 10 records flushed before a probe: the
    10 records and the probe are dropped, counted once each (drops 11), nothing is retried or
    spun on; once ZeroMQ takes messages again the next ones go out and say drops 11."""
    clock = Clock()
    s = sender(collector, clock, coalesce_s=10.0)
    s.link.sock = Refusing(s.link.sock)
    s.start()
    try:
        connected(s, collector, clock)
        for k in range(10):
            s.submit(record(k))
        turn(s, clock)
        assert len(s._batch) == 10 and s.pending == 10
        s.link.sock.refuse = True
        blocked = s.blocked
        s.submit(record(10, probe=True), urgent=True)
        turn(s, clock)
        assert s.drops == 11 and s._send_drops == 11 and s.reports == 0 and s.pending == 0
        assert s.blocked == blocked + 1 and s.retry_at > clock.t  # backing off, not spinning
        s.link.sock.refuse = False
        for k in range(11, 14):
            s.submit(record(k))
        s.submit(record(14, probe=True))
        turn(s, clock, 1.0)
        collector.wait(lambda: 14 in collector.reports(), what="the records after the refusal")
    finally:
        s.close()
    got = collector.records()
    assert [r.step for r in got] == [11, 12, 13, 14]
    assert collector.of(wire.Steps)[-1].drops == 11  # the probe's builder here says none
    assert s.drops == 11 and s.reports == 4 and s.errors == 0


def test_records_that_cannot_share_a_message_and_a_full_batch_split_it(collector):
    """A new schema hash, another grad_norms width, other grad_sq dims or a step that is not after
    the last one each start a new steps message; wire.MAX_STEPS records make a message full, and
    so do BATCH_BYTES of them; every record arrives once."""
    clock = Clock()
    s = sender(collector, clock, coalesce_s=10.0, queue_size=10_000)
    s.start()
    try:
        connected(s, collector, clock)
        builds = [record(0), record(1), record(2, schema="t"), record(3, schema="t", norms=4), record(4, schema="t", norms=4),
                  record(5, schema="t", norms=5), record(6, schema="t", sq_dims=[(0,)]), record(7, schema="t", sq_dims=[(0,)]),
                  record(8, schema="t", sq_dims=[(1,)]), record(8, schema="t", sq_dims=[(1,)])]
        for b in builds:
            s.submit(b)
        s.submit(record(9, probe=True))
        turn(s, clock)
        collector.wait(lambda: 9 in collector.reports(), what="the split batch")
        assert layout(stream(collector)) == [("steps", 0, 1), ("steps", 2, 2), ("steps", 3, 4), ("steps", 5, 5),
                                             ("steps", 6, 7), ("steps", 8, 8), ("steps", 8, 8), ("report", 9)]
        got = collector.reports()
        assert got[4].grad_norms.tolist() == [4.0] * 4 and got[7].grad_sq == (((0,), 7.0),) and got[2].schema == "t"
        width = (BATCH_BYTES // (4 * 1000)) + 1  # records of 1,000 norms: full after this many
        n = wire.MAX_STEPS + 5
        for k in range(n):
            s.submit(record(10 + k))
        for k in range(width):
            s.submit(record(10 + n + k, norms=1000))
        turn(s, clock)
        s.submit(record(20 + n + width, probe=True))
        turn(s, clock)
        collector.wait(lambda: 20 + n + width in collector.reports(), what="the full batches")
    finally:
        s.close()
    sizes = [len(m) for m in collector.of(wire.Steps)][7:]
    assert sizes[0] == wire.MAX_STEPS and sizes[1] == 5 and sum(sizes[2:]) == width and max(sizes[2:]) < width
    assert s.drops == 0 and s.errors == 0


def test_coalesce_s_is_validated_and_read_from_the_environment(monkeypatch):
    from gradwatch.agent.config import load

    assert load().coalesce_s == 0.25
    for bad in (-0.1, 10.5):
        with pytest.raises(agent.ConfigError, match=r"\bcoalesce_s\b"):
            load(coalesce_s=bad)
    monkeypatch.setenv("GRADWATCH_COALESCE_S", "0")
    assert load().coalesce_s == 0.0


def test_coalesce_s_0_sends_each_turns_records_at_once(collector):
    """coalesce_s 0: the records a turn finds go out in that turn, without waiting for a timer."""
    clock = Clock()
    s = sender(collector, clock, coalesce_s=0.0).start()
    try:
        connected(s, collector, clock)
        for k in range(3):
            s.submit(record(k))
            turn(s, clock)
            collector.wait(lambda: k in collector.reports(), timeout_s=5, what=f"step {k} in its turn")
    finally:
        s.close()
    assert layout(stream(collector)) == [("steps", 0, 0), ("steps", 1, 1), ("steps", 2, 2)]


def test_the_last_messages_get_a_bounded_linger_at_close_and_none_without_an_aggregator(collector):
    """With LINGER 0 at close ZeroMQ drops what it has taken but not yet written: now and then the
    goodbye, and a job that closed properly would be named silent. A connected sender closes its
    socket with CLOSE_LINGER_MS (bounded); one that never connected with none (exit never waits)."""
    from gradwatch.agent.transport import CLOSE_LINGER_MS

    def closing_linger(s) -> list:
        seen, close = [], s.link.sock.close

        def record(linger=None):
            seen.append(linger)
            close(linger=linger)

        s.link.sock.close = record
        s.close(timeout=5.0)
        return seen

    s = sender(collector)
    s.start()
    connected(s, collector)
    assert closing_linger(s) == [CLOSE_LINGER_MS] and 0 < CLOSE_LINGER_MS <= 500
    collector.pump(1.0)
    assert any(isinstance(m, wire.Heartbeat) and m.closing for m in collector.msgs)  # the goodbye came
    lonely = Sender(f"tcp://127.0.0.1:{free_port()}", header, lambda h: None, lambda h: wire.Heartbeat(h, 0, 0, 0, 0))
    lonely.start()
    assert closing_linger(lonely) == [0]
