"""The control channel's parts: the wire's command, stack and ack (round trips, bounds, fuzz); an
agent's command checks against a real ROUTER socket; the stack it takes; the probe window and
budget override of its schedule; the aggregator's control room and HTTP endpoints; CURVE with
forged commands and answers; the aggregator away (SIGSTOP) while commands come and go."""

from __future__ import annotations

import math
import os
import random
import signal
import subprocess
import sys
import threading
import time

import msgpack
import pytest
import requests
import torch
import torch.nn as nn
import zmq

from gradwatch import agent, auth, wire
from gradwatch.agent import control as agent_control
from gradwatch.agent.hooks import ProbeRecorder
from gradwatch.agent.schedule import ProbeSchedule
from gradwatch.agent.stats import Reducer
from gradwatch.agent.transport import COMMANDS_PER_S, SEEN_IDS, Identity, Inbox
from gradwatch.aggregator import Aggregator, load
from gradwatch.aggregator import control as room
from gradwatch.commands import cli
from gradwatch.commands.control import format_stacks

from .conftest import Collector, samples, start_aggregator, wait_for

pytestmark = pytest.mark.timeout(120)

TOKEN = "control-test-token-0123456789"
NOW = 1.7e9


def command(args, *, cid: int = 7, job: str = "j", rank: int = -1, boot: str = "", issued: float | None = None,
            ttl: float = 60.0) -> wire.Command:
    issued = time.time() if issued is None else issued
    return wire.Command(cid, job, rank, boot, issued, issued + ttl, args)


ARGS = [wire.StacksArgs(True), wire.ProbeArgs(5, 10, ("blocks.*", "head")), wire.BudgetArgs(0.05, 30.0),
        wire.HaltArgs(12, "nonfinite", "NaN at step 11")]


# --- the wire --------------------------------------------------------------------------------------


@pytest.mark.parametrize("args", ARGS, ids=[a.__struct_config__.tag for a in ARGS])
def test_a_command_round_trips_through_plain_msgpack_both_ways(args):
    cmd = command(args, cid=(1 << 63) - 1)
    frame = wire.encode(cmd)
    assert len(frame) <= wire.MAX_COMMAND_BYTES
    assert wire.decode_command(frame) == cmd and cmd.action == args.__struct_config__.tag
    m = msgpack.unpackb(frame)
    assert m["kind"] == "command" and m["v"] == wire.PROTOCOL_VERSION == 4 and m["args"]["kind"] == cmd.action
    again = msgpack.packb(dict(reversed(list(m.items()))))  # another encoder's key order
    assert wire.decode_command(again) == cmd


def test_a_stack_and_an_ack_round_trip_and_are_bounded():
    h = wire.Header("j", 1, 2, "boot", 3, NOW)
    frames = tuple(wire.Frame(f"/x/{i}.py", i, f"f{i}", "x = 1" if i % 2 else "") for i in range(wire.MAX_FRAMES))
    st = wire.Stack(h, 9, frames, 2.5, True, (wire.FlightEntry("gloo:all_reduce", "scheduled", "41"),), "", "")
    got = wire.decode(wire.encode(st))
    assert got == st and got.frames[0].where() == "/x/0.py:0 f0"
    ack = wire.Ack(h, 9, False, -1, "expired")
    assert wire.decode(wire.encode(ack)) == ack
    m = msgpack.unpackb(wire.encode(ack))
    m["why"] = "a reason a later agent may add"
    assert wire.decode(msgpack.packb(m)).why == "other"  # bounded: a metric may count by it
    m = msgpack.unpackb(wire.encode(st))
    m["frames"] = m["frames"] * 2  # 128 frames
    with pytest.raises(wire.WireError) as e:
        wire.decode(msgpack.packb(m))
    assert e.value.reason == "bad_field"


def test_commands_and_data_never_go_the_wrong_way():
    """The aggregator refuses a command from an agent, an agent every kind an agent sends: reason
    "direction"."""
    with pytest.raises(wire.WireError) as e:
        wire.decode(wire.encode(command(ARGS[0])))
    assert e.value.reason == "direction"
    h = wire.Header("j", 0, 1, "b", 0, NOW)
    for msg in (wire.Heartbeat(h, 0, 0, 0, 0), wire.Ack(h, 1, True), wire.Schema(h, "x", 0, 1, (), ())):
        with pytest.raises(wire.WireError) as e:
            wire.decode_command(wire.encode(msg))
        assert e.value.reason == "direction"


@pytest.mark.parametrize("change, reason", [
    (lambda m: m["args"].update(steps=1001), "bad_field"),
    (lambda m: m["args"].update(layers=["x"] * 17), "bad_field"),
    (lambda m: m["args"].update(layers=["x" * 201]), "bad_field"),
    (lambda m: m.update(args={"kind": "budget", "budget": 0.5, "for_s": 10}), "bad_field"),
    (lambda m: m.update(args={"kind": "budget", "budget": math.nan, "for_s": 10}), "bad_field"),
    (lambda m: m.update(args={"kind": "reboot"}), "unknown_kind"),
    (lambda m: m.update(expires=m["issued"] + 601), "bad_field"),
    (lambda m: m.update(expires=m["issued"] - 1), "bad_field"),
    (lambda m: m.update(issued=math.inf), "bad_field"),
    (lambda m: m.update(id=-1), "bad_field"),
    (lambda m: m.update(rank=-2), "bad_field"),
    (lambda m: m.pop("job"), "missing_field"),
    (lambda m: m.update(v=3), "version"),
])
def test_a_command_out_of_bounds_is_rejected_with_its_reason(change, reason):
    m = msgpack.unpackb(wire.encode(command(wire.ProbeArgs(5, 10))))
    change(m)
    with pytest.raises(wire.WireError) as e:
        wire.decode_command(msgpack.packb(m))
    assert e.value.reason == reason


def test_a_command_over_4_kib_is_neither_encoded_nor_decoded():
    big = command(wire.HaltArgs(1, "nonfinite", "s" * 512), job="j" * 256)
    m = msgpack.unpackb(wire.encode(big))
    m["padding"] = "x" * 4096  # an unknown key: ignored, but the frame is too large
    frame = msgpack.packb(m)
    with pytest.raises(wire.WireError) as e:
        wire.decode_command(frame)
    assert e.value.reason == "too_large"
    # within every bound (16 patterns of 200 characters), but 4-byte characters: over 4 KiB
    too_big = wire.Command(1, "j", -1, "", NOW, NOW + 1, wire.ProbeArgs(1, 1, tuple("\U0001F600" * 200 for _ in range(16))))
    with pytest.raises(ValueError, match="at most 4096"):
        wire.encode(too_big)


def test_twenty_thousand_fuzzed_command_frames_only_ever_raise_wire_errors_and_are_never_taken():
    """Random bytes and bit flips of valid commands through the agent's decoder and inbox: only
    WireError, and the inbox takes none of them for an agent they do not name."""
    rng = random.Random(5)
    valid = [wire.encode(command(a, job="victim")) for a in ARGS]
    inbox = Inbox(Identity("mine", 0, 1, "boot"))
    for i in range(20_000):
        if i % 3 == 0:
            frame = rng.randbytes(rng.randrange(0, 300))
        else:
            b = bytearray(rng.choice(valid))
            for _ in range(rng.randrange(1, 6)):
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
            frame = bytes(b)
        try:
            wire.decode_command(frame)
        except wire.WireError as e:
            assert e.reason in wire.REJECT_REASONS
        assert inbox.take(frame) is None
    assert inbox.accepted == 0 and sum(inbox.rejected.values()) == 20_000


# --- the agent's inbox, against a real ROUTER ------------------------------------------------------


def mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


class Training:
    """A model trained on a thread of its own (a few ms a step) under an attached agent."""

    def __init__(self, endpoint: str, **settings):
        self.model, self.opt = mlp()
        self.monitor = agent.attach(self.model, self.opt, endpoint=endpoint, heartbeat_s=0.1, **settings)
        self.steps = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            while not self._stop.is_set():
                self.model(torch.randn(4, 8)).square().mean().backward()
                self.opt.step()
                self.opt.zero_grad()
                self.steps += 1
                time.sleep(0.005)
        except BaseException as e:  # what the agent raised into training (Halt) or anything else
            self.error = e

    def stop(self):
        self._stop.set()
        self.thread.join(10)
        self.monitor.close()


def answers(collector: Collector, kind) -> list:
    return [m for m in collector.msgs if isinstance(m, kind)]


def test_an_agent_takes_only_commands_meant_for_it_once_each_at_most_ten_a_second(collector):
    """A real agent connected to the test's ROUTER: a stacks command for it is answered; one for
    another job, rank or boot, a malformed one, one over 4 KiB, a data message, and a replay of
    an id it saw are dropped and counted by reason; an expired one is refused with an ack; of 20
    sent at once at most COMMANDS_PER_S are taken within a second. Training never sees any of it."""
    t = Training(collector.endpoint, job="j")
    try:
        collector.wait(lambda: collector.peers, what="the agent connected")
        peer = collector.peers[-1]
        mon = t.monitor

        def send(frame: bytes):
            collector.sock.send_multipart([peer, frame])

        send(wire.encode(command(wire.StacksArgs(), cid=1)))
        stack = collector.wait(lambda: answers(collector, wire.Stack), what="the stack")[0]
        assert stack.command == 1 and stack.header.boot == mon.boot and stack.frames
        bad = {
            "job": command(wire.StacksArgs(), cid=2, job="other"),
            "rank": command(wire.StacksArgs(), cid=3, rank=5),
            "boot": command(wire.StacksArgs(), cid=4, boot="someone-else"),
            "replayed": command(wire.StacksArgs(), cid=1),
        }
        for c in bad.values():
            send(wire.encode(c))
        send(b"\x92\x01\x02")  # not a map
        send(msgpack.packb({"v": 4, "kind": "command", "padding": "x" * 5000}))
        send(wire.encode(wire.Heartbeat(wire.Header("j", 0, 1, "b", 0, NOW), 0, 0, 0, 0)))
        send(wire.encode(command(wire.StacksArgs(), cid=5, issued=time.time() - 120, ttl=60)))
        ack = collector.wait(lambda: answers(collector, wire.Ack), what="the expired command's refusal")[0]
        assert (ack.command, ack.accepted, ack.why) == (5, False, "expired")
        want = {"job": 1, "rank": 1, "boot": 1, "replayed": 1, "not_a_map": 1, "too_large": 1, "direction": 1}
        collector.wait(lambda: dict(mon.sender.inbox.rejected) == want, what=f"{want}")
        assert len(answers(collector, wire.Stack)) == 1  # the replay changed nothing
        # a flood: 20 at once, distinct ids
        base = mon.sender.inbox.accepted
        t0 = time.monotonic()
        for k in range(20):
            send(wire.encode(command(wire.StacksArgs(), cid=100 + k)))
        collector.wait(lambda: mon.sender.inbox.accepted + mon.sender.inbox.rejected["rate"] >= base + 20,
                       what="the flood read")
        taken = mon.sender.inbox.accepted - base
        if time.monotonic() - t0 < 1.0:  # read within a second (a loaded machine may take longer)
            assert taken <= COMMANDS_PER_S
        assert taken + mon.sender.inbox.rejected["rate"] == 20 and taken >= 1
        assert t.error is None and mon.errors == 0 and mon.sender.errors == 0 and t.thread.is_alive()
    finally:
        t.stop()


def test_an_oversized_frame_from_the_peer_costs_the_agent_its_connection_not_its_reports(collector):
    """A peer at the agent's endpoint (a misbehaving aggregator, or a process that bound its port
    while the aggregator was away) sends a frame past the socket's MAXMSGSIZE: ZeroMQ ends that
    session on a protocol error and never retries it by itself. The agent opens a new socket within
    REOPEN_AFTER_S and its reports reach the aggregator again; training never notices."""
    t = Training(collector.endpoint, job="big")
    try:
        collector.wait(lambda: collector.peers, what="the agent's first frame")
        collector.sock.send_multipart([collector.peers[-1], b"\0" * 100_000])
        collector.wait(lambda: t.monitor.sender.link.reopened >= 1, what="the agent's new socket")
        after = len(collector.msgs)
        collector.wait(lambda: len(collector.records(job="big")) and len(collector.msgs) > after + 3,
                       what="reports again after the oversized frame")
        assert len(set(collector.peers)) >= 2  # they came on the new connection
    finally:
        t.stop()
    assert t.error is None and t.monitor.sender.errors == 0


def test_the_inbox_remembers_the_last_ids_only():
    inbox = Inbox(Identity("j", 0, 1, "b"), clock=iter(range(0, 10**6, 2)).__next__)  # 2 s a command: no rate
    for cid in range(SEEN_IDS + 1):
        assert inbox.take(wire.encode(command(wire.StacksArgs(), cid=cid))) is not None
    assert inbox.take(wire.encode(command(wire.StacksArgs(), cid=SEEN_IDS))) is None  # seen
    assert inbox.take(wire.encode(command(wire.StacksArgs(), cid=0))) is not None  # forgotten
    assert inbox.rejected == {"replayed": 1}


def test_a_command_is_carried_out_only_within_its_time_window_on_this_hosts_clock():
    """Expired, or issued further ahead of the agent's clock than MAX_CLOCK_AHEAD_S (a forged or
    far-off clock: it would never expire here, and could be replayed once its id is forgotten):
    refused as expired, answered, never carried out. Within a skew of a minute: taken."""
    from gradwatch.agent.transport import MAX_CLOCK_AHEAD_S

    inbox = Inbox(Identity("j", 0, 1, "b"), wall=lambda: NOW, clock=iter(range(0, 10**6, 2)).__next__)
    cases = {1: NOW - 100.0, 2: NOW + MAX_CLOCK_AHEAD_S + 1.0, 3: NOW + 60.0, 4: NOW - 30.0}
    got = {cid: inbox.take(wire.encode(command(wire.StacksArgs(), cid=cid, issued=t)))[1] for cid, t in cases.items()}
    assert got == {1: "expired", 2: "expired", 3: "", 4: ""}


# --- what a command does in the agent ------------------------------------------------------------


def blocked_in_user_code(ready: threading.Event, go: threading.Event, depth: int = 0):
    if depth:
        return blocked_in_user_code(ready, go, depth - 1)
    ready.set()
    go.wait(30)  # the line the stack must name


def test_the_stack_of_a_blocked_thread_names_its_function_and_line_and_keeps_the_innermost_frames():
    ready, go = threading.Event(), threading.Event()
    th = threading.Thread(target=blocked_in_user_code, args=(ready, go, 100), daemon=True)
    th.start()
    ready.wait(10)
    line = blocked_in_user_code.__code__.co_firstlineno + 4

    def waiting():  # the thread in go.wait (Condition.wait, called by Event.wait, called there)
        f = sys._current_frames().get(th.ident)
        caller = f.f_back.f_back if f is not None and f.f_back is not None else None
        return caller is not None and caller.f_code is blocked_in_user_code.__code__ and caller.f_lineno == line

    wait_for(waiting, 10, 0.01, what="the thread blocked in go.wait")
    try:
        training = agent_control.Training(ident=th.ident)
        for source in (False, True):
            ctl = agent_control.Control(training, schedule=None, halt=agent_control.HaltAt(), stack_source=source)
            st = ctl(command(wire.StacksArgs(source=True)))(wire.Header("j", 0, 1, "b", 0, NOW))
            assert isinstance(st, wire.Stack) and st.command == 7 and not st.error
            assert len(st.frames) == wire.MAX_FRAMES  # 100 deep: the innermost 64 kept
            inner = [f for f in st.frames if f.function == "blocked_in_user_code"]
            assert len(inner) == wire.MAX_FRAMES - 2  # Event.wait and Condition.wait are the innermost two
            assert (inner[-1].file, inner[-1].line) == (__file__, line)
            assert (inner[-1].source == "go.wait(30)  # the line the stack must name") is source
            assert all(f.source == "" for f in st.frames) is not source
        gone = agent_control.Control(agent_control.Training(ident=-1), None, agent_control.HaltAt())
        st = gone(command(wire.StacksArgs()))(wire.Header("j", 0, 1, "b", 0, NOW))
        assert st.frames == () and st.error
    finally:
        go.set()
        th.join(10)


def schedule(every=None, **kw):
    return ProbeSchedule(every, 5, 10.0, ProbeRecorder(Reducer("off"), lambda *a: None), lambda *a: None, **kw)


def test_a_probe_window_probes_its_steps_once_whatever_the_cadence_and_ends():
    clock = [0.0]
    s = schedule(1000, clock=lambda: clock[0])
    s.advance(40)  # the training thread prepared step 40
    assert s.window(30, 5) is None  # all past
    assert s.window(38, 5) == 41  # the steps not yet prepared
    assert s.window(50, 3, ("0",)) == 50  # replaces it
    probed = [k for k in range(41, 60) if s.is_probe(k)]
    assert probed == [50, 51, 52]
    s.advance(50)
    assert s.recorder.only_layers == ("0",) and s.recorder.probing  # the window's layers, at its steps
    s.advance(53)
    assert s.recorder.only_layers is None and not s.recorder.probing
    assert s.window(60, 5) == 60
    clock[0] = 601.0  # a window ends WINDOW_S after it was asked for at the latest
    assert not s.is_probe(61)


def test_a_budget_override_lasts_its_seconds_and_never_applies_to_a_fixed_cadence():
    clock = [0.0]
    s = schedule(None, budget=0.01, clock=lambda: clock[0])
    s.advance(7)
    assert s.override(0.1, 30.0) == 8 and s.budget == 0.1
    clock[0] = 30.0
    assert s.budget == 0.01 == s.own_budget
    assert schedule(4).override(0.1, 30.0) is None


def test_a_halt_is_refused_unless_the_agent_was_attached_with_it_for_that_check():
    training, halt = agent_control.Training(step=40), agent_control.HaltAt()
    h = wire.Header("j", 0, 1, "b", 0, NOW)
    off = agent_control.Control(training, None, halt, halt_on=None)
    ack = off(command(wire.HaltArgs(50, "nonfinite")))(h)
    assert (ack.accepted, ack.why, halt.step) == (False, "disabled", -1)
    on = agent_control.Control(training, None, halt, halt_on=("nonfinite",))
    assert on(command(wire.HaltArgs(50, "explosion")))(h).why == "disabled"
    ack = on(command(wire.HaltArgs(50, "nonfinite", "NaN")))(h)
    assert (ack.accepted, ack.step, halt.step, halt.check) == (True, 50, 50, "nonfinite")
    assert on(command(wire.HaltArgs(45, "nonfinite")))(h).step == 45 and halt.step == 45  # the earliest stands


def test_an_agent_with_halt_on_raises_halt_before_the_named_step_and_closes(collector):
    """A halt for step 30 from the test's ROUTER: the training loop gets gradwatch.Halt from
    optimizer.step() at step 30 (29 completed), the agent says goodbye "halted", and its schema
    said which checks may halt it."""
    import gradwatch

    t = Training(collector.endpoint, job="j", on_critical="halt", halt_on="nonfinite,grad_agreement")
    try:
        collector.wait(lambda: collector.peers and collector.of(wire.Schema), what="the agent's schema")
        assert collector.of(wire.Schema)[-1].halt_on == ("nonfinite", "grad_agreement")
        collector.wait(lambda: t.steps >= 5, what="five steps")
        step = t.monitor.step + 25
        collector.sock.send_multipart([collector.peers[-1], wire.encode(command(wire.HaltArgs(step, "nonfinite", "s")))])
        t.thread.join(60)
        assert isinstance(t.error, gradwatch.Halt) and t.error.step == step and t.steps == step
        assert not t.monitor.active
        collector.wait(lambda: any(getattr(m, "reason", "") == "halted" for m in collector.msgs), what="the goodbye")
        assert answers(collector, wire.Ack)[-1].step == step
    finally:
        t.stop()


# --- the aggregator's control room ---------------------------------------------------------------


def test_margin_and_where_two_stacks_differ():
    assert room.margin(math.nan) == 2 and room.margin(0.9) == 2 and room.margin(0.01) == 100
    a = [dict(file="f", line=k, function="g") for k in (1, 2, 3)]
    assert room.differ_at(a, a) is None and room.differ_at(a, a[:2]) == 2
    assert room.differ_at(a, [a[0], dict(file="f", line=9, function="g")]) == 1


class FakeJob:
    def __init__(self, name, ranks):
        self.job, self.name, self.admitted, self.max_step = name, name, True, 100
        self.ranks = {k: type("R", (), {"boot": f"b{k}", "step_time": 0.01, "halt_on": ()})() for k in ranks}


def _halting_job(name: str):
    """A 2-rank job whose ranks allow halts on ``nonfinite``, in a real State on a fake clock, 10
    clean steps in, and a control room that routes to both ranks."""
    from .fakejob import LocalJob

    job = LocalJob(["nonfinite"], job=name, world=2, every=1000, clock=lambda: NOW)
    job.schema(halt_on=("nonfinite",))
    for step in range(10):
        for r in (0, 1):
            job.report(r, step)
        job.tick(0.1)
    c = room.Control(clock=job.agg.clock)
    for r in (0, 1):
        c.heard(name, r, job.boot[r], f"rid{r}".encode())
    return job, c


def _blow_up(job, c, step: int, ranks=(0, 1)) -> None:
    """A non-finite gradient at ``step`` on ``ranks``; the runner's new events to the control room."""
    from gradwatch.aggregator.checks.nonfinite import HOLD_S

    seen = len(job.agg.events())
    for r in ranks:
        job.report(r, step, grad_norm=math.inf, nonfinite=1)
    job.tick(0.1)
    job.tick(HOLD_S)  # no probed step to locate it: the finding comes once it was held
    c.refresh(job.state.jobs, True, job.agg.now)
    for e in job.agg.events()[seen:]:
        c.on_event(e)


def test_a_halt_is_withheld_while_another_process_claims_a_rank_or_a_rank_came_back_alone():
    """Over plain TCP a frame's identity is its word. A frame of another boot as a live rank is
    rejected (boot_conflict), and for HALT_SETTLE_S no finding halts the job: the finding is raised,
    its halt withheld and counted; a rank silent past boot_takeover_s and taken over by a new boot
    (the real one stopped, or never started) withholds halts alike. An undisputed job halts."""
    job, c = _halting_job("calm")
    _blow_up(job, c, 10)
    assert c.counts["halts"] == 1 and c.counts["halts_withheld"] == 0 and len(c.outbox) == 2

    job, c = _halting_job("claimed")
    job.agg.send(wire.Report(wire.Header("claimed", 1, 2, "e" * 16, 0, NOW), job.digest[1], 10, 0.05, math.inf, 1))
    assert job.state.rejected["boot_conflict"] == 1
    _blow_up(job, c, 10)
    assert [e.check for e in job.agg.events() if e.event == "raised"] == ["nonfinite"]  # raised all the same
    assert c.counts["halts"] == 0 and c.counts["halts_withheld"] == 1 and len(c.outbox) == 0
    # the finding's details will say why (merged at the writer's next tick)
    assert [d["halt"]["withheld"] for _, _, _, d in c._due] == [c._jobs["claimed"].unsettled]
    assert "another process claimed rank 1" in c._jobs["claimed"].unsettled
    job.tick(room.HALT_SETTLE_S)
    c.refresh(job.state.jobs, True, job.agg.now)
    assert c._jobs["claimed"].unsettled == ""  # settled again: the next finding may halt

    job, c = _halting_job("taken")
    for step in range(10, 50):  # rank 1 stops (SIGSTOP, swapped out) for 4 s; rank 0 trains on
        job.report(0, step)
        job.tick(0.1)
    job.restart(1, "f" * 16)  # another process claims rank 1 under its own boot, at rank 0's step
    job.schema(1, halt_on=("nonfinite",))
    job.report(1, 49)
    assert job.state.jobs["taken"].ranks[1].boot == "f" * 16  # taken over
    _blow_up(job, c, 50)
    assert c.counts["halts"] == 0 and c.counts["halts_withheld"] == 1
    assert "rank 1 came back under a new boot" in c._jobs["taken"].unsettled


def test_the_control_room_takes_an_answer_only_from_the_rank_asked_on_its_connection():
    c = room.Control(clock=lambda: 0.0)
    for k in range(3):
        c.heard("j", k, f"b{k}", f"rid{k}".encode())
    c.refresh({"j": FakeJob("j", range(3))})
    req = c._request("j", wire.StacksArgs(), None, 3.0)
    assert sorted(req.asked) == [0, 1, 2] and len(c.outbox) == 3
    sent = dict(c.outbox.take(10))
    assert wire.decode_command(sent[b"rid1"]).rank == -1
    h = wire.Header("j", 1, 3, "b1", 0, NOW)
    st = wire.Stack(h, req.id, ())
    assert not c.answer(st, b"rid2", "j")  # another connection
    assert not c.answer(st, b"rid1", "other")  # another job's
    assert not c.answer(wire.Stack(h, req.id + 1, ()), b"rid1", "j")  # no such request
    assert c.answer(st, b"rid1", "j") and not c.answer(st, b"rid1", "j")  # once
    assert c.counts["answers_rejected"] == 4 and req.answers == {1: st}
    with pytest.raises(room.ControlError) as e:
        c._request("nope", wire.StacksArgs(), None, 1.0)
    assert e.value.status == 404
    for _ in range(room.REQUEST_BURST - 1):
        c._request("j", wire.StacksArgs(), None, 1.0)
    with pytest.raises(room.ControlError) as e:
        c._request("j", wire.StacksArgs(), None, 1.0)
    assert e.value.status == 429 and c.counts["throttled"] == 1
    c.refresh({"j": FakeJob("j", [0])})  # ranks 1 and 2 forgotten: no route to them
    assert list(c._routes["j"]) == [0]


def test_the_control_endpoints_need_the_token_and_say_how_to_set_it():
    agg = Aggregator(load(listen="tcp://127.0.0.1:0", metrics_port=0)).start()
    try:
        r = requests.get(agg.metrics_url.replace("/metrics", "/api/stacks"), params={"job_id": "j"}, timeout=5)
        assert r.status_code == 403 and "--control-token" in r.json()["error"]
    finally:
        agg.stop()
    agg = Aggregator(load(listen="tcp://127.0.0.1:0", metrics_port=0, control_token=TOKEN)).start()
    base = agg.metrics_url.removesuffix("/metrics")
    auth_ = {"Authorization": f"Bearer {TOKEN}"}
    try:
        assert requests.get(base + "/api/stacks", params={"job_id": "j"}, timeout=5).status_code == 401
        r = requests.get(base + "/api/stacks", params={"job_id": "j"}, headers={"Authorization": "Bearer " + "x" * 28}, timeout=5)
        assert r.status_code == 401 and r.headers["WWW-Authenticate"].startswith("Bearer")
        assert requests.post(base + "/api/stacks", headers=auth_, timeout=5).status_code == 405
        assert requests.get(base + "/api/probe", headers=auth_, timeout=5).status_code == 405
        r = requests.get(base + "/api/stacks", params={"job_id": "j", "bogus": "1"}, headers=auth_, timeout=5)
        assert r.status_code == 400 and "bogus" in r.json()["error"]
        r = requests.get(base + "/api/stacks", params={"job_id": "j"}, headers=auth_, timeout=5)
        assert r.status_code == 404 and "no rank of job 'j'" in r.json()["error"]
        r = requests.post(base + "/api/probe", data=b"[1]", headers=auth_, timeout=5)
        assert r.status_code == 400
        r = requests.post(base + "/api/probe", json={"job_id": "j", "steps": 5000}, headers=auth_, timeout=5)
        assert r.status_code in (400, 404)
        assert TOKEN not in agg.cfg.model_dump_json()
    finally:
        agg.stop()


def test_gradwatch_stacks_prints_groups_innermost_last_and_who_did_not_answer():
    got = {"groups": [{"ranks": [0, 1, 2, 5], "frames": [dict(file="t.py", line=3, function="main"),
                                                          dict(file="t.py", line=9, function="step", source="x()")],
                       "in_step_s": {"0": 1.5, "1": 2.0}, "waiting": {"0": True, "1": True, "2": True, "5": True}}],
           "no_answer": [3, 4], "refused": {}}
    text = format_stacks(got)
    assert text.splitlines() == [
        "ranks 0-2,5 (4): in the step for 2.0 s, waiting in all-reduce: 0-2,5",
        "    main (t.py:3)", "    step (t.py:9)", "        x()", "",
        "no answer from ranks 3-4 (the training thread holds the GIL, the process is stopped, or the rank is not connected)"]


def test_a_finding_updated_with_stacks_becomes_a_grafana_annotation_naming_both_ranks_frames():
    from gradwatch.aggregator.annotations import annotation
    from gradwatch.aggregator.runner import Event

    stacks = {"stuck": {"rank": 1, "frames": [dict(file="/a/train.py", line=40, function="main"),
                                              dict(file="/a/data.py", line=7, function="load_batch")]},
              "healthy": {"rank": 0, "frames": [dict(file="/a/train.py", line=44, function="main")]}, "differ_at": 0}
    e = Event("updated", NOW, "training_stalled", "critical", "j", 3, 1, None, "training stalled", {"stacks": stacks})
    body = annotation(e)
    assert "stacks" in body["tags"] and "rank:1" in body["tags"]
    assert "stuck rank 1: data.py:7 load_batch < train.py:40 main" in body["text"]
    assert "healthy rank 0: train.py:44 main" in body["text"]


# --- CURVE, and the aggregator away --------------------------------------------------------------


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    assert cli.main(["keys", str(d), "--client", "a", "--client", "b"]) == 0
    return d


def client_keys(d, name: str, server: bytes | None = None) -> auth.ClientKeys:
    public, secret = auth.load_pair(str(d / f"{name}.key_secret"))
    return auth.ClientKeys(server or auth.load_public(str(d / "server.key")), public, secret)


@pytest.mark.ddp
@pytest.mark.filterwarnings("ignore:gradwatch. the aggregator at .* refused this agent's CURVE handshake:RuntimeWarning")
def test_with_curve_forged_oversized_and_replayed_commands_and_answers_change_nothing(keys, tmp_path):
    """CURVE on. A client without keys cannot even hand the aggregator a frame; one with another
    job's key sends commands (forged, over 4 KiB, a copy of a real one: refused, "direction") and
    stacks and acks answering commands asked of job a (rejected: not on the connection asked); a
    server with another key cannot reach job a's agent. Job a's agent takes none of it, and a real
    probe from the aggregator still works."""
    agg = Aggregator(load(listen="tcp://127.0.0.1:0", metrics_port=0, publish_interval_s=0.05, control_token=TOKEN,
                          server_key=str(keys / "server.key_secret"), client_keys=str(keys / "clients"))).start()
    base = agg.metrics_url.removesuffix("/metrics")
    t = Training(agg.endpoint, job="a", every=1000, **{"server_key": str(keys / "server.key"),
                                                         "client_key": str(keys / "a.key_secret")})
    ctx = zmq.Context()
    fake_ctx = zmq.Context()
    try:
        wait_for(lambda: "a" in agg.control._routes and "a" in agg.control._jobs, 30, what="job a's route and steps")
        mon = t.monitor
        r = requests.post(base + "/api/probe", json={"job_id": "a", "steps": 2, "wait_s": 10}, timeout=30,
                          headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200 and r.json()["acks"] == {"0": r.json()["start"]}, r.text
        real = next(iter(agg.control.outbox._q), None)  # (sent already: the outbox is empty)
        assert real is None and mon.sender.inbox.accepted == 1
        legit = wire.encode(command(wire.ProbeArgs(10, 5), job="a", cid=424242))
        # no keys at all: the handshake is refused, nothing is handed over
        bare = ctx.socket(zmq.DEALER)
        bare.linger = 0
        bare.connect(agg.endpoint)
        # job b's key: an authenticated client, but not the aggregator
        other = ctx.socket(zmq.DEALER)
        other.linger = 0
        client_keys(keys, "b").apply(other)
        other.connect(agg.endpoint)
        rejected0 = dict(agg.state.rejected)
        h = wire.Header("a", 0, 1, mon.boot, 9, time.time(), mon.job_key)
        forged = [legit, legit, wire.encode(command(wire.HaltArgs(0, "nonfinite"), job="a")),
                  msgpack.packb({**msgpack.unpackb(legit), "padding": "x" * 5000}),
                  wire.encode(wire.Stack(h, 1, ())), wire.encode(wire.Ack(h, 1, True, 3))]
        for f in forged:
            for s in (bare, other):
                try:
                    s.send(f, zmq.NOBLOCK)
                except zmq.Again:
                    pass
        got = wait_for(lambda: (d := agg.state.rejected.get("direction", 0) - rejected0.get("direction", 0)) >= 4 and d,
                       20, what="the commands refused")
        assert got == 4
        wait_for(lambda: agg.control.counts["answers_rejected"] >= 2, 20, what="the forged answers rejected")
        wait_for(lambda: agg.state.rejected.get("unauthenticated", 0) >= 1, 20, what="the keyless handshake refused")
        # a server with another key: job a's agent cannot even connect to it
        fake = fake_ctx.socket(zmq.ROUTER)
        fake.curve_server = True
        fake.curve_secretkey = zmq.curve_keypair()[1]
        port = fake.bind_to_random_port("tcp://127.0.0.1")
        lost = agent.attach(*mlp(), endpoint=f"tcp://127.0.0.1:{port}", job="a", heartbeat_s=0.1,
                            server_key=str(keys / "server.key"), client_key=str(keys / "a.key_secret"))
        wait_for(lambda: lost.sender.refused >= 1, 20, what="the handshake with the wrong server refused")
        assert not fake.poll(500) and not lost.sender.connected and lost.sender.inbox.accepted == 0
        lost.close()
        time.sleep(0.5)
        assert mon.sender.inbox.accepted == 1 and dict(mon.sender.inbox.rejected) == {}
        assert mon.control.done == {"probe": 1} and mon.halt.step == -1 and mon.schedule._window[0] == r.json()["start"]
        r = requests.post(base + "/api/probe", json={"job_id": "a", "steps": 2, "wait_s": 10}, timeout=30,
                          headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200 and list(r.json()["acks"]) == ["0"]
        assert t.error is None and mon.errors == 0
    finally:
        ctx.destroy(0)
        fake_ctx.destroy(0)
        t.stop()
        agg.stop()


@pytest.mark.ddp
def test_the_aggregator_stopped_neither_blocks_training_nor_has_a_command_carried_out_twice(tmp_path):
    """An agent training against a real aggregator process: a probe is acked; the aggregator is
    SIGSTOPped for 5 s (its connection times out, the agent reconnects after SIGCONT) while
    training goes on; a second probe (gradwatch probe) is acked after it. Every command was carried out exactly
    once: two probes, no replay dropped, no answer lost."""
    agg = start_aggregator(tmp_path, "--control-token", TOKEN, "--publish-interval-s", "0.05")
    t = Training(agg.endpoint, job="away", every=1000)
    hdr = {"Authorization": f"Bearer {TOKEN}"}
    try:
        mon = t.monitor
        wait_for(lambda: samples(agg.scrape(), "gradwatch_rank_steps_total").get((("job_id", "away"), ("rank", "0")), 0) > 5,
                 30, what="the job reporting")
        r = requests.post(agg.base_url + "/api/probe", json={"job_id": "away", "steps": 3, "wait_s": 10}, headers=hdr, timeout=30)
        assert r.status_code == 200 and list(r.json()["acks"]) == ["0"], r.text
        os.kill(agg.proc.pid, signal.SIGSTOP)
        try:
            before = t.steps
            time.sleep(5.0)
            during = t.steps - before
        finally:
            os.kill(agg.proc.pid, signal.SIGCONT)
        assert during >= 50, f"{during} steps in 5 s while the aggregator was stopped"  # ~5 ms steps: ~1000
        probe = [sys.executable, "-m", "gradwatch.commands", "probe", "--url", agg.base_url, "--job", "away", "--steps", "3",
                 "--wait-s", "10"]

        def acked():  # gradwatch probe, the token from the environment
            out = subprocess.run(probe, capture_output=True, text=True, timeout=60,
                                 env={**os.environ, "GRADWATCH_CONTROL_TOKEN": TOKEN})
            return out.returncode == 0 and "; 1 ranks acknowledged from step" in out.stdout

        wait_for(acked, 30, 0.5, what="a probe acked after the aggregator came back")
        time.sleep(1.0)
        done = mon.control.done
        assert done == {"probe": mon.sender.inbox.accepted} and done["probe"] >= 2
        assert mon.sender.inbox.rejected["replayed"] == 0
        assert t.error is None and mon.errors == 0 and t.thread.is_alive()
    finally:
        t.stop()
        agg.stop()
