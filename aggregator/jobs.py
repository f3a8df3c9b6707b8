"""The aggregator's data model: one :class:`JobState` per job, one :class:`RankState` per rank,
and the :class:`Registry` of every job the state holds.

The writer thread alone changes these (:class:`~.state.State` and its rooms); checks read a job
through its read-only view, scrapes through a snapshot (:mod:`.snapshot`).
"""

from __future__ import annotations

import collections
import itertools
import math
import operator
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from gradwatch import wire

from .reconcile import LayoutCache, RoundResult
from .steps import StepTable

@dataclass
class RankState:
    rank: int
    boot: str = ""
    host: str = ""
    local_rank: int = 0
    schema: str = ""
    placed: tuple = ("", (), "")  # the latest (schema hash, mesh coordinates, its place's key: schemas.SchemaStore.place)
    last_seq: int = -1
    received: int = 0
    lost: int = 0
    restarts: int = 0
    last_seen: float = 0.0  # aggregator clock, seconds
    step: int = -1
    step_time: float = math.nan
    grad_norm: float = math.nan
    grad_nonfinite: int = 0
    steps: int = 0
    probes: int = 0
    nonfinite_steps: int = 0  # steps whose gradient held NaN/Inf (a counter)
    agent_drops: int = 0
    agent_errors: int = 0
    local_grad_norm: float = math.nan
    compute_time: float = math.nan
    loss: float = math.nan
    loss_scale: float = math.nan
    skipped_steps: int = 0  # steps the AMP loss scaler skipped: labelled, not alerted
    # the agent's own cost as its latest records say (wire sender fields): every message, not
    # only probed steps, carries them (a probe interval past the run's length is never probed)
    agent_cost: float = math.nan
    probe_interval: int = 0
    over_budget: bool = False
    closing: bool = False  # the agent said goodbye: the rank finished, it is not silent
    in_step_s: float = 0.0  # from the latest heartbeat
    waiting: bool = False  # from the latest heartbeat: waiting on peers in all-reduce
    heartbeat_at: float = 0.0  # aggregator clock of the latest heartbeat
    run_s: float = math.nan  # from the latest heartbeat: training thread's running + runnable seconds
    beat_time: float = math.nan  # the latest heartbeat's send time, the agent's clock
    runnable: float = math.nan  # share of the last heartbeat interval the training thread ran or could
    last_report_at: float = 0.0  # aggregator clock of the latest report
    # the agent's own counters restart with it; these carry earlier boots' totals so the exported
    # counters never decrease
    drops_base: int = 0
    errors_base: int = 0
    boot_step: int = -1  # the rank's latest step under its previous boot (-1: none)
    close_reason: str = ""  # why its agent said goodbye (wire.CLOSE_REASONS)
    prev_boot: str = ""  # the boot before ``boot``
    first_report_at: float = math.nan  # aggregator clock of the rank's first report (its step rate)
    proof: int = 0  # messages that advanced its step while its job was not proven (admission.Admission.prove)
    halt_on: tuple = ()  # the checks its latest schema says may halt it (wire.Schema.halt_on)
    took_over_at: float = -math.inf  # aggregator clock when its current boot replaced another one
    disputed_at: float = -math.inf  # aggregator clock of the latest frame of another boot it rejected (boot_conflict)
    nonfinite_skipped: int = 0  # steps its agent's breaker skipped (on_nonfinite="skip"): a counter

    def beat(self, hb: wire.Heartbeat, now: float) -> None:
        """Take heartbeat ``hb`` heard at ``now`` (aggregator clock): the agent's counters, its
        goodbye, where its training thread is, and the share of the interval since its previous
        heartbeat that thread ran or could (on the agent's own clock, so delays in transit do not
        skew it; NaN when either reading is unknown)."""
        self.agent_drops, self.agent_errors = hb.drops, hb.errors
        self.closing, self.in_step_s, self.waiting, self.heartbeat_at = hb.closing, hb.in_step_s, hb.waiting, now
        dt = hb.header.time - self.beat_time
        self.runnable = (hb.run_s - self.run_s) / dt if dt > 0 else math.nan
        self.run_s, self.beat_time = hb.run_s, hb.header.time
        self.close_reason = hb.reason if hb.closing else ""


def read_columns(objs: list, names: tuple) -> np.ndarray:
    """float64 [len(names), len(objs)]: each of ``names`` read from every object, in one pass over
    them (16,384 RankState objects lie far apart in a large heap: a pass per field cost ~10 ms
    each). Read-only."""
    n, k = len(objs), len(names)
    flat = itertools.chain.from_iterable(map(operator.attrgetter(*names), objs))
    cols = np.fromiter(flat, np.float64, n * k).reshape(n, k).T
    cols.flags.writeable = False
    return cols


@dataclass(frozen=True)
class RankColumns:
    """A job's ranks' fields as arrays [n_ranks], in rank order (:meth:`JobState.columns`).

    ``step``, ``steps`` float64 (exact below 2**53); ``last_seen``, ``last_report_at`` aggregator
    clock, seconds, float64; ``closing`` bool. Read-only: every tick's checks share one."""

    FIELDS = ("step", "steps", "last_seen", "last_report_at", "closing")

    step: np.ndarray
    steps: np.ndarray
    last_seen: np.ndarray
    last_report_at: np.ndarray
    closing: np.ndarray

    @classmethod
    def of(cls, ranks: list) -> "RankColumns":
        cols = read_columns(ranks, cls.FIELDS)
        return cls(*cols[:-1], cols[-1] != 0)


#: a job's checks' events (released steps, reconciled rounds) held while it is unproven: the first
#: ones are kept, so a fault in a job's first steps is found once it is proven (a real job proves
#: itself within a few steps; an invented one holds at most these)
HELD_EVENTS = 64


#: goodbyes (wire.CLOSE_REASONS) of an agent whose process ended: training finished, the
#: interpreter exited, an exception left the monitored loop, the agent halted training at the
#: aggregator's word (gradwatch.Halt), or the script closed its monitor (the
#: end of README's snippet: every rank of a job closing its agent is that job ending; an agent
#: switched off after errors, ``disabled``, is not)
ENDED = frozenset({"finished", "exit", "other", "closed", "halted"})

#: epochs of :attr:`JobState.epoch`: one count for every job and incarnation, so no two states share one
_EPOCHS = itertools.count(1)


def new_epoch() -> int:
    """A number no :attr:`JobState.epoch` had before."""
    return next(_EPOCHS)


@dataclass
class JobState:
    job: str
    world: int
    schemas: dict[str, wire.Schema] = field(default_factory=dict)
    ranks: dict[int, RankState] = field(default_factory=dict)
    rounds: dict = field(default_factory=dict)  # step -> its open round (.rounds.Round)
    last_round: Optional[RoundResult] = None
    rounds_complete: int = 0
    rounds_incomplete: int = 0
    #: rounds closed without ranks whose probe interval skips their step (a rank whose budget chose
    #: 64 probes steps its peers at 128 do not): no report is missing, so not incomplete
    rounds_partial: int = 0
    restarts: int = 0  # times the job came back from an earlier step (a checkpoint) under its id
    retired: frozenset = frozenset()  # boot ids of the previous incarnation: late messages dropped
    retired_at: float = 0.0  # aggregator clock of the restart that retired them
    name: str = ""  # the job id its ranks send ('' : same as ``job``, the label)
    key: str = ""  # the identity digest its ranks send (wire.Header.key)
    admitted: bool = False  # holds one of max_jobs slots: it sent a schema and a report using it
    #: its ranks showed steps (admission.Admission.prove): exported and judged from then on; until
    #: then quiet, its checks' events held (:attr:`held`), and the first evicted for a slot
    proven: bool = False
    proof_ranks: int = 0  # ranks that advanced their step in proof_steps messages (counted until proven)
    progress: int = 0  # such messages, at most proof_steps per rank: how far its proof got
    #: who created it (admission's per-source quotas): the CURVE key, else the peer's address; None: not known
    source: Optional[str] = None
    #: the checks' step and round events while unproven, in order, judged once it is proven
    #: (:meth:`.rounds.Rounds.prove`), at most :data:`HELD_EVENTS`; None: none held
    held: Optional[collections.deque] = None
    held_dropped: int = 0  # events not held past HELD_EVENTS
    touched: float = 0.0  # aggregator clock of its latest accepted message (pending eviction)
    peer_key: Optional[str] = None  # with CURVE on, the client public key that created the job
    votes: dict = field(default_factory=dict)  # rank -> (boot, world, when): restart votes
    series_dropped: int = 0  # per-layer series of the latest round not exported (max_series_per_job)
    max_step: int = -1  # latest step any of its ranks reported
    last_report_at: float = 0.0  # aggregator clock of its latest report
    pending_bytes: int = 0  # array bytes of the reports its open rounds hold
    ended: bool = False  # every rank said goodbye as its process ended, grace_s ago (state.State.tick)
    exported_series: int = 0  # per-layer series its last_round exports
    table: Optional[StepTable] = None  # every rank's records of the steps not yet judged
    #: aggregator clock when the intake last dropped a frame of this job (overload): silence since
    #: then may be the aggregator's own, not the ranks'
    overloaded_at: float = -math.inf
    #: counters of ranks forgotten after rank_ttl_s, so the job's totals never decrease
    forgotten: collections.Counter = field(default_factory=collections.Counter)
    #: the layouts of its rounds (names, columns, groups), by their schemas: every round reuses one
    layouts: LayoutCache = field(default_factory=LayoutCache)
    #: while a round of it is reconciled in slices (State.closing): the checks' events since, in
    #: order, rounds among them (:class:`Closing`); they run once the rounds before them are done
    deferred: Optional[collections.deque] = None
    #: schema key -> its :func:`schema_cost` (:data:`PLACED_COST` for a placed copy), and their sum
    #: (kept beside them, not summed: every new schema or placed copy asks it of every job)
    schema_costs: dict = field(default_factory=dict)
    schema_bytes: int = 0
    #: a new number whenever a rank comes, goes, restarts or takes another place (schema key):
    #: what checks derive per rank from those (peer groups, boots) is kept until it changes
    epoch: int = field(default_factory=new_epoch)
    _order: Optional[list] = field(default=None, repr=False)  # ranks by rank, until one comes or goes
    _columns: Optional["RankColumns"] = field(default=None, repr=False)  # this tick's (columns())

    def hear(self, h: wire.Header, placed: Optional[tuple], now: float) -> RankState:
        """The rank ``h`` speaks for, made on first contact, after a message from it heard at
        ``now`` (aggregator clock): its place (``(schema hash, mesh coordinates, place key)``, when
        known), its boot (a new one is the agent restarted: its sequence and counters start over),
        the messages lost in between by their sequence numbers, and when it was heard."""
        self.touched = now
        r = self.ranks.get(h.rank)
        if r is None:
            r = self.ranks[h.rank] = RankState(h.rank)
            self._order, self.epoch = None, new_epoch()
        if placed is not None:
            r.placed = placed
        if h.boot != r.boot:
            if r.boot:  # the agent restarted: its sequence and counters start over
                r.restarts += 1
                r.took_over_at = now
                r.closing, r.close_reason = False, ""  # the new agent has not said goodbye
                r.prev_boot = r.boot
                r.boot_step = r.step
                r.drops_base += r.agent_drops
                r.errors_base += r.agent_errors
                r.agent_drops = r.agent_errors = 0
                r.last_seq = -1
            else:  # first contact (or the aggregator restarted): what came before is not a loss
                r.last_seq = h.seq - 1
            r.boot, self.epoch = h.boot, new_epoch()
        if h.seq > r.last_seq + 1:
            r.lost += h.seq - r.last_seq - 1
        r.last_seq = max(r.last_seq, h.seq)
        r.received += 1
        r.last_seen = now
        return r

    def use_schema(self, r: RankState, key: Optional[str]) -> None:
        """Rank ``r`` speaks under schema ``key`` (its place's) from now on."""
        if r.schema != key:
            r.schema, self.epoch = key, new_epoch()

    def forget_rank(self, r: RankState) -> None:
        """Forget rank ``r`` (silent past ``rank_ttl_s``), its counters kept in :attr:`forgotten`."""
        self.forgotten.update(rank_counters(r))
        del self.ranks[r.rank]
        self._order = self._columns = None
        self.epoch = new_epoch()

    def refresh_columns(self) -> None:
        """The ranks' :meth:`columns` are read afresh at the next ask (a tick's checks judge the
        ranks as they are then)."""
        self._columns = None

    def hold_schema(self, key: str, s: wire.Schema, cost: int) -> None:
        """Keep ``s`` under ``key``, counted as ``cost`` bytes."""
        self.schemas[key], self.schema_costs[key] = s, cost
        self.schema_bytes += cost

    def keep_schemas(self, used: set) -> None:
        """Drop the schemas whose keys are not in ``used``."""
        self.schemas = {k: v for k, v in self.schemas.items() if k in used}
        self.schema_costs = {k: c for k, c in self.schema_costs.items() if k in used}
        self.schema_bytes = sum(self.schema_costs.values())

    def ended_in_overload(self, window: float) -> Optional[float]:
        """The job's latest overload drop (aggregator clock) when the job was ending then: a rank
        said goodbye within ``window`` seconds of it, so the goodbyes of others may be among the
        frames dropped; None otherwise."""
        at = self.overloaded_at
        if at != -math.inf and any(r.closing and abs(r.heartbeat_at - at) <= window for r in self.ranks.values()):
            return at
        return None

    def in_order(self) -> list:
        """The job's :class:`RankState` objects by rank (cached: checks ask every tick, for every rank)."""
        if self._order is None or len(self._order) != len(self.ranks):
            self._order = [r for _, r in sorted(self.ranks.items())]
        return self._order

    def processes_ended(self) -> bool:
        """Every rank said goodbye as its process ended (:data:`ENDED`), not as an agent switched
        off while its training goes on; False without ranks."""
        return bool(self.ranks) and all(r.closing and r.close_reason in ENDED for r in self.ranks.values())

    def columns(self) -> "RankColumns":
        """The ranks' fields the ticks' checks judge, one array each in :meth:`in_order` order, read
        in one pass when a tick first asks (:meth:`State.tick`, and a deferred tick's turn, forget
        them first):
        at 16,384 ranks three checks walking the rank objects took a fifth of the writer's time."""
        if self._columns is None:
            self._columns = RankColumns.of(self.in_order())
        return self._columns


#: the counters a job totals over its ranks (``gradwatch_job_*_total``, named as the
#: :class:`.snapshot.RankView` fields that show them per rank), each the sum of these RankState
#: fields: steps, non-finite steps, reports its agent dropped (over all its boots), messages lost
COUNTERS = {"steps": ("steps",), "nonfinite_steps": ("nonfinite_steps",), "agent_drops": ("drops_base", "agent_drops"),
            "lost": ("lost",)}


def rank_counters(r: RankState) -> dict[str, int]:
    """The rank's :data:`COUNTERS`."""
    return {k: sum(getattr(r, f) for f in fields) for k, fields in COUNTERS.items()}


#: the RankState fields :data:`COUNTERS` read, each once
COUNTER_FIELDS = tuple(dict.fromkeys(f for fields in COUNTERS.values() for f in fields))


def counters_of(columns: dict) -> dict[str, int]:
    """:data:`COUNTERS` summed over ranks from ``columns`` (each of :data:`COUNTER_FIELDS` ->
    float64 [ranks]: a snapshot of a 16,384-rank job reads every rank's fields in one pass). In
    float64, as Prometheus holds them anyway: exact while each total stays below 2**53 (a job of
    16,384 ranks x 10**7 steps is 1.6e11); past that, within float64's rounding."""
    return {k: int(round(sum(float(columns[f].sum()) for f in fields))) for k, fields in COUNTERS.items()}


def identity(h: wire.Header) -> tuple[str, str]:
    """What a job is: its id and the key its ranks share (wire ``Header.key``); two jobs under one
    id stay two jobs. (With CURVE on, the authenticated client key belongs in the same tuple.)"""
    return (h.job, h.key)


class Registry:
    """Every job the state holds, by label, and the identities that name them. A job comes in
    through :meth:`add` (:class:`~.admission.Admission` makes it), goes through :meth:`drop` or is
    replaced by a new incarnation through :meth:`replace`; the checks forget it then. The writer
    thread's, as everything in the state.

    Args:
        runner: the checks' runner, told when a job goes (``forget``); None: no checks.

    Attributes:
        jobs: label -> :class:`JobState` (``State.jobs``).
        labels: identity ``(job id, key)`` -> label.
        version: bumped on every change a snapshot would show; the publisher compares it.
        slots: bumped whenever a job takes or leaves a slot (:attr:`admitted` changes).
        evicted: pending jobs evicted to make room for another; ``unproven_evicted``: jobs holding
            a slot, not proven, evicted (:meth:`evict`).
    """

    def __init__(self, runner=None):
        self.runner = runner
        self.jobs: dict[str, JobState] = {}
        self.labels: dict[tuple[str, str], str] = {}
        self.version = 0
        self.slots = 0
        self.evicted = 0
        self.unproven_evicted = 0

    def find(self, ident: tuple[str, str]) -> Optional[JobState]:
        """The job an identity ``(job id, key)`` names, or None."""
        label = self.labels.get(ident)
        return self.jobs.get(label) if label is not None else None

    def of(self, h: wire.Header) -> Optional[JobState]:
        """The job a header names (:func:`identity`), or None."""
        return self.find(identity(h))

    def add(self, ident: tuple[str, str], job: JobState) -> JobState:
        """Hold ``job`` under its label, named by ``ident``."""
        self.labels[ident] = job.job
        self.jobs[job.job] = job
        return job

    def drop(self, job: JobState, why: str = "job forgotten") -> None:
        """Forget ``job`` (its slot, its identity, its checks' state; ``why`` goes with the
        findings the checks resolve)."""
        del self.jobs[job.job]
        self.slots += job.admitted
        self.labels.pop((job.name, job.key), None)
        if self.runner is not None:
            self.runner.forget(job.job, why)
        self.version += 1

    def evict(self, job: JobState, why: str = "evicted: another job needed its room") -> None:
        """Drop ``job`` (not proven, or pending) to make room for another, counted by its stage."""
        self.drop(job, why)
        if job.admitted:
            self.unproven_evicted += 1
        else:
            self.evicted += 1

    def replace(self, old: JobState, new: JobState, why: str) -> JobState:
        """Hold ``new`` in ``old``'s place (a new incarnation under the same label and identity);
        the checks forget the old one."""
        self.jobs[old.job] = new
        if self.runner is not None:
            self.runner.forget(old.job, why)
        self.version += 1
        return new

    def holding(self) -> int:
        """Jobs holding a slot."""
        return sum(j.admitted for j in self.jobs.values())

    def pending(self) -> list:
        """The jobs without a slot."""
        return [j for j in self.jobs.values() if not j.admitted]

    @property
    def admitted(self) -> frozenset:
        """The ``(CURVE key or None, (job id, key))`` identities of the jobs holding a slot, as
        the daemon's intake names the frames it holds (:meth:`.intake.Intake.admit`); changes
        only when :attr:`slots` does."""
        return frozenset((j.peer_key, (j.name, j.key)) for j in self.jobs.values() if j.admitted)

    @property
    def job_keys(self) -> dict[str, str]:
        """``{job label: the CURVE public key that created it}``, for jobs made with CURVE on."""
        return {label: j.peer_key for label, j in self.jobs.items() if j.peer_key is not None}
