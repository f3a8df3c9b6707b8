"""Case C10 (AMP loss scaler skips steps) and the loss a script hands to the agent, on real
sockets: skipped steps send no report, are counted in the next one, and leave no statistics
behind; the reported loss and loss scale equal what the script saw."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch

import gradwatch.agent as gw
from gradwatch import wire

from .conftest import records


def _reports(sock, n, timeout=10.0):
    out, deadline = [], time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        if sock.poll(100):
            out += records(wire.decode(sock.recv()))
    return out


def test_c10_skipped_steps_are_counted_not_reported_and_leave_nothing_behind(pull):
    sock, endpoint = pull
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    seen = []  # (loss, scale before the step, gradient norm after unscaling) of applied steps
    with gw.attach(model, opt, endpoint=endpoint, every=1, scaler=scaler) as monitor:
        for i in range(6):
            loss = model(torch.randn(3, 4)).square().mean()
            if i in (2, 3):  # two overflowing iterations in a row: both skipped
                loss = loss * float("inf")
            monitor.observe_loss(loss)
            scale = scaler.get_scale()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            norm = float(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double().norm())
            scaler.step(opt)
            if math.isfinite(norm):
                seen.append((float(loss.detach()), scale, norm))
            scaler.update()
            opt.zero_grad()
        reports = _reports(sock, 4)
    assert "update" not in vars(scaler)  # close() restored the scaler
    assert [r.step for r in reports] == [0, 1, 2, 3]  # 6 iterations, 4 optimizer steps
    assert [r.skipped for r in reports] == [0, 0, 2, 0]
    for r, (loss, scale, norm) in zip(reports, seen):
        assert r.loss == pytest.approx(loss, rel=1e-6)
        assert r.loss_scale == scale
        assert r.grad_norm == pytest.approx(norm, rel=1e-5)  # unscaled, and nothing of the inf steps
        assert math.isfinite(r.grad_norm) and r.grad_nonfinite == 0
        assert not r.act_grad[:, 1].any()  # no non-finite output gradient carried over


def test_loss_is_nan_when_not_observed_and_mean_over_micro_steps(pull):
    sock, endpoint = pull
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with gw.attach(model, opt, endpoint=endpoint, every=100) as monitor:
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        for v in (1.0, 4.0):  # two micro-steps
            monitor.observe_loss(torch.tensor(v))
        opt.step()
        reports = _reports(sock, 2)
    assert math.isnan(reports[0].loss) and reports[1].loss == 2.5
    assert math.isnan(reports[0].loss_scale)


def test_output_gradient_norms_under_a_huge_loss_scale_are_exact(pull):
    """A loss scale past 2^40 (a GradScaler that has grown for a long time) makes the probe's
    float32 sums of squares of the scaled output gradients overflow: every layer's gradient norm
    read Inf. Once the agent has seen such a scale, the output-gradient hooks divide by it first:
    each slot's norm matches a float64 reference of the unscaled output gradient."""
    sock, endpoint = pull
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights stay as they are
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**80, growth_interval=1_000_000)
    x = torch.randn(3, 4)
    steps = 4
    with gw.attach(model, opt, endpoint=endpoint, every=1, scaler=scaler) as monitor:
        for i in range(steps):
            if i == steps - 1:  # the sender has switched the division on (a step or two after the first)
                deadline = time.monotonic() + 20
                while monitor.recorder.unscale.source is None and time.monotonic() < deadline:
                    time.sleep(0.01)
            scaler.scale(model(x).square().mean()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        reports = _reports(sock, steps)
    assert [r.step for r in reports] == list(range(steps)) and scaler.get_scale() == 2.0**80
    assert np.isinf(reports[0].act_grad[:, 0]).all()  # the premise: before the switch, Inf
    # the reference: each module's output gradient, unscaled, in float64 (slots in forward order)
    twin = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 1)).double()
    twin.load_state_dict(model.state_dict())
    outs, h = [], x.double()
    for m in twin:
        h = m(h)
        h.retain_grad()
        outs.append(h)
    h.square().mean().backward()
    want = [float(o.grad.norm()) for o in outs]
    last = reports[-1]
    assert last.probe and last.act_grad[:, 0].tolist() == pytest.approx(want, rel=1e-5)
    assert not last.act_grad[:, 1].any()
