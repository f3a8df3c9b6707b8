"""How the agent behaves inside a training job: probe cadence, identical runs (plain and 2-rank
gloo DDP), gradient accumulation, absent or late aggregators, fork, memory, sender failures and
configuration. Real parts only: real models, real ZeroMQ sockets bound here, real subprocesses.
"""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gradwatch import agent, wire

from .conftest import Collector, free_port

pytestmark = pytest.mark.timeout(120)


# --- harness ---------------------------------------------------------------------------------------




class MLP(nn.Module):
    def __init__(self, width: int = 16, dropout: float = 0.0):
        super().__init__()
        self.fc1 = nn.Linear(8, width)
        self.act = nn.ReLU(inplace=True)
        self.drop = nn.Dropout(dropout)
        self.norm = nn.LayerNorm(width)
        self.fc2 = nn.Linear(width, 4)

    def forward(self, x):
        return self.fc2(self.norm(self.drop(self.act(self.fc1(x)))))


def leaf_hook_counts(model: nn.Module) -> dict[str, int]:
    """Every kind of module hook PyTorch keeps, summed per module, for modules that have any."""
    out = {}
    for name, m in model.named_modules():
        n = sum(len(d) for d in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks))
        if n:
            out[name or "<root>"] = n
    return out


def optimizer_hook_count(opt: torch.optim.Optimizer) -> int:
    return len(opt._optimizer_step_pre_hooks) + len(opt._optimizer_step_post_hooks)


# --- (a) probe cadence and hook lifetime ------------------------------------------------------------


@pytest.mark.parametrize("nan_guard", ["off", "on"])
def test_probe_cadence_and_module_hooks_only_during_probed_steps(collector, nan_guard):
    """every=3 over 10 steps: a report for each step, probe=True exactly at steps 0, 3, 6, 9;
    leaf modules carry a forward hook only while a probed step runs (every step with the NaN
    guard on, one hook each); none are left after close."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    leaves = [m for m in model.modules() if next(m.children(), None) is None]
    assert not leaf_hook_counts(model)
    monitor = agent.attach(model, opt, endpoint=collector.endpoint, every=3, nan_guard=nan_guard)
    hooked_at = []
    try:
        for step in range(10):
            if all(m._forward_hooks for m in leaves):
                hooked_at.append(step)
            else:  # outside probes no module carries any hook of the agent's
                assert not leaf_hook_counts(model), (step, leaf_hook_counts(model))
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            assert all(len(m._forward_hooks) <= 1 for m in leaves), step
        reports = collector.wait_steps(10)
    finally:
        monitor.close()
    assert hooked_at == ([0, 3, 6, 9] if nan_guard == "off" else list(range(10)))
    assert sorted(reports) == list(range(10))
    # the guard's verdict travels with the unprobed steps only: -1, nothing non-finite
    assert {r.nonfinite_slot for r in reports.values() if not r.probe} == ({None} if nan_guard == "off" else {-1})
    assert {r.nonfinite_slot for r in reports.values() if r.probe} == {None}
    assert [s for s, r in sorted(reports.items()) if r.probe] == [0, 3, 6, 9]
    assert monitor.step == 10 and monitor.probes == 4
    assert not leaf_hook_counts(model), "module hooks left after close()"
    assert optimizer_hook_count(opt) == 0, "optimizer hooks left after close()"


# --- (b) identical run, plain module ----------------------------------------------------------------


def _train_plain(steps: int, endpoint: str | None, nan_guard: str = "auto"):
    torch.manual_seed(11)
    model = MLP(width=32, dropout=0.2)  # dropout: the agent must not consume random numbers
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(12)
    monitor = agent.attach(model, opt, endpoint=endpoint, every=2, nan_guard=nan_guard) if endpoint else agent.NullMonitor()
    losses, outputs = [], []
    with monitor:
        for _ in range(steps):
            x, y = torch.randn(8, 8, generator=gen), torch.randn(8, 4, generator=gen)
            out = model(x)
            loss = F.mse_loss(out, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach().clone())
            outputs.append(out.detach().clone())
    return monitor, torch.stack(losses), torch.stack(outputs), {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("nan_guard", ["on", "off"])
def test_identical_run_plain_module(collector, nan_guard):
    """Identical run: losses, outputs and final parameters with the agent attached (probed and
    unprobed steps, with and without the NaN guard's sums) equal bit for bit those of the same
    run without it."""
    torch.use_deterministic_algorithms(True)
    try:
        _, loss0, out0, params0 = _train_plain(8, None)
        monitor, loss1, out1, params1 = _train_plain(8, collector.endpoint, nan_guard)
    finally:
        torch.use_deterministic_algorithms(False)
    assert monitor.step == 8 and monitor.probes == 4
    assert torch.equal(loss0, loss1)
    assert torch.equal(out0, out1)
    assert params0.keys() == params1.keys()
    for n in params0:
        assert torch.equal(params0[n], params1[n]), n


# --- (b) identical run and (c) gradient accumulation on a real 3-rank gloo DDP job ---------------

# 3 ranks: a world size that is not a power of two is where scaling by 1/W and dividing by W differ
DDP_STEPS, ACCUM_STEPS, MICRO, RANKS = 6, 3, 4, 3


def _ddp_worker(rank: int, world: int, port: int, endpoint: str, out_dir: str, acks) -> None:
    """One rank: for each phase ("plain": one micro-step per step; "accum": 4 micro-steps with
    no_sync on the first 3) train once without and once with the agent, and save what happened."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results = {}
        for phase, steps, micro in (("plain", DDP_STEPS, 1), ("accum", ACCUM_STEPS, MICRO)):
            for with_agent in (False, True):
                torch.manual_seed(0)
                model = MLP(width=16, dropout=0.1)
                ddp = DDP(model)
                opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
                monitor = (
                    agent.attach(ddp, opt, endpoint=endpoint, every=2 if phase == "plain" else 1, job=phase)
                    if with_agent else agent.NullMonitor()
                )
                gen = torch.Generator().manual_seed(100 + rank)
                losses, grad_norms = [], []
                for _ in range(steps):
                    for k in range(micro):
                        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)
                        sync = contextlib.nullcontext() if k == micro - 1 else ddp.no_sync()
                        with sync:
                            loss = F.mse_loss(ddp(x), y) / micro
                            loss.backward()
                        losses.append(loss.detach().clone())
                    grad_norms.append({n: p.grad.double().norm().item() for n, p in model.named_parameters()})
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                if with_agent:
                    # wait until the test has received every report, so closing cannot drop one
                    acks[phase].wait(60)
                monitor.close()
                results[(phase, with_agent)] = dict(
                    losses=torch.stack(losses), grad_norms=grad_norms, steps=monitor.step,
                    params={n: p.detach().clone() for n, p in model.named_parameters()},
                )
        del ddp, monitor  # the DDP freed while its group is registered (see train_rank in commands/demo/run.py)
        gc.collect()
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.ddp
def test_ddp_identical_run_and_c13_accumulation_under_no_sync(collector, tmp_path):
    """2-rank gloo DDP. Identical run: per rank, losses and final parameters with the agent equal
    bit for bit those without it, also under gradient accumulation. C13: 4 micro-steps with
    no_sync on the first 3 give one report per optimizer step (steps 0..2), ``micro`` = 4, and
    per-parameter gradient norms equal the all-reduced gradients the optimizer stepped with."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    acks = {"plain": ctx.Event(), "accum": ctx.Event()}
    procs = mp.start_processes(
        _ddp_worker, args=(RANKS, free_port(), collector.endpoint, str(tmp_path), acks),
        nprocs=RANKS, join=False, start_method="spawn",
    )
    want = {"plain": DDP_STEPS, "accum": ACCUM_STEPS}
    deadline = time.monotonic() + 100
    while not procs.join(timeout=0.05):
        collector.pump(0.05)
        for phase, n in want.items():
            if all(all(s in collector.reports(phase, r) for s in range(n)) for r in range(RANKS)):
                acks[phase].set()
        assert time.monotonic() < deadline, "DDP workers did not finish"
    collector.pump(0.1)

    res = [torch.load(tmp_path / f"rank{r}.pt") for r in range(RANKS)]
    for rank, rr in enumerate(res):
        for phase in want:
            base, mon = rr[(phase, False)], rr[(phase, True)]
            assert torch.equal(base["losses"], mon["losses"]), (rank, phase)
            for n, p in base["params"].items():
                assert torch.equal(p, mon["params"][n]), (rank, phase, n)
            assert mon["steps"] == want[phase]
    for n, p in res[0][("accum", True)]["params"].items():
        assert torch.equal(p, res[1][("accum", True)]["params"][n]), f"replicas differ: {n}"

    for rank in range(RANKS):
        plain = collector.reports("plain", rank)
        assert sorted(plain) == list(range(DDP_STEPS))
        assert [s for s, r in sorted(plain.items()) if r.probe] == list(range(0, DDP_STEPS, 2))
        accum = collector.reports("accum", rank)
        assert sorted(accum) == list(range(ACCUM_STEPS)), "one report per optimizer step, not per micro-step"
        schema = next(m for m in collector.msgs if isinstance(m, wire.Schema) and m.header.job == "accum" and m.header.rank == rank)
        names = [p[0] for p in schema.params]
        for step, r in accum.items():
            assert r.probe and r.micro == MICRO, (rank, step, r.micro)
            ref = res[rank][("accum", True)]["grad_norms"][step]
            for name, norm in ref.items():
                assert float(r.param[names.index(name), 0]) == pytest.approx(norm, rel=1e-5), (rank, step, name)
            total = sum(v * v for v in ref.values()) ** 0.5
            assert r.grad_norm == pytest.approx(total, rel=1e-5)


# --- (d) C24 / C26: no aggregator, process exit -----------------------------------------------------

_SCRIPT = textwrap.dedent(
    """
    import sys, time, torch
    from gradwatch import agent

    mode, endpoint, ending = sys.argv[1:4]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    # no close(): the script just ends, as many do
    monitor = agent.attach(model, opt, endpoint=endpoint, every=2, heartbeat_s=0.05) if mode == "agent" else agent.NullMonitor()
    t0 = time.perf_counter()
    for step in range(60):
        model(torch.randn(16, 32)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if ending == "raise" and step == 40:
            break
    loop = time.perf_counter() - t0
    print("active", monitor.active, "steps", monitor.step, "loop", loop, "end", time.time(), flush=True)
    if ending == "raise":
        raise RuntimeError("boom from the training script")
    """
)


def _run_pair(script, endpoint: str, ending: str) -> dict:
    """Run the script with and without the agent side by side; per mode return
    ``(returncode or None on timeout, stdout, stderr, wall clock when reaped)``."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    results = {}

    def run(mode):
        p = subprocess.Popen(
            [sys.executable, str(script), mode, endpoint, ending],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )
        try:
            stdout, stderr = p.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
            results[mode] = (None, stdout, stderr, time.time())
            return
        results[mode] = (p.returncode, stdout, stderr, time.time())

    threads = [threading.Thread(target=run, args=(mode,)) for mode in ("none", "agent")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.mark.parametrize("ending", ["normal", "raise"])
@pytest.mark.ddp
def test_c24_c26_no_aggregator_training_finishes_and_process_exits(tmp_path, ending):
    """C24/C26: with the endpoint at a closed port, the script trains without blocking (agent
    active, training loop within 2 s of the loop without the agent) and its process exits within
    2 s of the same script without the agent, also when the script dies with an exception.

    Both scripts run side by side. The exit is timed from the script's last line to the process's
    end (wall clock, printed by the script, read when the process is reaped here), because the
    whole run is dominated by importing torch, which varies by seconds on a loaded machine. Even
    the exit alone (torch's teardown) varied by 1-3 s between twin runs on a loaded 2-core
    machine, so a pair that misses the bound is run again, up to 3 times: a real hang or linger
    delays every run, noise does not."""
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    endpoint = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
    steps = 41 if ending == "raise" else 60
    tries = []
    for _ in range(3):
        results = _run_pair(script, endpoint, ending)
        exit_s, loop_s = {}, {}
        for mode, (rc, stdout, stderr, reaped) in results.items():
            assert rc is not None, f"{mode}: the process did not exit within 90 s: {stdout} {stderr}"
            assert rc == (1 if ending == "raise" else 0), (mode, stdout, stderr)
            if ending == "raise":
                assert "boom from the training script" in stderr
            else:
                assert "Traceback" not in stderr, (mode, stderr)
            words = stdout.split()
            loop_s[mode] = float(words[words.index("loop") + 1])
            exit_s[mode] = reaped - float(words[words.index("end") + 1])
            assert int(words[words.index("steps") + 1]) == (steps if mode == "agent" else 0)
        assert "active True" in results["agent"][1], results["agent"]
        tries.append((loop_s, exit_s))
        if loop_s["agent"] <= loop_s["none"] + 2.0 and exit_s["agent"] <= exit_s["none"] + 2.0:
            return
    pytest.fail(f"with the agent, the loop or the exit took over 2 s longer in every try (loop, exit): {tries}")


# --- (e) C24: a late aggregator still learns the schema --------------------------------------------


def test_c24_late_aggregator_gets_schema_resent_and_reports(tmp_path):
    """C24: the agent starts with nothing listening and trains; then an aggregator binds. It
    receives a schema sent after it came up (not only one queued before) and reports of later
    steps refer to a schema it has received."""
    port = free_port()
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(8, 8), torch.randn(8, 4)

    def step():
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    # periodic schema resends far away, so only a resend on connect can explain a fresh schema
    monitor = agent.attach(model, opt, endpoint=f"tcp://127.0.0.1:{port}", every=2, schema_every_s=3600)
    late = None
    try:
        for _ in range(6):
            step()
        deadline = time.monotonic() + 10
        while monitor.sender.blocked < 2:  # let the agent try (and be refused) more than once
            assert time.monotonic() < deadline
            time.sleep(0.01)
        # IMMEDIATE: nothing is handed to ZeroMQ (nor queued there) while no aggregator is connected
        seq_before = monitor.sender.seq
        assert seq_before == 0
        late = Collector(port)
        late.wait(lambda: any(isinstance(m, wire.Schema) and m.header.seq >= seq_before for m in late.msgs),
                  timeout_s=20, what="a schema sent after the aggregator came up")
        for _ in range(4):
            step()
        late.wait_steps(10)
    finally:
        monitor.close()
        if late is not None:
            late.close()
    schemas = {m.hash for m in late.msgs if isinstance(m, wire.Schema)}
    later = [r for r in late.records() if r.step >= 6]
    assert {m.step for m in later} == set(range(6, 10))
    for r in later:
        assert r.schema in schemas, (r.step, r.schema, schemas)
    assert any(r.probe for r in later)


# --- (f) C23: fork while the agent's threads run ---------------------------------------------------


class ForwardingDataset(torch.utils.data.Dataset):
    """A dataset whose items run the (hooked) model forward inside the DataLoader worker."""

    def __init__(self, model: nn.Module, n: int = 8):
        self.model = model
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(8, generator=g)
        feat = self.model(x[None])[0].detach()  # with grad enabled: probe hooks run in the child
        return x, feat


@pytest.mark.timeout(90)
def test_c23_fork_dataloader_workers_do_not_hang_or_send(collector):
    """C23: an active agent (busy sender thread), DataLoaders with 2 fork workers recreated for 5
    epochs, items computed by the hooked model in the workers: no hang, training continues, and
    nothing is sent from a worker: every message received has the parent agent's boot id and the
    sequence numbers run 0, 1, 2, ... without gaps or repeats."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ds = ForwardingDataset(model)
    monitor = agent.attach(model, opt, endpoint=collector.endpoint, every=1, heartbeat_s=0.005)
    steps = 0
    try:
        for _ in range(5):
            loader = torch.utils.data.DataLoader(ds, batch_size=2, num_workers=2, multiprocessing_context="fork")
            for x, feat in loader:
                F.mse_loss(model(x), feat).backward()
                opt.step()
                opt.zero_grad()
                steps += 1
            del loader
        collector.wait_steps(steps)
        assert monitor.sender.alive and monitor.active
    finally:
        monitor.close()
    assert steps == 20
    boots = {m.header.boot for m in collector.msgs}
    assert boots == {monitor.boot}
    seqs = sorted(m.header.seq for m in collector.msgs)
    assert seqs == list(range(len(seqs))), "a gap or a repeated sequence number: someone else sent"


# --- (g) C16: no references kept, no hooks left ------------------------------------------------------


def test_c16_model_is_freed_after_close_and_no_hooks_accumulate(collector):
    """C16: attach, train, run eval batches under no_grad in train mode, close, ``del model``:
    a weakref to the model is dead even while the monitor and the optimizer live on. Then 100
    attach/close cycles leave no module or optimizer hooks, no sender threads and no open files."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    monitor = agent.attach(model, opt, endpoint=collector.endpoint, every=1)
    for _ in range(3):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    model.train()
    with torch.no_grad():
        for _ in range(50):
            model(torch.randn(4, 8))
    assert not monitor.recorder.act and not monitor.recorder.grad, "eval batches were recorded"
    collector.wait_steps(3)
    monitor.close()
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None, f"the model is still referenced by: {[type(r).__name__ for r in gc.get_referrers(ref())]}"
    assert monitor is not None and opt is not None  # both still alive

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    fds_before = fds()
    for _ in range(100):
        with agent.attach(model, opt, endpoint=collector.endpoint, every=1):
            pass
    gc.collect()
    assert not leaf_hook_counts(model)
    assert optimizer_hook_count(opt) == 0
    deadline = time.monotonic() + 5
    while any(t.name == "gradwatch-sender" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [t for t in threading.enumerate() if t.name == "gradwatch-sender"], "sender threads left"
    assert fds() <= fds_before + 4, (fds_before, fds())


# --- (h) C32: the sender thread survives a message that fails to build ------------------------------


def test_c32_sender_survives_failing_builders_and_keeps_sending(collector):
    """C32: a builder that raises and a message holding a value msgpack cannot hold are each
    dropped and counted once; the sender thread stays alive and later reports still arrive.
    (numpy scalars are packable: the encoder turns them into Python numbers, tests/test_wire.py.)"""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    monitor = agent.attach(model, opt, endpoint=collector.endpoint, every=1, heartbeat_s=0.05)
    try:
        collector.wait(lambda: any(isinstance(m, wire.Heartbeat) for m in collector.msgs), what="a heartbeat")
        sender = monitor.sender
        assert sender.errors == 0, "a fresh agent already counts a failed message"

        def raises(h):
            raise RuntimeError("statistic failed to build")

        def unpackable(h):
            return wire.Heartbeat(h, step=object(), sent=0, drops=0, errors=0)

        sender.submit(raises)
        sender.submit(unpackable)
        collector.wait(lambda: sender.errors >= 2, timeout_s=10, what="both failures counted")
        for _ in range(3):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
        reports = collector.wait_steps(3)
        assert sender.alive
        assert sender.errors == 2
        assert all(r.probe for r in reports.values())
        hb = collector.wait(lambda: [m for m in collector.msgs if isinstance(m, wire.Heartbeat) and m.errors >= 2],
                            what="a heartbeat counting the errors")
        assert hb[-1].errors == 2
    finally:
        monitor.close()
    assert not monitor.sender.alive


def test_c32_fresh_agent_counts_no_errors(collector):
    """A fresh agent's first heartbeat builds cleanly: no failure counted (a heartbeat built
    before the monitor has its sender would fail). Repeated: the order is a race between threads.
    A peer listens: with IMMEDIATE nothing is built or handed over without one."""
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(10):
        monitor = agent.attach(model, opt, endpoint=collector.endpoint, heartbeat_s=0.01)
        try:
            deadline = time.monotonic() + 10
            while monitor.sender.sent < 2:  # handed to ZeroMQ: sent counts them
                assert time.monotonic() < deadline, "no heartbeat handed to ZeroMQ"
                time.sleep(0.005)
            assert monitor.sender.errors == 0 and monitor.errors == 0
        finally:
            monitor.close()


# --- (i) configuration ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings, name",
    [({"every": 0}, "every"), ({"evry": 3}, "evry"), ({"endpoint": "localhost:5555"}, "endpoint")],
    ids=["every=0", "unknown", "endpoint"],
)
def test_config_error_names_the_setting(settings, name):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with pytest.raises(agent.ConfigError, match=rf"\b{name}\b"):
        agent.attach(model, opt, **settings)
    assert not leaf_hook_counts(model) and optimizer_hook_count(opt) == 0


def test_gradwatch_every_environment_variable(collector, monkeypatch):
    """GRADWATCH_EVERY=4 sets the cadence (probes at steps 0 and 4 of 6); an invalid value in
    the environment is a ConfigError naming the setting."""
    monkeypatch.setenv("GRADWATCH_EVERY", "4")
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with agent.attach(model, opt, endpoint=collector.endpoint) as monitor:
        assert monitor.cfg.every == 4
        for _ in range(6):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
        reports = collector.wait_steps(6)
    assert [s for s, r in sorted(reports.items()) if r.probe] == [0, 4]
    monkeypatch.setenv("GRADWATCH_EVERY", "0")
    with pytest.raises(agent.ConfigError, match=r"\bevery\b"):
        agent.attach(model, opt, endpoint=collector.endpoint)


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_disabled_agent_is_a_null_monitor_that_attaches_nothing(monkeypatch, how):
    kw = {}
    if how == "argument":
        kw["enabled"] = False
    else:
        monkeypatch.setenv("GRADWATCH_ENABLED", "0")
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    threads = set(threading.enumerate())
    monitor = agent.attach(model, opt, every=1, **kw)
    assert isinstance(monitor, agent.NullMonitor) and not monitor.active
    assert not leaf_hook_counts(model) and optimizer_hook_count(opt) == 0
    assert set(threading.enumerate()) <= threads, "a disabled agent started a thread"
    with monitor:
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    assert monitor.step == 0


@pytest.mark.parametrize("ending, reason", [("normal", "finished"), ("exception", "other"), ("close", "closed")])
def test_the_goodbye_says_how_training_ended(collector, ending, reason):
    """Leaving ``with attach(...)`` normally says ``finished``, an exception out of the block
    ``other``, an explicit close() ``closed``: the aggregator's rank_silent quotes it."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def train(monitor):
        for _ in range(2):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
        collector.wait_steps(2)  # connected: the goodbye has a peer to go to
        if ending == "exception":
            raise KeyboardInterrupt
        if ending == "close":
            monitor.close()

    with contextlib.suppress(KeyboardInterrupt):
        with agent.attach(model, opt, endpoint=collector.endpoint, every=1) as monitor:
            train(monitor)
    bye = collector.wait(lambda: [m for m in collector.msgs if isinstance(m, wire.Heartbeat) and m.closing],
                         what="the goodbye heartbeat")
    assert {m.reason for m in bye} == {reason}  # the last turns may both say goodbye
