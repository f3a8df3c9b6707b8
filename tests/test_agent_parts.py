"""The monitor's parts one by one: probe schedule, failure policy, AMP scaler watch, DDP hook, report.

Real parts only: a real GradScaler, a real DDP model over a one-rank gloo group, real hooks.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
import time
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from gradwatch import wire
from gradwatch.agent import frame, report
from gradwatch.agent.amp import ScalerWatch
from gradwatch.agent.ddp import CommHook
from gradwatch.agent.failures import MAX_ERRORS, PART_ERRORS, Failures
from gradwatch.agent.hooks import ProbeRecorder
from gradwatch.agent.measure import RunQueueWait
from gradwatch.agent.report import waited_s
from gradwatch.agent.schedule import ProbeSchedule
from gradwatch.agent.stats import Reducer

from .conftest import free_port


class Errors(list):
    """An on_error callback that keeps what it is given."""

    def __call__(self, where, exc):
        self.append((where, exc))


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


# --- probe schedule -------------------------------------------------------------------------------


def test_schedule_cadence_and_bursts():
    s = ProbeSchedule(every=4, burst=3, spike_factor=10.0, recorder=ProbeRecorder(Reducer("off"), Errors()), on_error=Errors())
    assert [k for k in range(12) if s.is_probe(k)] == [0, 4, 8]
    s.watch(5, math.nan, 0, scheduled=6)  # no gradients at all: not a fault
    assert [k for k in range(12) if s.is_probe(k)] == [0, 4, 8]
    s.watch(5, 1.0, 1, scheduled=6)  # a non-finite parameter: from the first unscheduled step on
    assert [k for k in range(7, 16) if s.is_probe(k)] == [7, 8, 9, 12]
    assert s.on_cadence(8) and not s.on_cadence(7)


def test_schedule_spike_needs_history_and_burst():
    s = ProbeSchedule(every=100, burst=2, spike_factor=10.0, recorder=ProbeRecorder(Reducer("off"), Errors()), on_error=Errors())
    s.watch(1, 50.0, 0, scheduled=2)  # no history yet: not a spike
    for k in range(2, 6):
        s.watch(k, 1.0, 0, scheduled=k + 1)
    assert not any(s.is_probe(k) for k in range(1, 20))
    s.watch(6, 100.0, 0, scheduled=7)  # median 1.0 -> 100 is a spike
    assert [k for k in range(8, 20) if s.is_probe(k)] == [8, 9]
    quiet = ProbeSchedule(every=100, burst=0, spike_factor=10.0, recorder=ProbeRecorder(Reducer("off"), Errors()), on_error=Errors())
    quiet.watch(1, math.inf, 3, scheduled=2)
    assert not any(quiet.is_probe(k) for k in range(1, 20))


def test_schedule_switches_module_hooks_and_reports_failures():
    model = net()
    errors = Errors()
    rec = ProbeRecorder(Reducer("off"), errors, model)
    s = ProbeSchedule(every=2, burst=0, spike_factor=10.0, recorder=rec, on_error=errors)
    s.advance(0)
    assert rec.probing and model[0]._forward_hooks and model._forward_pre_hooks
    model(torch.randn(3, 4))
    assert rec.micro == 1 and rec.batch == 3 and len(rec.act) == 3
    s.advance(1)
    assert not rec.probing and not model[0]._forward_hooks and not model._forward_pre_hooks
    rec.install = lambda: 1 / 0
    s.advance(2)
    assert [w for w, _ in errors] == ["schedule"]


# --- failure policy -------------------------------------------------------------------------------


def test_a_failing_part_is_switched_off_alone():
    stops = []
    f = Failures(lambda: stops.append(1))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for i in range(PART_ERRORS):
            f(f"forward:layer{i}", ValueError("x"))
    assert f.disabled == {"forward"} and f.errors == PART_ERRORS and not stops
    assert len(w) == 2 and "forward:layer0 failed" in str(w[0].message) and "switched off" in str(w[1].message)


def test_the_step_failing_stops_the_agent_once():
    stops = []
    f = Failures(lambda: stops.append(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(PART_ERRORS + 5):
            f("step", RuntimeError("x"))
    assert stops == [1] and f.stopped and f.errors == MAX_ERRORS + 5 and not f.disabled


def test_too_many_errors_of_parts_stop_the_agent():
    stops = []
    f = Failures(lambda: stops.append(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(MAX_ERRORS):
            f(("forward", "output-grad", "sentinel", "comm-hook")[i % 4], RuntimeError("x"))
    assert stops == [1] and f.disabled == {"forward", "output-grad", "sentinel", "comm-hook"}


# --- AMP scaler watch -----------------------------------------------------------------------------


def test_scaler_watch_counts_skipped_steps_with_a_real_scaler():
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    skips, errors = [], Errors()
    watch = ScalerWatch(scaler, lambda: skips.append(1), errors)
    opt.register_step_post_hook(lambda *a: setattr(watch, "stepped", True))  # what the monitor does
    assert watch.scale() is None  # the scaler makes its scale on first use
    for step in range(4):
        x = torch.randn(5, 4) * (math.inf if step == 2 else 1.0)
        scaler.scale(model(x).square().mean()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert skips == [1] and watch.take_skipped() == 1 and watch.take_skipped() == 0 and not errors
    assert isinstance(watch.scale(), torch.Tensor) and watch.scale().item() == scaler.get_scale()
    watch.close()
    assert "update" not in vars(scaler)


def test_scaler_watch_failure_is_reported_and_the_scaler_still_updates():
    scaler = torch.amp.GradScaler("cpu")
    errors, calls = Errors(), []
    scaler.update = lambda *a, **k: calls.append(1)  # stands for the scaler's own update
    watch = ScalerWatch(scaler, lambda: 1 / 0, errors)
    watch.stepped = False
    scaler.update()
    assert [w for w, _ in errors] == ["scaler"] and calls == [1]


# --- DDP communication hook -----------------------------------------------------------------------


@pytest.fixture
def one_rank_group():
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_comm_hook_sees_buckets_and_leaves_gradients_as_ddp_does(one_rank_group):
    x = torch.randn(6, 4)
    plain = net()
    plain(x).square().sum().backward()
    ddp = nn.parallel.DistributedDataParallel(net(), bucket_cap_mb=1e-4)  # several buckets once rebuilt
    errors = Errors()
    comm = CommHook(errors, set(), clock=lambda: 42.0)
    comm.install(ddp)
    ddp(x).square().sum().backward()
    for a, b in zip(plain.parameters(), ddp.parameters()):
        assert torch.equal(a.grad, b.grad)
    assert comm.first_bucket == 42.0 and len(comm.local_sq) >= 1 and not errors
    assert comm.backward_end == 42.0  # the end of backward, timed by an autograd final callback
    total = sum(float(t.double().square().sum()) for t in comm.local_sq)  # each bucket's chunk norms
    assert total == pytest.approx(sum(float(p.grad.square().sum()) for p in plain.parameters()), rel=1e-5)
    comm.reset()
    assert comm.local_sq == [] and comm.first_bucket is None and comm.backward_end is None

    calls = []

    def user_hook(state, bucket):  # registered after attach: becomes the delegate
        calls.append(state)
        return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])

    ddp.register_comm_hook("mine", user_hook)
    ddp(x).square().sum().backward()
    assert calls and set(calls) == {"mine"} and len(comm.local_sq) == len(calls)


def test_the_end_of_backward_is_each_passs_own_and_a_hook_called_outside_backward_keeps_it_timed(one_rank_group):
    """Two backward passes before one optimizer step (accumulation without no_sync, two losses):
    while the second one's buckets are reduced, its end is not yet known (the rank waits on its
    peers). DDP's Join calls the hook outside any backward pass (a shadow all-reduce): nothing to
    time then, and the next backward pass is still timed."""
    ddp = nn.parallel.DistributedDataParallel(net())
    comm = CommHook(Errors(), set())
    comm.install(ddp)
    seen = []

    def user_hook(state, bucket):  # runs after the agent's observation of the bucket
        seen.append(comm.backward_end)
        return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])

    ddp.register_comm_hook(None, user_hook)
    ddp(torch.randn(6, 4)).square().sum().backward()
    first_end = comm.backward_end
    ddp(torch.randn(6, 4)).square().sum().backward()
    assert first_end is not None and seen and all(e is None for e in seen), seen
    assert comm.backward_end is not None and comm.backward_end >= first_end
    comm.reset()

    class Bucket:  # what Join's shadow all-reduce hands the hook: a bucket, no backward pass
        def buffer(self):
            return torch.zeros(8)

    comm.observe(Bucket())
    assert comm._timed and not comm._queued and comm.backward_end is None
    comm.reset()
    ddp(torch.randn(6, 4)).square().sum().backward()
    assert comm.backward_end is not None and comm.backward_end >= comm.first_bucket


def test_a_bucket_of_many_chunks_gives_the_local_norm_within_1e6_of_float64(one_rank_group):
    """The hook records a bucket as its chunk norms (one foreach on the device); the report builder
    sums their squares in float64: the local gradient norm is a float64 reference's within 1e-6,
    for a bucket of several chunks with a short last one."""
    from gradwatch.agent.stats import NORM_CHUNK

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 3 * NORM_CHUNK // 64 + 1), nn.Linear(3 * NORM_CHUNK // 64 + 1, 2))
    ddp = nn.parallel.DistributedDataParallel(model)  # one bucket: the default cap holds it all
    comm = CommHook(Errors(), set())
    comm.install(ddp)
    (ddp(torch.randn(5, 64) + 0.5).square().sum() * 1e3).backward()
    assert len(comm.local_sq) == 1 and comm.local_sq[0].numel() > 3  # several chunks, not one value
    ref = math.sqrt(sum(float(p.grad.double().square().sum()) for p in model.parameters()))
    flat, counts = frame.pack({"grad_norm": [torch.tensor(1.0)], "bucket_norm": comm.local_sq[0]})
    r = report.build(wire.Header("j", 0, 1, "b", 0, 0.0), report.StepLayout(0, 0.5, math.nan, 0, "s", (0,), counts),
                     flat.numpy(), drops=0)
    assert r.local_grad_norm == pytest.approx(ref, rel=1e-6)


def test_a_bucket_past_split_max_chunks_is_one_value_within_1e6_of_float64():
    """A bucket of DDP's default size (25 MB: hundreds of chunks) travels as its norm, one value,
    not as one value per chunk in every step's frame; within 1e-6 of float64 all the same."""
    from gradwatch.agent.stats import NORM_CHUNK, SPLIT_MAX

    class Bucket:
        def __init__(self, t):
            self.t = t

        def buffer(self):
            return self.t

    comm = CommHook(Errors(), set())
    big = torch.randn((SPLIT_MAX + 3) * NORM_CHUNK + 7, generator=torch.Generator().manual_seed(1)) + 0.25
    small = torch.randn(3 * NORM_CHUNK + 5, generator=torch.Generator().manual_seed(2))
    comm.observe(Bucket(big))
    comm.observe(Bucket(small))
    assert [t.numel() for t in comm.local_sq] == [1, 4]
    got = math.sqrt(sum(float(t.double().square().sum()) for t in comm.local_sq))
    assert got == pytest.approx(math.sqrt(float(big.double().square().sum() + small.double().square().sum())), rel=1e-6)


def test_a_huge_loss_scale_is_divided_out_of_a_copy_of_the_bucket_before_its_norms():
    """While the monitor has set the hook's ``unscale.source`` (a loss scale past 2^40), each bucket of a step is
    divided by the scale before its chunk norms, whose float32 sum of squares would otherwise
    overflow; the bucket itself, which DDP goes on to all-reduce, is left bit for bit as it was."""
    from gradwatch.agent.stats import NORM_CHUNK

    class Bucket:
        def __init__(self, t):
            self.t = t

        def buffer(self):
            return self.t

    scale = torch.tensor(2.0**70)
    grad = torch.randn(3 * NORM_CHUNK + 5, generator=torch.Generator().manual_seed(3))
    scaled = grad * scale
    before = scaled.clone()
    comm = CommHook(Errors(), set())
    comm.observe(Bucket(scaled))
    assert not comm.unscale.applied and math.isinf(sum(float(t.double().square().sum()) for t in comm.local_sq))
    comm.reset()
    comm.unscale.reset()  # the step boundary (the monitor's)
    comm.unscale.source = lambda: scale
    comm.observe(Bucket(scaled))
    comm.unscale.source = None  # switched off mid-step: the step's next bucket is still divided
    comm.observe(Bucket(scaled))
    assert comm.unscale.applied and torch.equal(scaled, before)
    got = math.sqrt(sum(float(t.double().square().sum()) for t in comm.local_sq))
    assert got == pytest.approx(math.sqrt(2 * float(grad.double().square().sum())), rel=1e-6)
    comm.unscale.reset()
    assert not comm.unscale.applied


def test_comm_hook_stops_when_switched_off_and_reports_failures():
    errors, disabled = Errors(), set()
    comm = CommHook(errors, disabled)

    class Bucket:
        def buffer(self):
            raise RuntimeError("no buffer")

    comm.observe(Bucket())
    assert [w for w, _ in errors] == ["comm-hook"]
    disabled.add("comm-hook")
    comm.observe(Bucket())
    disabled.clear()
    comm.live = False  # the monitor closed
    comm.observe(Bucket())
    assert len(errors) == 1


# --- CPU wait (run-queue wait) within the compute time -----------------------------------------

needs_schedstat = pytest.mark.skipif(not os.path.exists(f"/proc/self/task/{threading.get_native_id()}/schedstat"),
                                     reason="Linux schedstat")


@pytest.fixture
def shared_cpu():
    """``(cpu, start)``: a CPU of this process, and ``start()`` for a process spinning pinned to it
    (stopped when the test ends)."""
    cpu = max(os.sched_getaffinity(0))
    procs = []

    def start():
        p = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])
        procs.append(p)
        time.sleep(0.3)  # started and spinning
        return p

    yield cpu, start
    for p in procs:
        p.kill()
        p.wait()


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _thread_wait(cpu: int, work) -> tuple[float, float]:
    """``(seconds waited for a CPU, wall seconds)`` of a thread pinned to ``cpu`` doing ``work()``,
    read from this thread (as the comm hook may read the training thread's) around it."""
    tid, go, done, release = [], threading.Event(), threading.Event(), threading.Event()

    def run():
        os.sched_setaffinity(0, {cpu})  # this thread only
        tid.append(threading.get_native_id())
        go.wait()
        work()
        done.set()
        release.wait()

    t = threading.Thread(target=run)
    t.start()
    while not tid:
        time.sleep(0.001)
    w = RunQueueWait()
    assert w.follow((tid[0],)) and not w.follow((tid[0],))
    a, t0 = w.read(), time.perf_counter()
    go.set()
    done.wait()
    b, wall = w.read(), time.perf_counter() - t0
    release.set()
    t.join()
    w.close()
    assert w.read() == b"" and math.isnan(waited_s(a, w.read()))
    waited = waited_s(a, b)
    assert waited >= 0, (a, b)
    return waited, wall


@needs_schedstat
def test_run_queue_wait_of_a_thread_sharing_its_cpu_with_a_spinner_and_of_a_sleeping_one(shared_cpu):
    """A thread spinning on a CPU another process spins on waits for it about half the time (more
    beside other load); a sleeping thread waits only to be woken, whatever the load."""
    cpu, start = shared_cpu
    start()
    waited, wall = _thread_wait(cpu, lambda: _spin(0.4))
    assert waited > 0.25 * wall, (waited, wall)
    waited, wall = _thread_wait(cpu, lambda: time.sleep(0.4))
    assert waited < 0.1 * wall, (waited, wall)  # woken late, preempted on the way in, beside other load


def test_run_queue_wait_is_unknown_where_it_cannot_be_read():
    w = RunQueueWait()
    assert w.read() == b""  # following nothing
    assert w.follow((2**31 - 1,)) and w.read() == b""  # no such thread
    w.close()
    assert w.read() == b""
    # two threads' files, summed; readings of different threads or garbage are not comparable
    assert waited_s(b"5 100 1\n7 20 2\n", b"9 150 2\n8 70 3\n") == pytest.approx(100e-9)
    for a, b in ((b"5 100 1\n", b"9 150 2\n8 70 3\n"), (b"", b"1 2 3\n"), (b"1 x 3\n", b"1 2 3\n"), (b"1 2\n", b"1 3\n")):
        assert math.isnan(waited_s(a, b)), (a, b)
    # two intervals (until the first bucket, and after the end of backward): summed; one unknown
    # reading, or an unpaired one, makes the whole unknown
    assert waited_s(b"5 100 1\n", b"9 150 2\n", b"9 400 2\n", b"9 425 3\n") == pytest.approx(75e-9)
    assert math.isnan(waited_s(b"5 100 1\n", b"9 150 2\n", b"", b"9 425 3\n"))
    assert math.isnan(waited_s(b"5 100 1\n", b"9 150 2\n", b"9 400 2\n")) and math.isnan(waited_s())


@needs_schedstat
def test_the_monitor_sends_the_cpu_wait_within_each_compute_time(one_rank_group, collector, shared_cpu):
    """A one-rank DDP job: each step's ``compute_wait`` lies within its ``compute_time``; steps that
    spin pinned to a CPU another process spins on wait for it a large share of their compute time,
    steps that sleep as long (the fault matrix's straggler) none of their sleep."""
    from gradwatch import agent

    cpu, start = shared_cpu
    ddp = nn.parallel.DistributedDataParallel(net())
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    monitor = agent.attach(ddp, opt, endpoint=collector.endpoint, job="wait", every=1000)
    before = os.sched_getaffinity(0)
    try:
        for step in range(16):
            if step == 8:  # the second half: this thread shares its CPU with a spinning process
                os.sched_setaffinity(0, {cpu})
                start()
            (_spin if step >= 8 else time.sleep)(0.03)
            ddp(torch.randn(4, 4)).square().sum().backward()
            opt.step()
            opt.zero_grad()
        collector.drain(monitor)
    finally:
        os.sched_setaffinity(0, before)
        monitor.close()
    reps = collector.wait_steps(16, job="wait")
    compute = np.array([reps[s].compute_time for s in range(16)])
    wait = np.array([reps[s].compute_wait for s in range(16)])
    assert np.isfinite(wait).all() and (wait >= 0).all() and (wait <= compute + 1e-3).all(), (wait, compute)
    # asleep: the 30 ms of sleep are the rank's own time (a preemption just before the sleep began
    # counts as wait and shortens it: time.sleep keeps its deadline), the moments awake may wait
    assert np.median(compute[1:8] - wait[1:8]) >= 0.028, (wait, compute)
    assert np.median(wait[9:] / compute[9:]) > 0.25, (wait, compute)  # spinning beside a spinner: about half waiting
    assert not monitor.errors


def test_the_monitor_counts_the_ranks_work_after_its_backward_pass_as_its_own(one_rank_group, collector):
    """Time a rank spends between the end of its backward pass and its optimizer step's end
    (clipping, logging, a slow optimizer) is its own: with 40 ms of sleep there, each step's
    ``compute_time`` holds them; without it, the step's compute time is a few milliseconds. The
    backward pass itself ends behind DDP's all-reduce, whose wait is not the rank's."""
    from gradwatch import agent

    ddp = nn.parallel.DistributedDataParallel(net())
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    monitor = agent.attach(ddp, opt, endpoint=collector.endpoint, job="after", every=1000)
    try:
        for step in range(16):
            ddp(torch.randn(4, 4)).square().sum().backward()
            assert monitor.comm.backward_end is not None and monitor.comm.backward_end >= monitor.comm.first_bucket
            if step < 8:
                time.sleep(0.04)
            opt.step()
            opt.zero_grad()
        collector.drain(monitor)
    finally:
        monitor.close()
    reps = collector.wait_steps(16, job="after")
    compute = np.array([reps[s].compute_time for s in range(16)])
    wait = np.array([reps[s].compute_wait for s in range(16)])
    step_time = np.array([reps[s].step_time for s in range(16)])
    assert (compute[1:8] >= 0.04).all() and (compute <= step_time + 1e-6).all(), (compute, step_time)
    assert np.median(compute[9:]) < 0.02, compute
    assert (wait[np.isfinite(wait)] <= compute[np.isfinite(wait)] + 1e-3).all(), (wait, compute)
    assert not monitor.errors


def test_the_agents_own_cost_includes_its_bucket_observation(one_rank_group, collector, monkeypatch):
    """The budget (and ``agent_cost``) counts every host second the agent spends, the DDP bucket
    observation during backward included: made 3 ms slower, it shows in the unprobed steps' cost."""
    from gradwatch import agent
    from gradwatch.agent import ddp as ddp_mod

    real = ddp_mod.chunk_norms

    def slow(*args, **kwargs):
        time.sleep(0.003)
        return real(*args, **kwargs)

    monkeypatch.setattr(ddp_mod, "chunk_norms", slow)
    ddp = nn.parallel.DistributedDataParallel(net())
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    monitor = agent.attach(ddp, opt, endpoint=collector.endpoint, job="cost")  # budget mode
    try:
        for _ in range(40):
            ddp(torch.randn(4, 4)).square().sum().backward()
            opt.step()
            opt.zero_grad()
        assert monitor.schedule.cost.sentinel_s >= 0.003, monitor.schedule.cost.sentinel_s
        assert not monitor.errors
    finally:
        monitor.close()


# --- report builder -------------------------------------------------------------------------------


def test_report_from_a_probe_frame():
    """Two of three parameters with gradients, two calls of one slot, loss scale 4."""
    sections = {
        "grad_norm": [torch.tensor(3.0), torch.tensor(4.0)],
        "bucket_norm": [torch.tensor(6.0), torch.tensor(8.0)],
        "loss": [torch.tensor(1.0), torch.tensor(2.0)],
        "loss_scale": [torch.tensor(4.0)],
        "grad_nonfinite": [torch.tensor(0.0), torch.tensor(2.0)],
        "grad_fp": [torch.tensor(-1), torch.tensor(7)],
        "weight_norm": [torch.tensor(1.0), torch.tensor(2.0), torch.tensor(3.0)],
        "weight_fp": [torch.tensor(1), torch.tensor(2), torch.tensor(3)],
        "act": [torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0]), torch.tensor([3.0, 0.0, 3.0, 3.0, 1.0, 0.0])],
        "out_grad": [torch.tensor([16.0, 0.0]), torch.tensor([48.0, 1.0])],
    }
    flat, counts = frame.pack(sections)
    h = wire.Header("j", 0, 2, "b", 1, 0.0)
    L = report.StepLayout(step=3, step_time=0.5, compute_time=0.25, skipped=1, schema="s", present=(0, 2), counts=counts,
                          probe=True, burst=True, batch=8, micro=2, n_params=3, n_slots=2, act=((1, 2), (1, 2)), grad=(1, 1),
                          waits=(b"900 1000000000 4\n", b"950 1062500000 7\n"))
    r = report.build(h, L, flat.numpy(), drops=5)
    assert r.compute_wait == pytest.approx(0.0625)  # 62.5 ms of the 250 waiting for a CPU
    assert (r.step, r.probe, r.burst, r.batch, r.micro, r.skipped, r.drops) == (3, True, True, 8, 2, 1, 5)
    assert r.grad_norm == 5.0 and r.grad_nonfinite == 0 and r.local_grad_norm == 10.0 / 4 and r.loss == 1.5 and r.loss_scale == 4.0
    assert np.array_equal(r.param, np.array([[3, 1, 0], [np.nan, 2, np.nan], [4, 3, 2]], np.float32), equal_nan=True)
    assert r.fp_grad.tolist() == [2**64 - 1, 0, 7] and r.fp_weight.tolist() == [1, 2, 3]
    assert np.isnan(r.act[0]).all() and r.act[1].tolist() == [2.0, 1.0, 1.0, 3.0, 0.25, 0.0]
    assert r.act_grad[1].tolist() == [8.0 / 4, 1.0] and np.isnan(r.act_grad[0]).all()

    sentinel, counts = frame.pack({})  # a step without gradients: NaN statistics, nothing else
    s = report.build(h, report.StepLayout(4, 0.5, math.nan, 0, "s", (), counts), sentinel.numpy(), drops=0)
    assert not s.probe and math.isnan(s.grad_norm) and math.isnan(s.loss) and s.grad_nonfinite == 0
    assert math.isnan(s.compute_wait)  # no readings: unknown
    assert r.grad_norms is None  # nobody to compare them with (StepLayout.norms)


@pytest.mark.parametrize("sums, slots, want", [
    ([1.0, -2.0, 3.0], (0, 1, 2), -1),  # all finite: watched, nothing
    ([1.0, math.inf, math.nan], (0, 4, 1), 4),  # the first not finite in call order, not the lowest slot
    ([math.nan, math.nan], (2, 2), 2),  # a module called twice
    ([3e38, 3e38], (0, 1), -1),  # large but finite sums stay finite in the float32 frame
])
def test_sentinel_report_carries_the_nan_guards_first_non_finite_slot(sums, slots, want):
    """The guard's sums ride in the step's frame; the sender thread names the slot of the first
    that is not finite (-1 when none), on an unprobed step only; without the guard, no verdict."""
    flat, counts = frame.pack({"grad_norm": [torch.tensor(3.0)], "guard": [torch.tensor(x) for x in sums]})
    h = wire.Header("j", 1, 2, "b", 1, 0.0)
    L = report.StepLayout(7, 0.5, math.nan, 0, "s", (0,), counts, n_params=1, guard=slots)
    assert report.build(h, L, flat.numpy(), drops=0).nonfinite_slot == want
    flat, counts = frame.pack({"grad_norm": [torch.tensor(3.0)]})
    assert report.build(h, report.StepLayout(7, 0.5, math.nan, 0, "s", (0,), counts, n_params=1), flat.numpy(),
                        drops=0).nonfinite_slot is None


def test_sentinel_report_carries_each_parameters_gradient_norm_when_there_are_replicas():
    """The norms as measured (float32, not re-derived from squares), NaN for a parameter without a
    gradient, on an unprobed step; none without gradients."""
    norm = torch.tensor(0.1, dtype=torch.float32)  # not exactly sqrt(0.1 ** 2) in float32 after squaring
    flat, counts = frame.pack({"grad_norm": [torch.tensor(3.0), norm]})
    h = wire.Header("j", 1, 2, "b", 1, 0.0)
    L = report.StepLayout(7, 0.5, math.nan, 0, "s", (0, 2), counts, n_params=3, norms=True)
    r = report.build(h, L, flat.numpy(), drops=0)
    assert not r.probe and r.grad_norms.dtype == np.float32
    assert np.array_equal(r.grad_norms, np.array([3.0, np.nan, norm.item()], np.float32), equal_nan=True)
    got = wire.decode(wire.encode(r))
    assert got.grad_norms.tobytes() == r.grad_norms.tobytes()  # bit for bit through the wire
    empty, counts = frame.pack({})
    assert report.build(h, report.StepLayout(8, 0.5, math.nan, 0, "s", (), counts, n_params=3, norms=True),
                        empty.numpy(), drops=0).grad_norms is None


def test_a_sparse_or_float64_or_complex_bucket_gives_its_norm(one_rank_group):
    """A DDP job with nn.Embedding(sparse=True) hands the hook a sparse bucket (a dense norm
    raises NotImplementedError for SparseCPU, the hook would be switched off, and the aggregator
    would take its NaN local norms for a fault); a float64 or complex bucket would be narrowed by
    a float32 norm. Each gives its norm (a sparse one over its coalesced values, duplicates summed;
    complex by magnitude), in a real 1-rank DDP and alone."""
    class Bucket:
        def __init__(self, t):
            self.t = t

        def buffer(self):
            return self.t

    errors = Errors()
    comm = CommHook(errors, set())
    idx = torch.tensor([[0, 2, 2, 5]])
    sparse = torch.sparse_coo_tensor(idx, torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [0.5, 0.5]]), (8, 2))
    wide, cplx = torch.randn(50, dtype=torch.float64), torch.randn(7, dtype=torch.complex64)
    for t in (sparse, wide, cplx):
        comm.observe(Bucket(t))
    want = [float(sparse.to_dense().double().norm()), float(wide.norm()), float(cplx.abs().double().norm())]
    got = [math.sqrt(sum(float(x.double().square().sum()) for x in sq)) for sq in comm.local_sq]
    assert not errors and got == pytest.approx(want, rel=1e-6)
    # the DDP job of the report: a sparse embedding's gradient through the hook, gradients as DDP leaves them
    torch.manual_seed(0)
    emb = nn.Embedding(10, 3, sparse=True)
    ddp = nn.parallel.DistributedDataParallel(emb)
    comm = CommHook(errors, set())
    comm.install(ddp)
    ddp(torch.tensor([1, 4, 4, 7])).sum().backward()
    assert not errors and len(comm.local_sq) == 1
    local = math.sqrt(sum(float(x.double().square().sum()) for x in comm.local_sq))
    assert local == pytest.approx(float(emb.weight.grad.to_dense().double().norm()), rel=1e-6)
