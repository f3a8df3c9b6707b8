"""Fake jobs: ranks reduced to the wire messages their agents send (no torch), and an aggregator's
state in this process to send them to.

A :class:`FakeJob` keeps what every rank's headers carry (job id, world size, boot id, sequence
number, the sender's clock, job key, place on a device mesh) and builds real :mod:`gradwatch.wire`
messages from it: schemas, reports (probed or not), ``steps`` batches, heartbeats, goodbyes. Each
message is handed to ``send``: :meth:`InProcess.send` (a real :class:`State` and checks
:class:`Runner` on a fake clock, through ``wire.encode`` and ``wire.decode`` as the aggregator's
writer gets them), a ZeroMQ socket (:func:`to_socket`), or a list (:func:`kept`).

The models (:class:`Model`: a schema's parameters and activation slots) are the tables the tests
share; a test that needs another shape builds its own :class:`Model`.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from gradwatch import columns, wire


@dataclass(frozen=True)
class Model:
    """What a schema declares of a model: ``params`` ``(name, shape, dtype)`` and ``slots``
    ``(module, output, module type, dtype)``, both in the agent's order."""

    params: tuple
    slots: tuple

    @property
    def digest(self) -> str:
        """The schema hash the model's reports name."""
        return wire.schema_hash(self.params, self.slots)

    @property
    def layers(self) -> tuple[str, ...]:
        """The slots' names as exported (``layer`` label): module and output."""
        return tuple(m + o for m, o, _, _ in self.slots)

    @property
    def names(self) -> tuple[str, ...]:
        """The parameters' names."""
        return tuple(p[0] for p in self.params)

    def tile(self, act=(0.0, 1.0, -1.0, 1.0, 0.1, 0.0), act_grad=(0.5, 0.0), param=(0.3, 2.0, 0.0), fp=None) -> dict:
        """The arrays of a probed report, every slot's and every parameter's row the same:
        ``act``, ``act_grad``, ``param`` one float32 row each (:mod:`gradwatch.columns` order);
        fingerprints ``fp`` (uint64 [params]; default zeros)."""
        n = len(self.params)
        fp = np.zeros(n, np.uint64) if fp is None else np.asarray(fp, np.uint64)
        return dict(probe=True, act=np.tile(np.float32(act), (len(self.slots), 1)),
                    act_grad=np.tile(np.float32(act_grad), (len(self.slots), 1)),
                    param=np.tile(np.float32(param), (n, 1)), fp_grad=fp, fp_weight=fp)

    def random(self, rng: np.random.Generator) -> dict:
        """The arrays of a probed report: random but plausible statistics (counts small whole
        numbers), fingerprints zero."""
        n_slots, n = len(self.slots), len(self.params)
        act = rng.standard_normal((n_slots, len(columns.fields("act")))).astype(np.float32)
        act[:, columns.at("act").nonfinite] = rng.integers(0, 4, n_slots)
        act_grad = np.abs(rng.standard_normal((n_slots, len(columns.fields("act_grad"))))).astype(np.float32)
        act_grad[:, columns.at("act_grad").nonfinite] = rng.integers(0, 3, n_slots)
        param = np.abs(rng.standard_normal((n, len(columns.fields("param"))))).astype(np.float32)
        param[:, columns.at("param").grad_nonfinite] = rng.integers(0, 2, n)
        return dict(probe=True, act=act, act_grad=act_grad, param=param, fp_grad=np.zeros(n, np.uint64),
                    fp_weight=np.zeros(n, np.uint64))


#: an embedding, two linear layers with a ReLU between them, an LSTM's first output
NET = Model(
    params=(("emb.weight", (16, 4), "float32"), ("fc1.weight", (8, 4), "float32"), ("fc1.bias", (8,), "float32"),
            ("fc2.weight", (4, 8), "float32"), ("fc2.bias", (4,), "float32")),
    slots=(("emb", "", "Embedding", "float32"), ("fc1", "", "Linear", "float32"), ("act", "", "ReLU", "float32"),
           ("fc2", "", "Linear", "float32"), ("lstm", "[0]", "LSTM", "float32")),
)
#: an embedding, two linear layers with a ReLU between them and a head, one parameter each but fc1
HEADED = Model(
    params=(("emb.weight", (16, 4), "float32"), ("fc1.weight", (8, 4), "float32"), ("fc1.bias", (8,), "float32"),
            ("fc2.weight", (4, 8), "float32"), ("head.weight", (2, 4), "float32")),
    slots=(("emb", "", "Embedding", "float32"), ("fc1", "", "Linear", "float32"), ("act", "", "ReLU", "float32"),
           ("fc2", "", "Linear", "float32"), ("head", "", "Linear", "float32")),
)
#: two linear layers with a ReLU between them
MLP = Model(
    params=(("fc1.weight", (8, 4), "float32"), ("fc1.bias", (8,), "float32"), ("fc2.weight", (2, 8), "float32")),
    slots=(("fc1", "", "Linear", "float32"), ("act", "", "ReLU", "float32"), ("fc2", "", "Linear", "float32")),
)
#: one linear layer's parameters; its output, a ReLU's and a head's observed
TINY = Model(
    params=(("fc.weight", (4, 4), "float32"), ("fc.bias", (4,), "float32")),
    slots=(("fc", "", "Linear", "float32"), ("act", "", "ReLU", "float32"), ("head", "", "Linear", "float32")),
)


class FakeJob:
    """``world`` ranks of one job, each reduced to its agent's messages.

    Every message gets a fresh header (:meth:`header`): each rank's sequence numbers count from 0
    per boot, in the order messages are built. ``send(message)`` delivers each built message and
    every builder returns it too. ``clock()``: the senders' wall clock in the headers (seconds);
    ``boots``: each rank's boot id (default random, 16 hex digits); ``key``: the job key the ranks
    share (header ``key``). Ranks are ints in ``[0, world)``; a rank's place on a mesh is
    ``coord[rank]`` (default: none).
    """

    def __init__(self, send: Callable, job: str = "j", world: int = 3, model: Model = NET, *, every: int = 5,
                 host: str = "node", clock: Callable[[], float] = time.time, boots=None, key: str = ""):
        self.send, self.job, self.world, self.model = send, job, world, model
        self.every, self.host, self.clock, self.key = every, host, clock, key
        self.boot = list(boots) if boots is not None else [secrets.token_hex(8) for _ in range(world)]
        self.seq = [0] * world
        self.coord: dict[int, tuple] = {}
        self.digest = {r: model.digest for r in range(world)}  # the schema each rank's reports name

    def ranks(self, ranks=None) -> list[int]:
        return list(range(self.world)) if ranks is None else [ranks] if isinstance(ranks, int) else list(ranks)

    def header(self, rank: int, t: Optional[float] = None) -> wire.Header:
        """Rank ``rank``'s next header, sent at ``t`` (default: ``clock()``)."""
        h = wire.Header(self.job, rank, self.world, self.boot[rank], self.seq[rank], self.clock() if t is None else t,
                        self.key, coord=self.coord.get(rank, ()))
        self.seq[rank] += 1
        return h

    def lose(self, rank: int, n: int = 1) -> None:
        """``n`` messages of ``rank`` lost in flight: its next header's sequence number skips them."""
        self.seq[rank] += n

    def schema(self, ranks=None, *, model: Optional[Model] = None, every: Optional[int] = None, t=None,
               local_rank: Optional[Callable[[int], int]] = None, host: Optional[str] = None, **kw) -> list[wire.Schema]:
        """Each of ``ranks`` (default all) sends its schema of ``model`` (default the job's);
        ``local_rank(rank)`` its local rank (default: the rank); ``kw``: more
        :class:`wire.Schema` fields (``mesh``, ``shard``). Its reports name this schema."""
        m = model or self.model
        out = []
        for r in self.ranks(ranks):
            msg = wire.Schema(self.header(r, t), host if host is not None else self.host,
                              r if local_rank is None else local_rank(r), self.every if every is None else every,
                              m.params, m.slots, **kw)
            self.digest[r] = msg.hash
            self.send(msg)
            out.append(msg)
        return out

    def record(self, rank: int, step: int, grad_norm: float = 1.0, nonfinite: int = 0, *, step_time: float = 0.05,
               arrays: Optional[dict] = None, t=None, **fields) -> wire.Report:
        """Rank ``rank``'s report of ``step``, built (header taken) but not sent; ``arrays``: a
        probe's arrays (:meth:`Model.tile`, :meth:`Model.random`; with ``probe=True``), ``fields``:
        more :class:`wire.Report` fields."""
        return wire.Report(self.header(rank, t), self.digest[rank], step, step_time, grad_norm, nonfinite,
                           **(arrays or {}), **fields)

    def report(self, rank: int, step: int, grad_norm: float = 1.0, nonfinite: int = 0, **kw) -> wire.Report:
        """Rank ``rank`` sends its report of ``step`` (:meth:`record`)."""
        msg = self.record(rank, step, grad_norm, nonfinite, **kw)
        self.send(msg)
        return msg

    def steps(self, rank: int, records: list) -> wire.Steps:
        """Rank ``rank`` sends ``records`` (reports of consecutive steps) as one ``steps`` message."""
        msg = wire.Steps.of(records)
        self.send(msg)
        return msg

    def heartbeat(self, rank: int, step: int = -1, *, sent: Optional[int] = None, t=None, **fields) -> wire.Heartbeat:
        """Rank ``rank`` sends a heartbeat at ``step``; ``sent`` defaults to the messages it has
        sent, this one included; ``fields``: more :class:`wire.Heartbeat` fields."""
        h = self.header(rank, t)
        msg = wire.Heartbeat(h, step, self.seq[rank] if sent is None else sent, fields.pop("drops", 0),
                             fields.pop("errors", 0), **fields)
        self.send(msg)
        return msg

    def goodbye(self, rank: int, reason: str = "exit", step: int = -1, **fields) -> wire.Heartbeat:
        """Rank ``rank``'s agent closes (``reason``: ``exit``, ``finished``, ...)."""
        return self.heartbeat(rank, step, closing=True, reason=reason, **fields)

    def restart(self, rank: int, boot: Optional[str] = None) -> None:
        """A new agent instance on ``rank``: a new boot id (default random), sequence numbers from
        0, the model's schema hash until it sends a schema."""
        self.boot[rank] = boot or secrets.token_hex(8)
        self.seq[rank] = 0
        self.digest[rank] = self.model.digest


class Rank:
    """One rank of a job, reduced to its agent's messages: a :class:`FakeJob` of its own
    (``job``, here as ``fake``) with the rank bound. ``seq``, ``boot``, ``digest`` (the schema its
    reports name) and ``coord`` are the rank's; ``world`` its claim of the job's size."""

    def __init__(self, send: Callable, job: str, rank: int, world: int, model: Model = NET, **kw):
        self.fake = FakeJob(send, job, world, model, **kw)
        self.job, self.rank = job, rank

    seq = property(lambda self: self.fake.seq[self.rank], lambda self, n: self.fake.seq.__setitem__(self.rank, n))
    boot = property(lambda self: self.fake.boot[self.rank], lambda self, b: self.fake.boot.__setitem__(self.rank, b))
    digest = property(lambda self: self.fake.digest[self.rank],
                      lambda self, d: self.fake.digest.__setitem__(self.rank, d))
    coord = property(lambda self: self.fake.coord.get(self.rank, ()),
                     lambda self, c: self.fake.coord.__setitem__(self.rank, c))
    world = property(lambda self: self.fake.world, lambda self, n: setattr(self.fake, "world", n))
    model = property(lambda self: self.fake.model)

    def header(self, t: Optional[float] = None) -> wire.Header:
        return self.fake.header(self.rank, t)

    def schema(self, **kw) -> wire.Schema:
        return self.fake.schema(self.rank, **kw)[0]

    def record(self, step: int, *args, **kw) -> wire.Report:
        return self.fake.record(self.rank, step, *args, **kw)

    def report(self, step: int, *args, **kw) -> wire.Report:
        return self.fake.report(self.rank, step, *args, **kw)

    def heartbeat(self, step: int = -1, **kw) -> wire.Heartbeat:
        return self.fake.heartbeat(self.rank, step, **kw)

    def goodbye(self, reason: str = "exit", step: int = -1, **kw) -> wire.Heartbeat:
        return self.fake.goodbye(self.rank, reason, step, **kw)

    def restart(self, boot: Optional[str] = None, model: Optional[Model] = None) -> None:
        """A new agent instance (:meth:`FakeJob.restart`), of ``model`` if given."""
        if model is not None:
            self.fake.model = model
        self.fake.restart(self.rank, boot)


def to_socket(sock) -> Callable:
    """``send`` for :class:`FakeJob`: each message encoded onto ``sock`` (ZeroMQ keeps one
    socket's order)."""
    return lambda msg: sock.send(wire.encode(msg))


def kept(into: list) -> Callable:
    """``send`` for :class:`FakeJob`: each message appended to ``into``."""
    return into.append


class InProcess:
    """A real aggregator :class:`State` and checks :class:`Runner` in this process, on a fake
    clock: the writer thread's work without sockets or threads.

    ``checks``: the checks to run (names); ``thresholds``: their settings (``Thresholds``
    fields); ``t0``: the clock's start (s); ``wall``: the runner's wall clock (default the fake
    clock); ``roundtrip``: messages go through ``wire.encode``/``wire.decode`` (else applied as
    built); ``state``: more :class:`State` arguments (``grace_s``, ...). Every job is proven as
    it comes (``proof_steps`` 0: the checks judge its first message) unless ``state`` says
    otherwise: what a check concludes is tested here, admission in tests/test_admission.py.
    """

    def __init__(self, checks=(), thresholds: Optional[dict] = None, *, t0: float = 100.0,
                 wall: Optional[Callable[[], float]] = None, roundtrip: bool = True, **state):
        from gradwatch.aggregator.checks import Thresholds
        from gradwatch.aggregator.runner import Runner
        from gradwatch.aggregator.state import State

        self.now = t0
        self.roundtrip = roundtrip
        self.runner = Runner(list(checks), Thresholds(**(thresholds or {})), wall=wall or self.clock)
        self.state = State(clock=self.clock, runner=self.runner, **{"proof_steps": 0, **state})

    def clock(self) -> float:
        return self.now

    def send(self, msg) -> None:
        st = self.state
        st.apply(wire.decode(wire.encode(msg), schema_sizes=st.schema_sizes) if self.roundtrip else msg)

    def tick(self, dt: float = 0.0) -> None:
        """The clock moves ``dt`` seconds, then the state's periodic work runs."""
        self.now += dt
        self.state.tick()

    def events(self, check: Optional[str] = None) -> list:
        """The runner's events (of ``check``), in order; fails if a check raised (it would only be
        counted)."""
        assert not self.runner.errors, self.runner.errors
        return [e for e in self.runner.events if check in (None, e.check)]

    def active(self, job: str, check: str) -> list:
        """The active findings of ``check`` on ``job``, by rank and layer."""
        return sorted(self.runner.active.get((job, check), {}).values(), key=lambda f: (str(f.rank), str(f.layer)))

    def status(self, job: str, check: str):
        """``check``'s latest :class:`Outcome` on ``job`` (None: none yet)."""
        return self.runner.status.get((job, check))


def train(job: FakeJob, agg: InProcess, steps, ranks=None, dt: float = 0.5) -> None:
    """Each of ``ranks`` (default all) of ``job`` reports every step of ``steps`` and heartbeats;
    then ``agg``'s clock moves ``dt`` and its state ticks, once a step."""
    for s in steps:
        for r in job.ranks(ranks):
            job.report(r, s)
            job.heartbeat(r, s)
        agg.tick(dt)


class LocalJob(FakeJob):
    """A :class:`FakeJob` reporting to an aggregator of its own in this process (``agg``, an
    :class:`InProcess`; its ``state``, ``runner``, clock ``now`` and :meth:`tick` are the job's
    too). ``checks``, ``thresholds``, ``t0``, ``wall``, ``roundtrip`` and ``state`` (more
    :class:`State` arguments) go to :class:`InProcess`; ``job``: :class:`FakeJob`'s arguments."""

    def __init__(self, checks=(), thresholds: Optional[dict] = None, *, t0: float = 100.0,
                 wall: Optional[Callable[[], float]] = None, roundtrip: bool = True, state: Optional[dict] = None, **job):
        self.agg = InProcess(checks, thresholds, t0=t0, wall=wall, roundtrip=roundtrip, **(state or {}))
        super().__init__(self.agg.send, **job)

    @property
    def state(self):
        return self.agg.state

    @property
    def runner(self):
        return self.agg.runner

    @property
    def now(self) -> float:
        return self.agg.now

    @now.setter
    def now(self, t: float) -> None:
        self.agg.now = t

    def tick(self, dt: float = 0.0) -> None:
        self.agg.tick(dt)
