"""What ``attach`` is given and how it can fail: framework wrappers of the optimizer, steps taken
with a closure, numbering steps from a framework's, and every way attach can fail leaving nothing
running (no hook, no thread, no ZeroMQ context that blocks the garbage collector).

Real parts: real models and optimizers, the agent's real ZeroMQ socket reporting to a real ROUTER
socket bound here, and fresh interpreters where a hang is what is tested for.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gradwatch import agent
from gradwatch.agent import targets

from .conftest import free_port

pytestmark = pytest.mark.timeout(120)


class Wrapper(torch.optim.Optimizer):
    """An optimizer wrapper as accelerate writes one: an ``Optimizer`` subclass that never runs
    ``Optimizer.__init__`` and steps the optimizer it holds."""

    def __init__(self, optimizer, scaler=None):
        self.optimizer = optimizer
        self.scaler = scaler

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def step(self, closure=None):
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True):
        self.optimizer.zero_grad(set_to_none)


class Holder:
    """A wrapper as Lightning writes one: no optimizer at all, the real one as ``_optimizer``."""

    def __init__(self, optimizer):
        self._optimizer = optimizer


def native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


# --- the optimizer the agent hooks ------------------------------------------------------------------


def test_real_optimizer_follows_wrappers_to_the_one_with_step_hooks():
    model = nn.Linear(3, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    assert targets.real_optimizer(sgd) is sgd
    assert targets.real_optimizer(Wrapper(sgd)) is sgd
    assert targets.real_optimizer(Holder(Wrapper(sgd))) is sgd
    with pytest.raises(TypeError, match=r"Wrapper -> object is no torch.optim.Optimizer"):
        targets.real_optimizer(Wrapper(object()))
    with pytest.raises(TypeError, match="Holder"):
        targets.real_optimizer(Holder(None))
    scaler = torch.amp.GradScaler("cpu")
    assert targets.wrapped_scaler(Wrapper(sgd, scaler)) is scaler
    assert targets.wrapped_scaler(Wrapper(sgd)) is None and targets.wrapped_scaler(sgd) is None


def test_a_wrapped_optimizer_is_monitored_through_the_one_inside(collector):
    """The twelve lines that once hung: a Linear, SGD in an accelerate-style wrapper, attach. Now
    the wrapped optimizer's steps are reported, and the wrapper's own object gets no hook."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapper = Wrapper(sgd)
    monitor = agent.attach(model, wrapper, endpoint=collector.endpoint, every=1, nan_guard="off")
    try:
        assert monitor.active
        for _ in range(3):
            F.mse_loss(model(torch.randn(8, 4)), torch.randn(8, 2)).backward()
            wrapper.step()
            wrapper.zero_grad()
        assert monitor.step == 3
        assert len(sgd._optimizer_step_pre_hooks) == 1 and "_optimizer_step_pre_hooks" not in vars(wrapper)
        reports = collector.wait_steps(3)
        assert all(reports[s].probe for s in range(3))
    finally:
        monitor.close()
    assert not sgd._optimizer_step_pre_hooks and not sgd._optimizer_step_post_hooks


# --- every way attach can fail ----------------------------------------------------------------------

FAILURES = textwrap.dedent(
    """
    import gc, json, os, sys, threading, time, warnings
    import torch, torch.nn as nn
    import gradwatch.agent as gw

    def tasks():
        return len(os.listdir("/proc/self/task"))

    class NeverInit(torch.optim.Optimizer):          # holds nothing that steps
        def __init__(self, params): self.params = list(params)

    class RefusesPostHook(torch.optim.SGD):           # fails after the pre-hook is in place
        def register_step_post_hook(self, hook): raise RuntimeError("no post hooks here")

    class FrozenScaler:                                # the agent cannot wrap its update
        __slots__ = ()
        def update(self): pass

    model = nn.Linear(4, 2)
    base = tasks()
    cases = {
        "optimizer-without-hooks": lambda: gw.attach(model, NeverInit(model.parameters()), endpoint=EP),
        "optimizer-refuses-a-hook": lambda: gw.attach(model, RefusesPostHook(model.parameters(), lr=0.1), endpoint=EP),
        "scaler-refuses-its-wrapper": lambda: gw.attach(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                                        scaler=FrozenScaler(), endpoint=EP),
    }
    out = {}
    for name, make in cases.items():
        t0 = time.monotonic()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            monitor = make()
        del monitor
        gc.collect()
        out[name] = dict(
            monitor_seconds=time.monotonic() - t0,
            warned=[str(w.message) for w in caught if "could not attach" in str(w.message)],
            threads=[t.name for t in threading.enumerate() if t is not threading.main_thread()],
            native_extra=tasks() - base,
            model_hooks=len(model._forward_pre_hooks) + len(model._forward_hooks),
        )
    print(json.dumps(out))
    """
)


@pytest.mark.ddp  # a process of its own
def test_every_failed_attach_returns_at_once_and_leaves_nothing_running(tmp_path):
    """In a fresh interpreter (a hang there must not hang the suite): each failure after the
    agent's socket exists warns, returns the null monitor within seconds, and leaves no thread
    (Python's or ZeroMQ's native ones), no hook, and nothing that blocks ``gc.collect()``."""
    script = tmp_path / "failures.py"
    script.write_text("EP = 'tcp://127.0.0.1:9'\n" + FAILURES)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(out) == {"optimizer-without-hooks", "optimizer-refuses-a-hook", "scaler-refuses-its-wrapper"}
    for name, r in out.items():
        assert r["warned"], (name, r)
        assert r["monitor_seconds"] < 10, (name, r)
        assert r["threads"] == [] and r["native_extra"] == 0, (name, r)
        assert r["model_hooks"] == 0, (name, r)


def test_a_sender_that_cannot_be_made_closes_its_context():
    """The socket's setup failing part-way (here: key material that cannot be applied) ends
    the ZeroMQ context it made, so no native thread of it is left behind."""
    from gradwatch.agent.transport import Sender

    class BadKeys:
        def apply(self, sock):
            raise ValueError("not a key pair")

    base = native_threads()
    for _ in range(3):
        with pytest.raises(ValueError, match="not a key pair"):
            Sender("tcp://127.0.0.1:9", header=None, schema=None, heartbeat=None, keys=BadKeys())
    # each context left behind would add its I/O and reaper threads (6 here); another test's
    # threads ending meanwhile may only lower the count
    assert native_threads() <= base


# --- steps taken with a closure --------------------------------------------------------------------


def _norm64(model: nn.Module) -> float:
    return math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters() if p.grad is not None))


@pytest.mark.parametrize("how", ["positional", "keyword"])
def test_a_step_with_a_closure_reports_the_gradients_it_applies(collector, how):
    """``optimizer.step(closure)`` (Lightning's automatic optimization): the closure computes this
    step's gradients inside the step, and the reported norm is theirs (float64 reference taken in
    the closure), not the previous step's; the loss is the one the closure returns."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    monitor = agent.attach(model, opt, endpoint=collector.endpoint, every=2, nan_guard="off")
    ref_norms, ref_losses = [], []
    try:
        for step in range(6):
            x, y = torch.randn(16, 6) * (1 + step), torch.randn(16, 3)

            def closure():
                opt.zero_grad()
                loss = F.mse_loss(model(x), y)
                loss.backward()
                ref_norms.append(_norm64(model))
                ref_losses.append(float(loss.detach()))
                return loss

            opt.step(closure) if how == "positional" else opt.step(closure=closure)
        reports = collector.wait_steps(6)
    finally:
        monitor.close()
    for step in range(6):
        r = reports[step]
        assert r.grad_norm == pytest.approx(ref_norms[step], rel=1e-6), step
        assert r.loss == pytest.approx(ref_losses[step], rel=1e-6), step
    assert reports[2].probe and not reports[1].probe


def test_observe_loss_inside_the_closure_wins_and_lbfgs_gets_the_last_evaluation(collector):
    """A loss given to ``observe_loss`` during the step is the step's, not the closure's return;
    LBFGS, which evaluates its closure several times a step, is measured at the gradients the
    last evaluation left."""
    torch.manual_seed(1)
    model = nn.Linear(5, 1)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    monitor = agent.attach(model, opt, endpoint=collector.endpoint, every=1, nan_guard="off")
    x, y = torch.randn(32, 5), torch.randn(32, 1)
    last, calls = [], []
    try:
        for step in range(3):
            def closure():
                opt.zero_grad()
                loss = F.mse_loss(model(x), y)
                loss.backward()
                if not calls or calls[-1] != step:
                    monitor.observe_loss(torch.tensor(100.0 + step))
                calls.append(step)
                last[:] = [_norm64(model)]
                return loss

            opt.step(closure)
            reports = collector.wait_steps(step + 1)
            assert reports[step].grad_norm == pytest.approx(last[0], rel=1e-6)
            assert reports[step].loss == pytest.approx(100.0 + step)
    finally:
        monitor.close()
    assert len(calls) > 3  # LBFGS evaluated more than once a step
    assert monitor.errors == 0


# --- steps numbered as a framework numbers them -----------------------------------------------------


def test_steps_are_numbered_as_the_framework_numbers_them(collector):
    """``number_steps``: each step is reported under the framework's number, read while it is taken:
    from 41 on; an iteration the GradScaler skips keeps its number (the framework counts it: a gap
    in the reported steps, the next report saying one step was skipped); a number that does not
    move on gives the previous + 1; the probe cadence counts the framework's numbers."""
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1_000_000)
    framework = {"step": 41}
    monitor = agent.attach(model, opt, scaler=scaler, endpoint=collector.endpoint, every=4, nan_guard="off")
    try:
        monitor.number_steps(lambda: framework["step"])
        for i in range(6):
            loss = model(torch.randn(4, 3)).square().mean()
            if i == 2:  # overflow: the scaler skips this iteration
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            if i != 4:  # the framework's counter stalls once: the agent moves on by one
                framework["step"] += 1
        reports = collector.wait(lambda: (r := collector.reports()) and len(r) == 5 and r, what="five steps")
    finally:
        monitor.close()
    assert sorted(reports) == [41, 42, 44, 45, 46]  # 43 skipped; the stalled 45 read as 46 by previous + 1
    assert reports[44].skipped == 1 and [reports[s].skipped for s in (41, 42, 45, 46)] == [0, 0, 0, 0]
    assert [s for s in sorted(reports) if reports[s].probe] == [44]


def test_a_scaler_skip_at_the_first_step_is_counted(collector):
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    with agent.attach(model, opt, scaler=scaler, endpoint=collector.endpoint, every=100) as monitor:
        for i in range(3):
            loss = model(torch.randn(4, 3)).square().mean() * (float("inf") if i == 0 else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        reports = collector.wait_steps(2)
    assert reports[0].skipped == 1 and reports[1].skipped == 0 and monitor.step == 2


def test_the_batch_is_found_inside_a_tuple_argument():
    from gradwatch.agent.hooks import first_batch

    x, y = torch.zeros(7, 3), torch.zeros(7)
    assert first_batch(((x, y), 0), {}) == 7  # Lightning's training_step(batch, batch_idx)
    assert first_batch(({"input_ids": torch.zeros(5, 2, dtype=torch.long)},), {}) == 5
    assert first_batch((torch.zeros(4, 1), (x, y)), {}) == 4  # a tensor argument comes first
    assert first_batch((3, "a"), {}) == 0


def test_an_optimizer_over_other_parameters_is_said(collector):
    """The model the agent watches is not the one the optimizer trains (wrapped after attach):
    warned at attach, naming what to do."""
    model, other = nn.Linear(3, 1), nn.Linear(3, 1)
    opt = torch.optim.SGD(other.parameters(), lr=0.1)
    with pytest.warns(RuntimeWarning, match="updates none of the parameters"):
        monitor = agent.attach(model, opt, endpoint=collector.endpoint)
    monitor.close()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ok = agent.attach(other, opt, endpoint=collector.endpoint)
    ok.close()
    assert ok is not monitor and not [w for w in caught if "updates none" in str(w.message)]


# --- the module given before (or without) its DDP wrapper -------------------------------------------

FOLLOW_STEPS = 4


def _drain(monitor, timeout_s: float = 30.0) -> None:
    """Wait (in a worker process) until ``monitor``'s sender connected and handed every report to
    ZeroMQ: a few steps on a loaded machine can end before the handshake."""
    deadline = time.monotonic() + timeout_s
    while not (monitor.sender.connected and monitor.sender.pending == 0) and time.monotonic() < deadline:
        time.sleep(0.01)


def _follow_worker(rank: int, world: int, port: int, endpoint: str, out_dir: str) -> None:
    """Phase "follow": attach to the module, then wrap it in DDP (as a framework's callback, or a
    script attaching before wrapping, does): the ranks' own norms are measured from the first
    step, and equal a float64 replay of this rank's forward and backward on an unwrapped copy.
    Phase "alone": a world of two training a module no DDP runs warns once."""
    import copy
    import gc

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        monitor = agent.attach(model, opt, endpoint=endpoint, every=2, job="follow", nan_guard="off")
        ddp = DDP(model)
        gen = torch.Generator().manual_seed(10 + rank)
        local = []
        for _ in range(FOLLOW_STEPS):
            x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 2, generator=gen)
            replay = copy.deepcopy(model)
            F.mse_loss(replay(x), y).backward()
            local.append(_norm64(replay))
            F.mse_loss(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
        installed = monitor.local_norms
        _drain(monitor)
        monitor.close()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            alone = nn.Linear(3, 1)
            opt2 = torch.optim.SGD(alone.parameters(), lr=0.1)
            m2 = agent.attach(alone, opt2, endpoint=endpoint, job="alone", nan_guard="off")
            for _ in range(3):
                alone(torch.randn(4, 3)).sum().backward()
                opt2.step()
            _drain(m2)
            m2.close()
        said = [str(w.message) for w in caught if "no DistributedDataParallel runs" in str(w.message)]
        with open(os.path.join(out_dir, f"follow-{rank}.json"), "w") as f:
            json.dump(dict(local=local, installed=installed, said=said), f)
        del ddp, monitor
        gc.collect()
    finally:
        dist.destroy_process_group()


@pytest.mark.ddp
def test_a_module_given_before_its_ddp_wrapper_is_followed_to_it(collector, tmp_path):
    import torch.multiprocessing as mp

    procs = mp.start_processes(_follow_worker, args=(2, free_port(), collector.endpoint, str(tmp_path)),
                               nprocs=2, join=False, start_method="spawn")
    while not procs.join(timeout=0.05):
        collector.pump(0.05)
    collector.pump(0.5)
    for rank in range(2):
        got = json.loads((tmp_path / f"follow-{rank}.json").read_text())
        assert got["installed"] and len(got["said"]) == 1, got
        reports = collector.wait_steps(FOLLOW_STEPS, job="follow", rank=rank)
        for step in range(FOLLOW_STEPS):
            assert reports[step].local_grad_norm == pytest.approx(got["local"][step], rel=1e-6), (rank, step)
        alone = collector.reports(job="alone", rank=rank)
        assert alone and all(math.isnan(r.local_grad_norm) for r in alone.values())


# --- a watched model can be copied and saved ---------------------------------------------------------


def test_a_watched_model_deep_copies_and_pickles_and_its_copy_is_not_watched(collector, tmp_path):
    """With the agent's hooks in place (a probed step, the NaN guard on), ``copy.deepcopy(model)``
    (an EMA or evaluation copy) and ``torch.save(model)`` work; the copy carries inert hooks, so
    running it, with gradients, adds nothing to the watched model's statistics."""
    import copy

    from gradwatch import columns

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = agent.attach(model, opt, endpoint=collector.endpoint, every=1, nan_guard="on")
    try:
        x = torch.randn(5, 4)
        loss = model(x).pow(2).mean()
        twin = copy.deepcopy(model)  # mid-step, hooks in place
        twin(x).sum().backward()
        torch.save(model, tmp_path / "model.pt")
        again = torch.load(tmp_path / "model.pt", weights_only=False)
        again(x).sum().backward()
        assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values()))
        loss.backward()
        opt.step()
        report = collector.wait_steps(1)[0]
    finally:
        monitor.close()
    calls = report.act_count[:, columns.at("act_count").calls]
    assert report.probe and len(calls) == 3 and set(calls.tolist()) == {1.0}, calls  # the copies never count
    for copied in (twin, again):  # their first call took the stand-ins off: nothing of the agent's left
        assert not any(m._forward_hooks or m._forward_pre_hooks for m in copied.modules())
