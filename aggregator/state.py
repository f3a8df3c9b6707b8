"""Aggregator state per job, rank and probed step. One writer: the receive loop's thread.

Every decoded message goes through :meth:`State.apply`; time passes through :meth:`State.tick`.
Nothing else mutates state. Scrapes never read it directly: the writer publishes an immutable
:class:`~.reconcile.Snapshot` (see :meth:`State.snapshot`).

A probed step's *round* collects one report per rank; it is complete when every rank of the world
has reported, or closed incomplete ``round_grace_s`` after its first report (or when more than
``max_pending_rounds`` wait). Either way it is reconciled (:mod:`.reconcile`).

Hardening (issue 9: no foreign or malformed bytes reset, hide or flood a job):

* **Identity.** A job is its id *and* the ``key`` its ranks share (``wire.Header.key``: a digest of
  torchrun's run id, master address and port and world size, or a configured key), so two jobs
  under one id (torchrun's default ``none``) stay two jobs. Labels stay ``job_id``: the first
  live job under an id is labelled with the id, a later one with ``id~`` and the first 4 (8, 16
  on a clash) hex chars of its key, unless every rank of the job holding the id said goodbye as
  its process ended (:data:`ENDED`; with CURVE, from the same key): a relaunch takes the id
  over; ``State.jobs`` is keyed by that label. (With CURVE on, the
  authenticated client key belongs in the same tuple: :meth:`State.identity`.)
* **One boot per live rank.** A message for a rank under another boot id than the one it speaks
  under is rejected (``boot_conflict``) while that agent is alive: heard within
  ``boot_takeover_s`` and without a goodbye. A real restart comes after the old process died
  (silent) or closed its agent (goodbye); a forged frame for a live rank changes nothing.
* **Restart by majority.** A job's state starts over only when at least half of its world's
  ranks vote for it from new boot ids (a report resuming at an earlier step, or a frame of
  another world size; votes agree on the world and expire after ``restart_grace_s``; ranks past
  the job's world have no vote), or when one of its ranks votes and every other rank has been
  silent for ``restart_grace_s``. A lone frame is
  rejected (``world_mismatch``, ``restart_unconfirmed``), and so is a goodbye from a boot the rank
  does not speak under (``foreign_goodbye``). A report or heartbeat whose step runs ahead of the
  rank's latest (or its peers', if ahead) by more than ``max(max_step_jump, 10 x the steps the
  rank's observed rate explains)`` is rejected (``step_jump``). Boots a restart retired are
  rejected (``retired_boot``) for ``restart_grace_s`` only: a dead incarnation falls silent
  within seconds, so boots still speaking after that had their restart forged, and are heard.
* **Slots.** A job takes one of ``max_jobs`` slots only once it sent a schema and a report using
  it; until then it is *pending*, one of at most ``max_pending_jobs``, evicted least recently
  heard first, those without a schema before those with, so invented job ids cannot squat slots
  and a flood of them without schemas cannot push a starting job out; a pending job holds at most
  ``max_pending_ranks`` ranks (``pending_ranks``) and twice as many schemas (its ranks' placed
  copies among them): those of ranks it has no room for are kept for them to use once the job
  has its slot; its step table holds at most ``steps.PENDING_CELLS`` cells.
* **Series.** Module paths longer than ``max_label_len`` are cut, keeping a digest of the whole
  path so that labels stay distinct; a job's latest round exports at most
  ``max_series_per_job`` per-layer series (the first layers in forward order), and all jobs
  together ``max_series_total``, first come first served; the rest are counted in
  ``JobState.series_dropped``. The checks still see every layer.
* **Memory per job.** Its open rounds hold at most ``max_pending_rounds`` rounds and
  ``max_pending_bytes`` of report arrays; beyond either the oldest closes incomplete. An admitted
  job holds at most :data:`SCHEMAS_PER_RANK` schemas per rank of its world plus
  :data:`SCHEMAS_MIN`, placed copies included: at the cap those no rank, open round or waiting
  step uses go at once (else at the once-a-second scan), past it a new one is rejected
  (``schema_limit``).
* **Places on a mesh.** The ranks of one pipeline stage share a schema whatever their other mesh
  coordinates; each message's header says where its rank is (``wire.Header.coord``). A job keeps
  each schema once, by hash, and each rank's place as a placed copy (its lists shared, a mesh with
  the rank's coordinates) under :func:`.shards.place`'s key, which the rank's records are then
  held by. A header whose coordinates are not a point of its schema's mesh is rejected
  (``bad_coord``), and a message naming a placed key as its schema (``unknown_schema``), before
  either changes anything.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import math
import operator
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import msgspec
import numpy as np

from gradwatch import wire
from gradwatch.columns import ARRAYS, STATISTICS

from .reconcile import LayoutCache, RoundResult, group_layers, reconcile, reconcile_in_slices
from .shards import fits, gradless, norms_of, place, sq_kind, unplace
from .steps import COLUMNS as TABLE_COLUMNS
from .steps import MAX_CELLS, PENDING_CELLS, StepTable


def _per(kind: str) -> int:
    return sum(len(s.aggs) for s in STATISTICS if ARRAYS[s.array].exported_per == kind)


#: per-layer series one exported layer (an activation slot) or module (parameters) costs:
#: its statistics x their aggregations (min, median, max) over ranks
SERIES_PER_LAYER = _per("layer")
SERIES_PER_MODULE = _per("module")

@dataclass
class RankState:
    rank: int
    boot: str = ""
    host: str = ""
    local_rank: int = 0
    schema: str = ""
    placed: tuple = ("", (), "")  # the latest (schema hash, mesh coordinates, State._place key)
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
    nonfinite_steps: int = 0  # steps whose gradient held NaN/Inf (counter, case C36)
    agent_drops: int = 0
    agent_errors: int = 0
    local_grad_norm: float = math.nan
    compute_time: float = math.nan
    loss: float = math.nan
    loss_scale: float = math.nan
    skipped_steps: int = 0  # steps the AMP loss scaler skipped (case C10): labelled, not alerted
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


@dataclass
class Round:
    step: int
    opened: float
    reports: dict[int, wire.Report] = field(default_factory=dict)
    nbytes: int = 0  # bytes of the reports' arrays
    #: ranks whose records went past the step without its report (their agent or the aggregator's
    #: intake dropped it, or the rank did not probe it): a rank's messages come in step order, so
    #: the round waits for them no longer
    passed: set = field(default_factory=set)


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


#: schemas an admitted job holds at most, per rank of its world and besides: each rank's placed
#: one and its stage's own in use, and as many again while a new model's schemas arrive
SCHEMAS_PER_RANK, SCHEMAS_MIN = 4, 64

#: bytes a placed copy of a schema is counted as (a struct and a mesh; the lists are the schema's)
PLACED_COST = 256

#: goodbyes (wire.CLOSE_REASONS) of an agent whose process ended: training finished, the
#: interpreter exited, an exception left the monitored loop, or the script closed its monitor (the
#: end of README's snippet: every rank of a job closing its agent is that job ending; an agent
#: switched off after errors, ``disabled``, is not)
ENDED = frozenset({"finished", "exit", "other", "closed"})

#: every reason a message is rejected for (the module docstring says when), the label values of
#: ``gradwatch_messages_rejected_total``, which shows each from the start (0 until the first): the
#: decoder's, the state's, then the daemon's (dropped under overload, refused CURVE handshakes,
#: a failure of the aggregator's own)
REJECT_REASONS = wire.REJECT_REASONS + (
    "world_too_large", "wrong_key", "retired_boot", "boot_conflict", "unknown_schema", "bad_coord",
    "world_mismatch", "restart_unconfirmed", "foreign_goodbye", "step_jump", "too_many_jobs", "pending_ranks",
    "schema_limit", "overload", "unauthenticated", "internal",
)
_REJECT_REASONS = frozenset(REJECT_REASONS)


def schema_cost(s: wire.Schema) -> int:
    """Approximate bytes ``s`` holds as kept, for ``max_schema_bytes``: per parameter ~200 plus
    its name's and dtype's characters and 8 per dim of its shape, per slot ~270 plus its strings'
    characters (CPython 3.11 tuples and str objects; a 100-layer model's schema: ~67 kB counted,
    75 kB measured with tracemalloc)."""
    n = 256 + len(s.host)
    for name, shape, dtype in s.params:
        n += 200 + len(name) + 8 * len(shape) + len(dtype)
    for module, out, kind, dtype in s.slots:
        n += 270 + len(module) + len(out) + len(kind) + len(dtype)
    return n


#: epochs of :attr:`JobState.epoch`: one count for every job and incarnation, so no two states share one
_EPOCHS = itertools.count(1)


@dataclass
class JobState:
    job: str
    world: int
    schemas: dict[str, wire.Schema] = field(default_factory=dict)
    ranks: dict[int, RankState] = field(default_factory=dict)
    rounds: dict[int, Round] = field(default_factory=dict)
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
    touched: float = 0.0  # aggregator clock of its latest accepted message (pending eviction)
    peer_key: Optional[str] = None  # with CURVE on, the client public key that created the job
    votes: dict = field(default_factory=dict)  # rank -> (boot, world, when): restart votes
    series_dropped: int = 0  # per-layer series of the latest round not exported (max_series_per_job)
    max_step: int = -1  # latest step any of its ranks reported
    last_report_at: float = 0.0  # aggregator clock of its latest report
    pending_bytes: int = 0  # array bytes of the reports its open rounds hold
    ended: bool = False  # every rank said goodbye as its process ended, grace_s ago (State._maybe_ended)
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
    epoch: int = field(default_factory=lambda: next(_EPOCHS))
    _order: Optional[list] = field(default=None, repr=False)  # ranks by rank, until one comes or goes
    _columns: Optional["RankColumns"] = field(default=None, repr=False)  # this tick's (columns())

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


#: most rounds :attr:`State.closing` holds; past it the oldest is reconciled to the end at once
MAX_CLOSING = 4


@dataclass(eq=False)
class Closing:
    """A closed round being reconciled: ``work`` (:func:`.reconcile.reconcile_in_slices`, None
    once done) and its ``result`` (None until done, or when its reconciliation failed)."""

    job: JobState
    work: Any = None
    result: Optional[RoundResult] = None
    nbytes: int = 0  # its reports' array bytes, in the job's pending_bytes until it is done


class State:
    """All jobs the aggregator knows. Not thread-safe by design: one writer.

    Args:
        grace_s: seconds a round waits for missing ranks.
        max_pending: rounds held per job.
        rank_ttl_s: seconds after which a silent rank is forgotten.
        clock: monotonic clock, seconds.
        runner: the checks' ``Runner`` (events on_report, on_heartbeat, on_round, on_tick), or None.
        max_jobs, max_world, max_pending_jobs, max_pending_ranks, max_schema_bytes, max_series_per_job,
        max_series_total, max_pending_bytes, max_label_len, max_step_jump, restart_grace_s, boot_takeover_s:
            the bounds of the module docstring; each is an aggregator setting of the same name
            (:class:`~.config.AggregatorConfig`, which documents units and defaults).
        round_slice_ranks: rounds of at least this many reports are reconciled in slices: a
            closed round waits in :attr:`closing` and each :meth:`advance` runs one slice
            (:func:`.reconcile.reconcile_in_slices`), so that the writer handles frames between
            them. Meanwhile the job's checks' events wait (:attr:`JobState.deferred`) and run
            after the round's, in the order they came: the checks see what they would have seen
            had the round been reconciled at once. 0: every round is reconciled when it closes.
        group_depth: the exporter's ``--layer-depth``: a round reconciled in slices is also
            merged for export, in a slice of its own (:attr:`.reconcile.RoundResult.grouped`); a
            smaller round is merged by the first scrape that exports it, which costs less than
            merging every round when probes are frequent. 0: none is.
        rank_view_max: the exporter's ``--rank-series-max``: a snapshot of a job with more ranks
            holds views only of the ranks an active finding names, and columns for the rest
            (:func:`.reconcile.snapshot`). None: views of every rank.
    """

    def __init__(
        self,
        grace_s: float = 10.0,
        max_pending: int = 64,
        rank_ttl_s: float = 600.0,
        clock: Callable[[], float] = None,
        runner=None,
        max_jobs: int = 64,
        max_world: int = 65_536,
        max_pending_jobs: int = 16,
        max_pending_ranks: int = 256,
        max_schema_bytes: int = 1 << 30,
        max_series_per_job: int = 10_000,
        max_series_total: int = 15_000,
        max_pending_bytes: int = 512 << 20,
        max_label_len: int = 200,
        max_step_jump: int = 1000,
        restart_grace_s: float = 30.0,
        boot_takeover_s: float = 3.0,
        round_slice_ranks: int = 0,
        group_depth: int = 0,
        rank_view_max: Optional[int] = None,
    ):
        import time

        self.round_slice_ranks = round_slice_ranks
        self.rank_view_max = rank_view_max  # snapshots of larger jobs: views of named ranks only
        self.group_depth = group_depth  # sliced rounds also merged for export at this depth (RoundResult.grouped)
        #: rounds closed but not reconciled yet (:class:`Closing`), oldest first
        self.closing: collections.deque = collections.deque()

        self.max_jobs = max_jobs  # the PULL socket takes any peer's job id: state stays bounded
        self.max_world = max_world
        self.max_pending_jobs = max_pending_jobs
        self.max_pending_ranks = max_pending_ranks
        self.max_schema_bytes = max_schema_bytes
        self.max_series_per_job = max_series_per_job
        self.max_series_total = max_series_total
        self.max_pending_bytes = max_pending_bytes
        self.max_label_len = max_label_len
        self.max_step_jump = max_step_jump
        self.restart_grace_s = restart_grace_s
        self.boot_takeover_s = boot_takeover_s
        self.labels: dict[tuple[str, str], str] = {}  # identity (job id, key) -> label, State.jobs' key
        self.jobs_evicted = 0  # pending jobs evicted to make room for another
        self.probes_shed = 0  # probe reports the daemon's intake kept as their record alone
        self.grace_s = grace_s
        self.max_pending = max_pending
        self.rank_ttl_s = rank_ttl_s
        self.clock = clock or time.monotonic
        self.runner = runner  # checks.Runner, or None
        self.jobs: dict[str, JobState] = {}
        self.received: collections.Counter = collections.Counter()  # by kind
        self.rejected: collections.Counter = collections.Counter()  # by reason
        self.decode_seconds = 0.0
        self.decode_count = 0
        self.version = 0  # bumped on every change; the publisher compares it
        self.slots = 0  # bumped whenever a job takes or leaves a slot (:attr:`admitted` changes)
        self._ttl_scan = -math.inf  # clock of the latest scan for ranks past rank_ttl_s

    # --- inputs ---------------------------------------------------------------------------------

    def reject(self, reason: str, n: int = 1) -> None:
        """Count ``n`` messages rejected for ``reason``, one of :data:`REJECT_REASONS`.

        Raises:
            ValueError: an undeclared reason (a label value no one iterates).
        """
        if reason not in _REJECT_REASONS:
            raise ValueError(f"undeclared rejection reason {reason!r}")
        self.rejected[reason] += n
        self.version += 1

    def overloaded(self, drops) -> None:
        """The intake dropped frames of these jobs: mark them, so the checks that judge silence know
        the aggregator missed some of what was sent. ``drops``: ``((job id, key), CURVE user id or
        None)`` pairs, the identity the frames' headers claim and their sender's key
        (:attr:`~.daemon.Intake.dropped_jobs`). With CURVE on, a drop marks a job only when its
        sender is the key the job is bound to (:attr:`JobState.peer_key`, the rule of
        :meth:`apply`): another client claiming the job's id cannot mute its silence checks."""
        now = self.clock()
        for ident, peer_key in drops:
            job = self.jobs.get(self.labels.get(ident))
            if job is None or (peer_key is not None and job.peer_key not in (None, peer_key)):
                continue
            job.overloaded_at = now
            self.version += 1

    @staticmethod
    def identity(h: wire.Header) -> tuple[str, str]:
        """What a job is: its id and the key its ranks share. (A CURVE client key goes here.)"""
        return (h.job, h.key)

    @property
    def admitted(self) -> frozenset:
        """The ``(CURVE key or None, (job id, key))`` identities of the jobs holding a slot, as
        the daemon's intake names the frames it holds (:meth:`.daemon.Intake.admit`); changes
        only when :attr:`slots` does."""
        return frozenset((j.peer_key, (j.name, j.key)) for j in self.jobs.values() if j.admitted)

    @property
    def job_keys(self) -> dict[str, str]:
        """``{job label: the CURVE public key that created it}``, for jobs made with CURVE on."""
        return {label: j.peer_key for label, j in self.jobs.items() if j.peer_key is not None}

    def _job(self, h: wire.Header) -> Optional[JobState]:
        label = self.labels.get(self.identity(h))
        return self.jobs.get(label) if label is not None else None

    def known_schema(self, h: wire.Header, digest: str):
        """The job's schema of that hash, if it holds one (wire.decode: resends are not parsed again).
        Never a placed copy (a :func:`.shards.place` key is the aggregator's, not a wire hash)."""
        job = self._job(h)
        return job.schemas.get(digest) if job and "@" not in digest else None

    def schema_sizes(self, h: wire.Header, digest: str):
        job = self._job(h)
        s = job.schemas.get(digest) if job and "@" not in digest else None
        return (len(s.params), len(s.slots)) if s else (None, None)

    def apply(self, msg: wire.Message, peer_key: Optional[str] = None) -> None:
        """Fold one decoded message into state; a message that may not change it is counted in
        ``rejected`` by reason (see the module docstring) and leaves it as it was. ``peer_key``:
        the sender's CURVE public key, with CURVE on; a job is bound to the key that created it,
        others' messages are rejected (``wrong_key``)."""
        h = msg.header
        now = self.clock()
        if h.world > self.max_world:
            self.reject("world_too_large")
            return
        job = self._job(h)
        if peer_key is not None and job is not None and job.peer_key not in (None, peer_key):
            self.reject("wrong_key")  # CURVE on: only the key that created a job writes to it
            return
        if job is not None and h.boot in job.retired:
            if now - job.retired_at <= self.restart_grace_s:
                self.reject("retired_boot")  # a late message of the job's previous incarnation
                return
            # a dead incarnation's messages stop within seconds; boots that still speak after the
            # grace were retired by a restart that did not happen (forged): they are heard again
            job.retired = frozenset()
        if job is None:
            job = self._new_job(h, now, peer_key)
        r = job.ranks.get(h.rank)
        new_boot = r is None or h.boot != r.boot
        if new_boot and r is not None and r.boot and not r.closing and now - r.last_seen < self.boot_takeover_s:
            # a rank speaks under one boot at a time: while its agent is alive (heard within
            # boot_takeover_s, no goodbye) another boot claiming the rank is forged or misrouted,
            # and may neither restart the job nor count as the agent's restart
            self.reject("boot_conflict")
            return
        digest = msg.hash if isinstance(msg, wire.Schema) else msg.schema
        if "@" in digest:
            self.reject("unknown_schema")  # it names a placed copy: the aggregator's key, no wire hash
            return
        same_place = r is not None and r.placed[0] == digest and r.placed[1] == h.coord  # checked before
        held = None if same_place else msg if isinstance(msg, wire.Schema) else job.schemas.get(digest)
        if held is not None and not fits(held.mesh, h.coord):
            self.reject("bad_coord")  # coordinates its schema's mesh does not have: nothing changes
            return
        if h.world != job.world:
            # another world size: a restarted job (elastic), or a forged or misrouted frame
            if not job.ranks:
                job.world = h.world
            elif new_boot and self._vote(job, h, now):
                job, r = self._restart(job, h, now), None
            else:
                self.reject("world_mismatch")
                return
        records = isinstance(msg, (wire.Steps, wire.Report))
        first, step = _steps_of(msg)
        if r is not None and records:
            # the rank's step before its agent restarted (-1 when it did not)
            before = r.step if new_boot else r.boot_step
            if first <= before:
                # a restarted rank resumes from an earlier step (a checkpoint): the whole job did
                # (torchelastic restarts every rank under the same run id) once enough ranks say so.
                # Its state, and the checks' step watermarks, start over rather than ignore every
                # step up to the old one.
                if not self._vote(job, h, now):
                    self.reject("restart_unconfirmed")
                    return
                job, r = self._restart(job, h, now), None
        if isinstance(msg, wire.Heartbeat) and msg.closing and r is not None and new_boot:
            # an agent says goodbye from the boot it spoke under: a new boot's goodbye is forged
            self.reject("foreign_goodbye")
            return
        if step >= 0 and step > self._step_limit(job, r, now):
            self.reject("step_jump")
            return
        if records and not job.admitted and msg.schema in job.schemas:
            # a schema and a step using it: the job takes a slot, if one is free
            if sum(j.admitted for j in self.jobs.values()) >= self.max_jobs:
                self.reject("too_many_jobs")
                return
            job.admitted = True
            self.slots += 1
        if r is None and not job.admitted and len(job.ranks) >= self.max_pending_ranks:
            # a job without a slot holds few ranks (state and series); the others are heard
            # again, each within a heartbeat, once it has one. Their schemas are kept (content-
            # addressed, at most 2 x max_pending_ranks in all): a large job sends every schema
            # before its first report, and resends it only every schema_every_s or more
            if isinstance(msg, wire.Schema) and (msg.hash in job.schemas or len(job.schemas) < 2 * self.max_pending_ranks):
                if msg.hash not in job.schemas:
                    if not self._keep_schema(job, msg):
                        self.reject("schema_limit")
                        return
                    self.version += 1
                self.received["schema"] += 1
                return
            self.reject("pending_ranks")
            return
        if isinstance(msg, wire.Schema) and msg.hash not in job.schemas:
            if not self._keep_schema(job, msg):
                self.reject("schema_limit")
                return
            self.version += 1
        if same_place and r is not None and r.placed[2] in job.schemas:  # (a restart forgot r)
            key = r.placed[2]  # placed as its previous message was (every message of a mesh rank asks)
        else:
            key = self._place(job, digest, h.coord)  # None: a schema the job does not hold (yet)
            if key == "":
                self.reject("schema_limit")  # a placed copy the job has no room for
                return
        if records and h.coord and key != digest:
            # a rank of a mesh: its records by its place, also under a schema not held yet (its
            # steps' norms wait in the table under the key its place will have)
            msg = msgspec.structs.replace(msg, schema=key or place(digest, h.coord))
        job.touched = now
        if r is None:
            r = job.ranks[h.rank] = RankState(h.rank)
            job._order, job.epoch = None, next(_EPOCHS)
        if key is not None:
            r.placed = (digest, h.coord, key)
        if h.boot != r.boot:
            if r.boot:  # the agent restarted: its sequence and counters start over
                r.restarts += 1
                r.closing, r.close_reason = False, ""  # the new agent has not said goodbye
                r.prev_boot = r.boot
                r.boot_step = r.step
                r.drops_base += r.agent_drops
                r.errors_base += r.agent_errors
                r.agent_drops = r.agent_errors = 0
                r.last_seq = -1
            else:  # first contact (or the aggregator restarted): what came before is not a loss
                r.last_seq = h.seq - 1
            r.boot, job.epoch = h.boot, next(_EPOCHS)
        if h.seq > r.last_seq + 1:
            r.lost += h.seq - r.last_seq - 1
        r.last_seq = max(r.last_seq, h.seq)
        r.received += 1
        r.last_seen = now
        self.version += 1

        if isinstance(msg, wire.Schema):
            self.received["schema"] += 1
            if r.schema != key:
                r.schema, job.epoch = key, next(_EPOCHS)
            r.host, r.local_rank = msg.host[: self.max_label_len], msg.local_rank
        elif isinstance(msg, wire.Heartbeat):
            self.received["heartbeat"] += 1
            r.agent_drops, r.agent_errors = msg.drops, msg.errors
            r.closing, r.in_step_s, r.waiting, r.heartbeat_at = msg.closing, msg.in_step_s, msg.waiting, now
            # on the agent's own clock, so delays in transit do not skew it
            dt = h.time - r.beat_time
            r.runnable = (msg.run_s - r.run_s) / dt if dt > 0 else math.nan  # NaN when either is unknown
            r.run_s, r.beat_time = msg.run_s, h.time
            r.close_reason = msg.reason if msg.closing else ""
            if key is not None and r.schema != key:  # the heartbeat names it: its full schema may have come from another rank
                r.schema, job.epoch = key, next(_EPOCHS)
            self._dispatch("on_heartbeat", job, r, msg)
        else:
            self.received["report" if isinstance(msg, wire.Report) else "steps"] += 1
            if key is not None and r.schema != key:
                r.schema, job.epoch = key, next(_EPOCHS)  # its schema came while the job had no room for the rank, or from a peer
            self._records(job, r, msg, now)

    def _new_job(self, h: wire.Header, now: float, peer_key: Optional[str] = None) -> JobState:
        """A pending job for a new identity, evicting, when ``max_pending_jobs`` are held, the
        least recently heard pending job without a schema, or else the least recently heard (a
        job's first frame is its schema: frames of invented ids without one churn among
        themselves; ids sending schemas too must outpace a starting job's ranks, each heard about
        once a second, as before); labelled as the module docstring says. (Ranks heard are no
        measure: a squatter claims as many as it likes, and keeps them with a frame a job.)"""
        pending = [j for j in self.jobs.values() if not j.admitted]
        if len(pending) >= self.max_pending_jobs:
            self._drop(min(pending, key=lambda j: (bool(j.schemas), j.touched)))
            self.jobs_evicted += 1
        label = h.job
        old = self.jobs.get(label)
        if old is not None and old.peer_key in (None, peer_key) and old.processes_ended():
            # every process of the job under that id ended (not an agent switched off while its
            # training goes on): a relaunch under the same id (a new MASTER_PORT, so a new key)
            # takes the id over rather than a suffixed label; with CURVE, only under its key
            self._drop(old, "job finished, its id taken by another")
        for n in (4, 8, 16):
            if label not in self.jobs:
                break
            label = f"{h.job}~{hashlib.blake2b(h.key.encode(), digest_size=8).hexdigest()[:n]}"
        while label in self.jobs:  # the same key prefix under a job id that looks like a label
            label += "~"
        self.labels[self.identity(h)] = label
        job = self.jobs[label] = JobState(label, h.world, name=h.job, key=h.key, touched=now, peer_key=peer_key)
        return job

    def _drop(self, job: JobState, why: str = "job forgotten") -> None:
        del self.jobs[job.job]
        self.slots += job.admitted
        self.labels.pop((job.name, job.key), None)
        if self.runner is not None:
            self.runner.forget(job.job, why)
        self.version += 1

    def _vote(self, job: JobState, h: wire.Header, now: float) -> bool:
        """Record rank ``h.rank``'s vote, from a new boot, for restarting the job with world
        ``h.world``; True when the votes carry it (module docstring). Only the job's own ranks
        (below its world) vote: ranks past it are free to invent, so half a doubled world of them
        would restart a live job without claiming one live rank."""
        if h.rank >= job.world:
            return False
        job.votes[h.rank] = (h.boot, h.world, now)
        for rank, (_, _, when) in list(job.votes.items()):
            if now - when > self.restart_grace_s:
                del job.votes[rank]
        agree = sum(1 for _, w, _ in job.votes.values() if w == h.world)
        if 2 * agree >= job.world:
            return True
        # the old incarnation is gone: every rank still under an old boot (not the boot it voted
        # with) has been silent for restart_grace_s
        return all(
            now - r.last_seen > self.restart_grace_s
            for k, r in job.ranks.items() if k not in job.votes or job.votes[k][0] != r.boot
        )

    def _step_limit(self, job: JobState, r: Optional[RankState], now: float) -> float:
        """Largest plausible step for the rank now: its latest step (or its peers' latest, if
        ahead) plus ``max(max_step_jump, 10 x its observed step rate x seconds since its latest
        report)``; before a rate is known, at most 1,000 steps/s are assumed. Unbounded before
        the job's first step (a new job, or an aggregator that restarted mid-run)."""
        if job.max_step < 0:
            return math.inf
        if r is None or r.steps == 0:
            return job.max_step + max(self.max_step_jump, 1000 * (now - job.last_report_at))
        since = now - r.last_report_at
        if r.steps >= 2 and r.last_report_at > r.first_report_at:
            per_s = 10 * (r.steps - 1) / (r.last_report_at - r.first_report_at)  # 10x its rate
        else:
            per_s = 1000.0
        return max(r.step, job.max_step) + max(self.max_step_jump, per_s * since)

    @staticmethod
    def _prune_schemas(job: JobState, keep: str = "") -> None:
        """Keep only the schemas ``job``'s ranks, open rounds and waiting steps (their norms, NaN
        guards and shard sums name their place's key) use, a placed one's own, and ``keep``."""
        used = {r.schema for r in job.ranks.values()}
        used.update(rep.schema for rnd in job.rounds.values() for rep in rnd.reports.values())
        t = job.table
        if t is not None:
            for per in (t.norms, t.grad_sq, t.guard):
                used.update(e[0] for d in per.values() for e in d.values())
        used.update([unplace(k) for k in used])  # a placed schema's own, which resends name
        used.add(keep)
        job.keep_schemas(used)

    def _room_for_schema(self, job: JobState, cost: int, keep: str = "") -> bool:
        """Whether ``job`` may keep one more schema (its own or a placed copy) of ``cost`` bytes.

        Counts: an admitted job holds fewer than :data:`SCHEMAS_PER_RANK` per rank of its world
        plus :data:`SCHEMAS_MIN`; a pending job, whose world is only what its frames claim, fewer
        than 2 x ``max_pending_ranks`` (kept for its ranks until it is admitted). Bytes: all jobs'
        schemas within ``max_schema_bytes`` (:func:`schema_cost`), pending jobs' within a quarter
        of it, so jobs without a slot cannot crowd out the running ones (the least recently heard
        other pending jobs holding schemas are evicted to make room, as for ``max_pending_jobs``).
        An admitted job over either drops the schemas no one uses first (else the TTL scan does;
        ``keep`` is never dropped). Frames under the job's identity cannot make it hold more."""
        limit = self.max_schema_bytes
        if not job.admitted:
            if len(job.schemas) >= 2 * self.max_pending_ranks:
                return False
            while True:
                pending = [j for j in self.jobs.values() if not j.admitted]
                if sum(j.schema_bytes for j in pending) + cost <= limit // 4:
                    break
                others = [j for j in pending if j is not job and j.schema_bytes]
                if not others:
                    return False
                self._drop(min(others, key=lambda j: j.touched))
                self.jobs_evicted += 1
            return sum(j.schema_bytes for j in self.jobs.values()) + cost <= limit
        cap = SCHEMAS_PER_RANK * job.world + SCHEMAS_MIN
        others = sum(j.schema_bytes for j in self.jobs.values() if j is not job)
        if len(job.schemas) >= cap or others + job.schema_bytes + cost > limit:
            self._prune_schemas(job, keep)  # leaves at most the ~2 per rank in use
        return len(job.schemas) < cap and others + job.schema_bytes + cost <= limit

    def _keep_schema(self, job: JobState, msg: wire.Schema) -> bool:
        """Hold ``msg`` (names cut, :meth:`_short_names`) as the job's schema of its hash, if it
        has room (:meth:`_room_for_schema`). False: not kept."""
        kept = self._short_names(msg)
        cost = schema_cost(kept)
        if not self._room_for_schema(job, cost):
            return False
        job.hold_schema(msg.hash, kept, cost)
        return True

    def _place(self, job: JobState, digest: str, coord: tuple) -> Optional[str]:
        """The key rank records under schema ``digest`` are held by, for a rank at ``coord``
        (:func:`.shards.place`), its placed schema made when first asked (the schema's lists, a mesh
        with the coordinates); ``digest`` itself without a mesh. None when the job does not hold the
        schema, or ``coord`` is not a point of its mesh (:meth:`apply` rejected those before); ``""``
        when a placed copy is to be made and the job has no room for one (:meth:`_room_for_schema`)."""
        s = job.schemas.get(digest)
        if s is None or not fits(s.mesh, coord):
            return None
        if s.mesh is None:
            return digest
        key = place(digest, coord)
        if key not in job.schemas:
            if not self._room_for_schema(job, PLACED_COST, keep=digest):
                return ""
            job.hold_schema(key, msgspec.structs.replace(s, mesh=wire.Mesh(s.mesh.names, s.mesh.sizes, coord), hash=key),
                            PLACED_COST)
        return key

    def _short_names(self, s: wire.Schema) -> wire.Schema:
        """``s`` with label values over ``max_label_len`` characters cut (a layer's module path
        plus output suffix; a parameter's owning module), each cut part keeping 8 hex chars of its
        whole text's BLAKE2b digest so that cut names stay distinct. A parameter keeps its last
        component (``.weight``), which names its owning module (:mod:`.reconcile`)."""
        n = self.max_label_len

        def cut(text: str, room: int) -> str:
            if len(text) <= room:
                return text
            return text[: max(room - 10, 0)] + "~" + hashlib.blake2b(text.encode(), digest_size=4).hexdigest() + "~"

        def slot(m: str, o: str) -> tuple[str, str]:
            o = cut(o, 32)
            return cut(m, n - len(o)), o

        def param(name: str) -> str:
            owner, dot, leaf = name.rpartition(".")
            leaf = cut(leaf, 32)
            return cut(owner, n - len(leaf) - 1) + dot + leaf

        if all(len(p[0]) <= n for p in s.params) and all(len(x[0]) + len(x[1]) <= n for x in s.slots):
            return s
        params = tuple((param(a), b, c) for a, b, c in s.params)
        slots = tuple((*slot(a, b), c, d) for a, b, c, d in s.slots)
        return msgspec.structs.replace(s, params=params, slots=slots, hash=s.hash)

    def _restart(self, job: JobState, h: wire.Header, now: float) -> JobState:
        # the boots that spoke for the old incarnation: a rank whose agent restarted but did not
        # report since (boot_step >= 0) already speaks for the new one
        old = {r.prev_boot if r.boot_step >= 0 else r.boot for r in job.ranks.values()}
        old -= {b for b, _, _ in job.votes.values()} | {h.boot, ""}
        # bounded: a long run of restarts keeps the latest incarnations' boots only
        recent = now - job.retired_at <= self.restart_grace_s and len(job.retired) < 4 * job.world + 64
        retired = job.retired | old if recent else old
        new = JobState(
            job.job, h.world, restarts=job.restarts + 1, retired=frozenset(retired), retired_at=now,
            name=job.name, key=job.key, admitted=job.admitted, touched=job.touched, peer_key=job.peer_key,
            schemas=job.schemas,  # content-addressed: the new incarnation's ranks resend the same
            schema_costs=job.schema_costs, schema_bytes=job.schema_bytes,
        )
        self.jobs[job.job] = new
        if self.runner is not None:
            self.runner.forget(job.job, "job restarted")
        self.version += 1
        return new

    def _records(self, job: JobState, r: RankState, m, now: float) -> None:
        """A rank's per-step records (a ``steps`` batch, or a report's one record): its gauges and
        counters, the job's step table (the checks judge the steps it releases), a probe's round."""
        probe = isinstance(m, wire.Report) and m.probe
        one = isinstance(m, wire.Report) or len(m.step) == 1  # 1 step/s and slower: no numpy per record
        # the counters take each step once: records of steps the rank sent before (a batch sent
        # again, or overlapping the last) are not counted again
        if one:
            rec = _record(m)
            last, n = rec["step"], 1
            fresh = last > r.step
            skipped = rec["skipped"] if fresh else 0
            nonfinite = fresh and (rec["grad_nonfinite"] > 0 or math.isinf(rec["grad_norm"]))
        else:
            rec = dict(zip(_NAMES, m.records[-1].item()))
            last, n = rec["step"], len(m.step)
            new = m.step > r.step
            fresh = int(new.sum())
            skipped = int(m.skipped[new].sum())
            nonfinite = int((((m.grad_nonfinite > 0) | np.isinf(m.grad_norm)) & new).sum())
        r.boot_step = -1
        if r.steps == 0:
            r.first_report_at = now
        job.max_step, job.last_report_at = max(job.max_step, last), now
        r.step = max(r.step, last)
        r.step_time, r.compute_time, r.loss, r.loss_scale = rec["step_time"], rec["compute_time"], rec["loss"], rec["loss_scale"]
        r.local_grad_norm = rec["local_grad_norm"]
        sharded = m.grad_sq is not None
        if not sharded:  # a sharded rank's global norm is known once its shard group reported (_released)
            r.grad_norm, r.grad_nonfinite = rec["grad_norm"], int(rec["grad_nonfinite"])
        r.skipped_steps += skipped
        r.agent_drops = max(r.agent_drops, m.drops)
        r.agent_cost, r.probe_interval, r.over_budget = m.agent_cost, m.probe_interval, m.over_budget
        r.steps += int(fresh)
        # a NaN norm with no non-finite parameter means "no gradients this step", not a fault
        r.nonfinite_steps += int(nonfinite)
        r.last_report_at = now
        table = job.table
        if table is None or table.world != job.world:
            # a pending job (no schema its records use yet, its world only what its frames claim)
            # gets a small table: one frame claiming 65,536 ranks took ~240 MB
            table = job.table = StepTable(job.world, MAX_CELLS if job.admitted else PENDING_CELLS)
        elif job.admitted and table.max_cells < MAX_CELLS:
            table.allow(MAX_CELLS)
        norms = None
        if m.grad_norms is not None:
            norms = (m.schema, m.grad_norms.reshape(n, -1))
        grad_sq = None
        if sharded:  # (its place's schema key, sq_kind, sums): the step's norms are worked out in columns
            if isinstance(m, wire.Report):
                grad_sq = [(m.schema, sq_kind(tuple(d for d, _ in m.grad_sq)), [v for _, v in m.grad_sq])]
            else:
                kind = sq_kind(m.grad_sq_dims)
                grad_sq = [(m.schema, kind, row) for row in m.grad_sq.tolist()]
        guard = None
        if m.nonfinite_slot is not None:
            guard = (m.schema, m.nonfinite_slot if isinstance(m, wire.Report) else m.nonfinite_slot.reshape(n))
        if one:
            rec["probe"] = 1.0 if probe else 0.0
            if guard is not None and not isinstance(m, wire.Report):
                guard = (guard[0], int(guard[1][0]))
            released = table.add_one(r.rank, last, rec, norms and (norms[0], norms[1][0]), grad_sq and grad_sq[0], guard)
        else:
            values = {name: getattr(m, name) for name in TABLE_COLUMNS if name != "probe"}
            values["probe"] = np.zeros(n)
            released = table.add(r.rank, m.step, values, norms, grad_sq, guard)
        self._released(job, released)
        if job.rounds:
            self._pass_rounds(job, r.rank, last - 1 if probe else last)
        if not probe:
            return
        r.probes += 1
        if m.schema not in job.schemas:
            self.reject("unknown_schema")
            return
        rnd = job.rounds.get(m.step)
        if rnd is None:
            rnd = job.rounds[m.step] = Round(m.step, now)
        size = _nbytes(m)
        old = rnd.reports.get(r.rank)
        if old is not None:
            size -= _nbytes(old)
        rnd.reports[r.rank] = m
        rnd.nbytes += size
        job.pending_bytes += size
        if len(rnd.reports) == job.world:
            self._close(job, rnd, complete=True)
        elif len(job.rounds) > self.max_pending:
            self._close(job, job.rounds[min(job.rounds)], complete=False)
        while job.pending_bytes > self.max_pending_bytes and job.rounds:  # memory bounded per job
            self._close(job, job.rounds[min(job.rounds)], complete=False)

    def _pass_rounds(self, job: JobState, rank: int, upto: int) -> None:
        """The rank sent a record of step ``upto`` or later: the open rounds up to it without its
        report will never get it; one that waits for no other rank closes now (incomplete)."""
        for rnd in [x for x in job.rounds.values() if x.step <= upto and rank not in x.reports]:
            rnd.passed.add(rank)
            if len(rnd.reports) + len(rnd.passed) >= job.world:
                self._close(job, rnd, complete=False)

    def _released(self, job: JobState, views: list) -> None:
        """Steps the job's table released: sharded ranks' global norms filled in (and their gauges,
        at the rank's latest step), then the checks judge them."""
        if not views:
            return
        schemas, states = job.schemas, job.ranks
        for v in views:
            if not v.grad_sq:
                continue
            # in rank order (the view's), not arrival order: each step of a job then asks
            # norms_of with the same ranks in the same positions, and its groups are kept
            sq, at, meshes, kinds, values = [], [], [], [], []
            ranks, per = v.ranks.tolist(), v.grad_sq
            for i, k in enumerate(ranks):
                e = per.get(k)
                if e is None:
                    continue
                sq.append(i)
                s = schemas.get(e[0])  # the record's place, also when its schema came after it
                if s is not None and s.mesh is not None:
                    at.append(i)
                    meshes.append(s.mesh)
                    kinds.append(e[1])
                    values.append(e[2])
            own = v.grad_norm[sq]
            v.grad_norm[sq] = math.nan  # until its shard groups are complete
            if at:
                v.grad_norm[at] = norms_of(meshes, kinds, values)[0]
            v.grad_norm[sq] = gradless(v.grad_norm[sq], own, v.grad_nonfinite[sq])
            step = v.step
            for k, x, y in zip([ranks[i] for i in sq], v.grad_norm[sq].tolist(), v.grad_nonfinite[sq].tolist()):
                r = states.get(k)
                if r is not None and r.step == step:  # its gauges show its latest step
                    r.grad_norm, r.grad_nonfinite = x, int(y)
        self._dispatch("on_steps", job, views)

    def tick(self) -> None:
        """Close rounds past their grace period; release steps that waited long enough; forget
        ranks silent for longer than the TTL."""
        now = self.clock()
        for job in list(self.jobs.values()):
            job._columns = None  # the ranks as they are now: the checks' ticks and the TTL scan read them
            if job.table is not None:
                self._released(job, job.table.tick(now))
            for rnd in sorted(job.rounds.values(), key=lambda x: x.step):
                if now - rnd.opened >= self.grace_s:
                    self._close(job, rnd, complete=False)
            if self.runner is not None:
                self._dispatch("on_tick", job, now)
                self.version += 1  # checks may have raised or resolved findings
            self._maybe_ended(job, now)
            scan = now - self._ttl_scan >= min(1.0, self.rank_ttl_s / 10)  # a second late in 600 s is no matter
            if scan:
                order = job.in_order()
                for r in [order[i] for i in np.flatnonzero(now - job.columns().last_seen > self.rank_ttl_s).tolist()]:
                    job.forgotten.update(rank_counters(r))
                    del job.ranks[r.rank]
                    job._order = job._columns = None
                    job.epoch = next(_EPOCHS)
                    self.version += 1
            # the schemas no rank or pending round uses go, looked over at the scan's pace (a mesh
            # job holds more schemas than ranks: each rank's placed one besides the stage's own)
            if scan and job.admitted and len(job.schemas) > len(job.ranks):  # (a pending job keeps its ranks')
                self._prune_schemas(job)
            if not job.ranks:
                self._drop(job)
        if now - self._ttl_scan >= min(1.0, self.rank_ttl_s / 10):
            self._ttl_scan = now

    def _maybe_ended(self, job: JobState, now: float) -> None:
        """Mark a job :attr:`JobState.ended` once every rank said goodbye as its process ended
        (:data:`ENDED`) ``grace_s`` ago and no round of it is left to judge; a rank heard again
        (an agent attached anew) makes it live again. Its findings stay as the checks left them
        (the truth about its end); the shipped alerts about its ranks at work resolve on
        ``gradwatch_job_ended``, where they fired on until ``rank_ttl_s`` forgot it."""
        if not job.ranks or not job.columns().closing.all():  # the common case, from the columns ticks read anyway
            if job.ended:
                job.ended = False
                self.version += 1
            return
        if job.ended or job.rounds or any(c.job is job for c in self.closing):
            return
        if job.processes_ended() and now - max(r.heartbeat_at for r in job.ranks.values()) >= self.grace_s:
            job.ended = True
            self.version += 1

    @staticmethod
    def _unscheduled(job: JobState, rnd: Round) -> bool:
        """Every rank missing from ``rnd`` is known and its probe interval (its latest message's)
        skips the round's step: the round is partial by schedule, no report lost. A rank never
        heard, or of an older agent (interval 0), may have probed it."""
        missing = job.world - len(rnd.reports)
        for k, r in job.ranks.items():
            if k not in rnd.reports:
                if r.probe_interval <= 0 or rnd.step % r.probe_interval == 0:
                    return False
                missing -= 1
        return missing == 0

    def _close(self, job: JobState, rnd: Round, complete: bool) -> None:
        del job.rounds[rnd.step]
        if complete:
            job.rounds_complete += 1
        elif self._unscheduled(job, rnd):
            job.rounds_partial += 1
        else:
            job.rounds_incomplete += 1
        args = (job.world, job.schemas, rnd.step, rnd.reports, complete, job.layouts)
        if self.round_slice_ranks and len(rnd.reports) >= self.round_slice_ranks:
            # its reports stay in the job's pending_bytes until it is done: memory bounded per job;
            # its layers are merged for export here too, a slice of its own (a scrape would wait)
            item = Closing(job, reconcile_in_slices(*args, self.group_depth), nbytes=rnd.nbytes)
            next(item.work)  # its first slice takes the layout: the schemas it needs are held from here
            self.closing.append(item)
        else:
            job.pending_bytes -= rnd.nbytes
            if job.deferred is None:
                self._finish(job, reconcile(*args))
                return
            item = Closing(job, result=reconcile(*args))  # done; its turn comes after the round in slices
        if job.deferred is None:
            job.deferred = collections.deque()
        job.deferred.append(item)
        while len(self.closing) > MAX_CLOSING:  # memory: each holds its round's reports
            self._advance_counted()  # that round's bug is not the frame's that closed this one

    def _dispatch(self, method: str, job: JobState, *args) -> None:
        """A checks' event of the job, now or, while a round of it is reconciled in slices, after it
        (ticks then run once, at the clock of their turn: they judge the state as it is then)."""
        if self.runner is None:
            return
        if job.deferred is None:
            self.runner.dispatch(method, job, *args)
        elif method != "on_tick" or not job.deferred or job.deferred[-1] != ("on_tick", None):
            job.deferred.append((method, None if method == "on_tick" else args))

    def advance(self) -> bool:
        """Run one slice of the oldest round in :attr:`closing`; once its reconciliation is done,
        its result goes to the job and the checks, and so do the job's events that waited for it.
        A round of a job restarted or dropped since is dropped unfinished. Returns whether rounds
        are left. Raises what the reconciliation raised (that round is then skipped)."""
        if not self.closing:
            return False
        item = self.closing[0]
        if self.jobs.get(item.job.job) is not item.job:  # its checks forgot the job: nobody waits
            self.closing.popleft()
            item.job.deferred, item.work = None, None
            return bool(self.closing)
        try:
            next(item.work)
        except StopIteration as done:
            item.result = done.value
            self._done(item)
        except BaseException:
            self._done(item)
            raise
        return bool(self.closing)

    def _done(self, item: Closing) -> None:
        self.closing.popleft()
        item.work = None
        item.job.pending_bytes -= item.nbytes
        self._flush(item.job)

    def finish_closing(self) -> None:
        """Reconcile every round in :attr:`closing` to the end (see :meth:`advance`); a round whose
        reconciliation raises is counted (rejected, reason ``internal``) and skipped."""
        while self.closing:
            self._advance_counted()

    def _advance_counted(self) -> None:
        try:
            self.advance()
        except Exception:
            self.reject("internal")

    def _flush(self, job: JobState) -> None:
        """Run the job's waiting events, in order, up to its next round still in slices."""
        if self.jobs.get(job.job) is not job:  # restarted or dropped meanwhile: its checks forgot it
            job.deferred = None
            return
        q = job.deferred
        while q:
            head = q[0]
            if isinstance(head, Closing):
                if head.work is not None:
                    return
                q.popleft()
                if head.result is not None:
                    try:
                        self._finish(job, head.result)
                    except Exception:  # a bug of ours: the events after it still run
                        self.reject("internal")
            else:
                q.popleft()
                method, args = head
                if method == "on_tick":
                    job._columns = None
                self.runner.dispatch(method, job, *(args if args is not None else (self.clock(),)))
        job.deferred = None

    def _finish(self, job: JobState, result: RoundResult) -> None:
        # a straggling older round must not replace a newer result on the dashboards
        if job.last_round is None or result.step >= job.last_round.step:
            # first come, first served: the series other jobs export keep theirs (a newcomer's
            # schema cannot push a running job off the scrape), within max_series_total
            others = sum(j.exported_series for j in self.jobs.values() if j is not job)
            budget = min(self.max_series_per_job, max(0, self.max_series_total - others))
            job.last_round, job.series_dropped = cap_series(result, budget)
            job.exported_series = series_of(job.last_round)
        self.version += 1
        if self.runner is not None:
            self.runner.dispatch("on_round", job, result)


#: the counters a job totals over its ranks (``gradwatch_job_*_total``, named as the
#: :class:`.reconcile.RankView` fields that show them per rank), each the sum of these RankState
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


def _nbytes(m: wire.Report) -> int:
    """Bytes of a probe report's arrays, every one :data:`gradwatch.wire.PROBE_ARRAYS` declares."""
    return sum(a.nbytes for a in (getattr(m, k) for k in wire.PROBE_ARRAYS) if a is not None)


def series_of(rr: RoundResult) -> int:
    """Per-layer series ``rr`` exports (at most: a statistic no rank observed is left out)."""
    return len(rr.layers) * SERIES_PER_LAYER + len(rr.modules) * SERIES_PER_MODULE


def cap_series(rr: RoundResult, budget: int) -> tuple[RoundResult, int]:
    """``rr`` cut to at most ``budget`` per-layer series, and how many series were cut.

    A layer (activation slot) exports :data:`SERIES_PER_LAYER` series, a module
    :data:`SERIES_PER_MODULE`; over budget, layers and modules keep the same share, the first ones
    in forward (``named_parameters``) order. Per-rank fields are untouched.
    """
    nl, nm = len(rr.layers), len(rr.modules)
    total = series_of(rr)
    if total <= budget:
        return rr, 0
    f = budget / total
    kl, km = int(nl * f), int(nm * f)
    agg = {}
    for stat in STATISTICS:
        values, observed = rr.agg[stat.name]
        k = km if ARRAYS[stat.array].exported_per == "module" else kl
        agg[stat.name] = (values[:, :k], observed[:k])
    cut = replace(
        rr, layers=rr.layers[:kl], act=rr.act[:, :kl], act_grad=rr.act_grad[:, :kl],
        layer_types=rr.layer_types[:kl], modules=rr.modules[:km], module=rr.module[:, :km], agg=agg,
        grouped=None,
    )
    if rr.grouped is not None:  # the layers merged for export follow the cut (on the writer, as before it)
        cut = replace(cut, grouped=group_layers(cut, rr.grouped.group_depth))
    return cut, total - kl * SERIES_PER_LAYER - km * SERIES_PER_MODULE


def _steps_of(msg) -> tuple[int, int]:
    """``(first, last)`` step a message speaks of: a batch's first and last record, a report's or
    heartbeat's step (-1, -1 for a schema)."""
    if isinstance(msg, wire.Steps):
        return int(msg.step[0]), int(msg.step[-1])
    step = msg.step if isinstance(msg, (wire.Report, wire.Heartbeat)) else -1
    return step, step


def _record(m) -> dict:
    """A message's one record as Python numbers (a report, or a ``steps`` batch of one)."""
    if isinstance(m, wire.Report):
        return {c.name: getattr(m, c.name) for c in wire.STEP_COLUMNS}
    return dict(zip(_NAMES, m.records[0].item()))


_NAMES = tuple(c.name for c in wire.STEP_COLUMNS)
