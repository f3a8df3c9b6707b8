"""The monitor's parts one by one: probe schedule, failure policy, AMP scaler watch, DDP hook, report.

Real parts only: a real GradScaler, a real DDP model over a one-rank gloo group, real hooks.
"""

from __future__ import annotations

import math
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
    total = sum(float(t) ** 2 for t in comm.local_sq)
    assert total == pytest.approx(sum(float(p.grad.square().sum()) for p in plain.parameters()), rel=1e-5)
    comm.reset()
    assert comm.local_sq == [] and comm.first_bucket is None

    calls = []

    def user_hook(state, bucket):  # registered after attach: becomes the delegate
        calls.append(state)
        return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])

    ddp.register_comm_hook("mine", user_hook)
    ddp(x).square().sum().backward()
    assert calls and set(calls) == {"mine"} and len(comm.local_sq) == len(calls)


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
                          probe=True, burst=True, batch=8, micro=2, n_params=3, n_slots=2, act=((1, 2), (1, 2)), grad=(1, 1))
    r = report.build(h, L, flat.numpy(), drops=5)
    assert (r.step, r.probe, r.burst, r.batch, r.micro, r.skipped, r.drops) == (3, True, True, 8, 2, 1, 5)
    assert r.grad_norm == 5.0 and r.grad_nonfinite == 0 and r.local_grad_norm == 10.0 / 4 and r.loss == 1.5 and r.loss_scale == 4.0
    assert np.array_equal(r.param, np.array([[3, 1, 0], [np.nan, 2, np.nan], [4, 3, 2]], np.float32), equal_nan=True)
    assert r.fp_grad.tolist() == [2**64 - 1, 0, 7] and r.fp_weight.tolist() == [1, 2, 3]
    assert np.isnan(r.act[0]).all() and r.act[1].tolist() == [2.0, 1.0, 1.0, 3.0, 0.25, 0.0]
    assert r.act_grad[1].tolist() == [8.0 / 4, 1.0] and np.isnan(r.act_grad[0]).all()

    sentinel, counts = frame.pack({})  # a step without gradients: NaN statistics, nothing else
    s = report.build(h, report.StepLayout(4, 0.5, math.nan, 0, "s", (), counts), sentinel.numpy(), drops=0)
    assert not s.probe and math.isnan(s.grad_norm) and math.isnan(s.loss) and s.grad_nonfinite == 0
    assert r.grad_norms is None  # nobody to compare them with (StepLayout.norms)


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
