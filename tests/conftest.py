"""Shared fixtures: free ports, a real aggregator process over TCP, /metrics scraping."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import zmq
from prometheus_client.parser import text_string_to_metric_families

from bench import harness
from bench.harness import free_port
from gradwatch import wire

ROOT = Path(__file__).resolve().parents[1]


SLOW = ("ddp", "stack", "wheel")


def pytest_collection_modifyitems(items):
    """Tiers: every test marked ddp, stack or wheel is also "slow"; ``-m "not slow"`` is the fast
    tier (no training run, no server, no wheel build)."""
    for item in items:
        if any(item.get_closest_marker(m) for m in SLOW):
            item.add_marker(pytest.mark.slow)


def children(pid: int) -> dict[int, bytes]:
    """``{pid: command line}`` of the live child processes of process ``pid`` (Linux ``/proc``); a
    child that exits while they are read is left out."""
    kids: dict[int, bytes] = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                ids = [int(k) for k in f.read().split()]
        except FileNotFoundError:
            continue
        for k in ids:
            try:
                with open(f"/proc/{k}/cmdline", "rb") as f:
                    kids[k] = f.read()
            except FileNotFoundError:
                pass
    return kids


def wait_for(predicate, timeout: float = 20.0, interval: float = 0.1, what: str = "condition"):
    """Poll ``predicate`` until it returns a truthy value; return that value or fail the test."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
            if last:
                return last
        except Exception as e:  # the server may not be up yet
            last = e
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def samples(text: str, name: str) -> dict[tuple, float]:
    """``{sorted label items: value}`` of every sample called ``name`` in an exposition text."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


class AggregatorProcess(harness.AggregatorProcess):
    """A real aggregator process on loopback (:class:`bench.harness.AggregatorProcess`), read as
    the tests read it."""

    def findings(self, job: str | None = None, active: bool = False) -> list[dict]:
        """Events from /api/findings, newest first (or the active findings with ``active``)."""
        params = {"active": "1"} if active else {}
        if job:
            params["job_id"] = job
        r = requests.get(self.base_url + "/api/findings", params=params, timeout=5)
        r.raise_for_status()
        return r.json()["findings"]

    def scrape(self) -> str:
        r = requests.get(self.metrics_url, timeout=5)
        r.raise_for_status()
        return r.text


def start_aggregator(tmp_path: Path, *args: str, port: int | None = None, **kw) -> AggregatorProcess:
    """``python -m gradwatch.aggregator`` on loopback, once /healthz answers (``args``: more
    settings; ``port``: its ZeroMQ port; ``kw``: :class:`bench.harness.AggregatorProcess`'s
    ``command``, ``env``, ...); its output in ``tmp_path``. Fails the test if it does not start."""
    port = port or free_port()
    try:
        agg = AggregatorProcess(*args, log=tmp_path / f"aggregator-{port}.log", port=port, **kw)
    except RuntimeError as e:
        pytest.fail(str(e))
    _STARTED.append(agg)
    return agg


class FaultJob:
    """bench/faultjob.py in a process of its own: a 2-rank gloo DDP job with the agent sending to
    ``endpoint`` as job ``job``, about 20 steps a second, until :meth:`finish`. Its files in
    ``workdir``: ``stop`` (written to stop it), ``progress.{rank}`` (steps done), ``out.{rank}.json``
    (what each rank did), ``job.log`` (its output)."""

    def __init__(self, workdir: Path, endpoint: str, job: str):
        self.dir = workdir
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "bench" / "faultjob.py"), "--endpoint", endpoint, "--port", str(free_port()),
             "--stop", str(workdir / "stop"), "--progress", str(workdir / "progress"), "--out", str(workdir / "out"),
             "--job", job, "--every", "5", "--width", "64", "--batch", "16", "--sleep-s", "0.05",
             "--heartbeat-s", "0.5", "--watchdog-s", "240"],
            stdout=(workdir / "job.log").open("w"), stderr=subprocess.STDOUT)

    def steps(self) -> int:
        """Steps both ranks have done (0 until both wrote their progress)."""
        files = [self.dir / f"progress.{r}" for r in range(2)]
        return min(int(f.read_text() or 0) for f in files) if all(f.exists() for f in files) else 0

    def finish(self, timeout_s: float = 120) -> dict[int, int]:
        """Stop it, check it exited cleanly, and return each rank's steps."""
        (self.dir / "stop").write_text("stop")
        assert self.proc.wait(timeout_s) == 0, (self.dir / "job.log").read_text()[-3000:]
        return {r: json.loads((self.dir / f"out.{r}.json").read_text())["steps"] for r in range(2)}


#: every aggregator process :func:`start_aggregator` started: one a failing test left running is
#: stopped at the end of the session, never left behind
_STARTED: list[AggregatorProcess] = []


def pytest_sessionfinish(session, exitstatus):
    for agg in _STARTED:
        agg.stop()


def run_demo(endpoint: str, *, ranks: int = 3, steps: int = 40, every: int = 10, inject=(), job: str = "faults",
             extra=(), timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``gradwatch demo`` (a real gloo DDP job, tiny model) against ``endpoint`` and wait for it."""
    cmd = [sys.executable, "-m", "gradwatch.commands", "demo", "--aggregator", endpoint, "--ranks", str(ranks),
           "--steps", str(steps), "--every", str(every), "--job", job, "--no-progress",
           "--width", "32", "--layers", "2", "--heads", "2", "--batch-size", "8", "--context", "32"]
    for spec in inject:
        cmd += ["--inject", spec]
    run = subprocess.run([*cmd, *extra], capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stdout + run.stderr
    return run


_SENDER_FIELDS = ("drops", "agent_cost", "probe_interval", "over_budget")


def expand(m) -> list:
    """The records of a ``wire.Steps`` as one ``wire.Report`` per step (the message's header and
    sender fields on each), so tests read every step alike however it travelled."""
    sender = {k: getattr(m, k) for k in _SENDER_FIELDS}
    cols = {c.name: getattr(m, c.name).tolist() for c in wire.STEP_COLUMNS}
    out = []
    for i in range(len(m)):
        grad_sq = None if m.grad_sq is None else tuple(zip(m.grad_sq_dims, m.grad_sq[i].tolist()))
        out.append(wire.Report(m.header, m.schema, **{k: v[i] for k, v in cols.items()}, **sender, grad_sq=grad_sq,
                               grad_norms=None if m.grad_norms is None else m.grad_norms[i],
                               nonfinite_slot=None if m.nonfinite_slot is None else int(m.nonfinite_slot[i])))
    return out


def records(msg) -> list:
    """The per-step records a decoded message carries: a report itself, a steps message's
    records expanded (:func:`expand`), none for the other kinds."""
    if isinstance(msg, wire.Steps):
        return expand(msg)
    return [msg] if isinstance(msg, wire.Report) else []


class Collector:
    """A ROUTER socket bound on loopback (at ``port`` if given), as an aggregator's, keeping every
    decoded message (``msgs``, as received: a steps message stays one; ``peers``: the routing id
    each came from); :meth:`records` and :meth:`reports` see each step's record, coalesced or not."""

    def __init__(self, port: int | None = None, forward: str | None = None):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if port is None:
            port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        else:
            self.sock.bind(f"tcp://127.0.0.1:{port}")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.msgs: list = []
        self.peers: list[bytes] = []
        # a tee: every frame received is also passed on, unchanged, to the aggregator at ``forward``
        self.out = None
        if forward is not None:
            self.out = self.ctx.socket(zmq.DEALER)
            self.out.setsockopt(zmq.LINGER, 2000)
            self.out.connect(forward)

    def pump(self, timeout_s: float = 0.1) -> None:
        if self.sock.poll(int(timeout_s * 1000)):
            while self.sock.poll(0):
                peer, frame = self.sock.recv_multipart()
                self.msgs.append(wire.decode(frame))
                self.peers.append(peer)
                if self.out is not None:
                    self.out.send(frame)

    def records(self, job: str | None = None, rank: int | None = None) -> list[wire.Report]:
        """Every step's record received, in arrival order (reports, and steps expanded)."""
        return [r for m in self.msgs if job in (None, m.header.job) and rank in (None, m.header.rank) for r in records(m)]

    def reports(self, job: str | None = None, rank: int | None = None) -> dict[int, wire.Report]:
        return {r.step: r for r in self.records(job, rank)}

    def of(self, kind) -> list:
        """The messages of one type received (``wire.Steps``, ``wire.Heartbeat``, ...), in order."""
        return [m for m in self.msgs if isinstance(m, kind)]

    def drain(self, monitor, timeout_s: float = 30.0) -> None:
        """Wait until ``monitor``'s sender has connected and handed every report to ZeroMQ: close()
        flushes only what ZeroMQ takes at once, and a few steps on a loaded machine can end before
        the handshake (a test then closed with nothing sent)."""
        self.wait(lambda: monitor.sender.connected and monitor.sender.pending == 0, timeout_s,
                  what="the agent connected and its reports handed over")

    def wait(self, predicate, timeout_s: float = 30.0, what: str = "messages"):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got = predicate()
            if got:
                return got
            self.pump(0.1)
        pytest.fail(f"timed out after {timeout_s}s waiting for {what}; have {len(self.msgs)} messages")

    def wait_steps(self, n: int, **kw) -> dict[int, wire.Report]:
        return self.wait(lambda: (r := self.reports(**kw)) and all(s in r for s in range(n)) and r,
                         what=f"reports of steps 0..{n - 1} {kw}")

    def schema(self, digest: str) -> wire.Schema:
        found = [m for m in self.msgs if isinstance(m, wire.Schema) and m.hash == digest]
        assert found, f"no schema {digest} received"
        return found[-1]

    def close(self) -> None:
        self.sock.close(0)
        if self.out is not None:
            self.out.close()
        self.ctx.term()


@pytest.fixture
def collector():
    """A :class:`Collector` on a random loopback port."""
    c = Collector()
    yield c
    c.close()


class Receiving:
    """A ROUTER socket read as a PULL socket was: :meth:`recv` gives each frame without the
    routing id of the agent that sent it."""

    def __init__(self, sock):
        self.sock = sock

    def recv(self, flags: int = 0) -> bytes:
        return self.sock.recv_multipart(flags)[-1]

    def __getattr__(self, name):
        return getattr(self.sock, name)


@pytest.fixture
def pull():
    """A real ZeroMQ ROUTER socket on loopback, as an aggregator's: ``(socket, endpoint)`` for an
    agent to report to; ``socket.recv()`` gives each frame without its routing id."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield Receiving(sock), f"tcp://127.0.0.1:{port}"
    sock.close(linger=0)
    ctx.term()


@pytest.fixture
def aggregator(tmp_path):
    """A real aggregator process (round grace 3 s) on loopback; stopped after the test."""
    agg = start_aggregator(tmp_path, "--round-grace-s", "3", "--publish-interval-s", "0.05")
    yield agg
    agg.stop()


def loopback(**settings):
    """An aggregator's settings (:func:`gradwatch.aggregator.load`) for one in this process: ZeroMQ
    and HTTP on free loopback ports, a snapshot every 0.05 s, no events file, no Grafana;
    ``settings`` change any of them."""
    from gradwatch.aggregator import load

    base = dict(listen="tcp://127.0.0.1:0", metrics_host="127.0.0.1", metrics_port=0, publish_interval_s=0.05,
                events_path="", grafana_url="")
    return load(**{**base, **settings})


@pytest.fixture
def local_aggregator():
    """``local_aggregator(**settings)``: a real aggregator in this process (its intake thread,
    writer thread, checks and HTTP server) on loopback (:func:`loopback` ``(**settings)``),
    started; every one started is stopped after the test."""
    from gradwatch.aggregator import Aggregator

    started = []

    def start(**settings):
        started.append(Aggregator(loopback(**settings)).start())
        return started[-1]

    yield start
    for agg in reversed(started):
        agg.stop()


@pytest.fixture
def push():
    """``push(endpoint)``: a ZeroMQ DEALER socket connected to ``endpoint``, as an agent's (the
    messages sent on one socket arrive in order); all closed after the test."""
    ctx = zmq.Context()

    def make(endpoint: str):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 2000)
        s.connect(endpoint)
        return s

    yield make
    ctx.destroy(linger=2000)
