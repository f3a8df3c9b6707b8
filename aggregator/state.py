"""The aggregator's state: every job, rank and probed step, and the way a message goes through it.

One writer: the receive loop's thread. Every decoded message goes through :meth:`State.apply`;
time passes through :meth:`State.tick`. Nothing else mutates state. Scrapes never read it
directly: the writer publishes an immutable :class:`~.snapshot.Snapshot` (:func:`.snapshot.snapshot`).

The state conducts rooms with one job each, and holds none of their rules itself:

    jobs        the data model (:class:`~.jobs.JobState`, :class:`~.jobs.RankState`) and the
                registry of jobs by label and identity
    admission   which jobs, ranks and boots a message may change; restarts; slots
    schemas     each job's schemas and places on a mesh, within their count and byte bounds
    records     a rank's per-step records: its gauges and counters, the job's step table
    rounds      probed-step rounds: held, closed, reconciled (in slices), the checks' events
    series      the per-layer series a job's latest round may export
    limits      the bounds they read (:class:`~.limits.Limits`)

:meth:`State.apply` asks them in turn; the first that says no has the message counted in
``rejected`` by reason (:data:`REJECT_REASONS`), and the state stays as it was.
"""

from __future__ import annotations

import collections
import math
from dataclasses import replace
from typing import Callable, Optional

import msgspec
import numpy as np

from gradwatch import wire

from .admission import HELD, Admission
from .jobs import JobState, Registry
from .limits import Limits
from .records import Records
from .rounds import Rounds
from .schemas import SchemaStore
from .shards import place

#: every reason a message is rejected for (each room's docstring says when), the label values of
#: ``gradwatch_messages_rejected_total``, which shows each from the start (0 until the first): the
#: decoder's, the state's, then the daemon's (dropped under overload, refused CURVE handshakes,
#: a failure of the aggregator's own)
REJECT_REASONS = wire.REJECT_REASONS + (
    "world_too_large", "wrong_key", "retired_boot", "boot_conflict", "unknown_schema", "bad_coord",
    "world_mismatch", "restart_unconfirmed", "foreign_goodbye", "step_jump", "too_many_jobs", "pending_ranks",
    "schema_limit", "overload", "unauthenticated", "internal",
)
_REJECT_REASONS = frozenset(REJECT_REASONS)


class State:
    """All jobs the aggregator knows. Not thread-safe by design: one writer.

    Args:
        limits: the bounds every room keeps (:class:`~.limits.Limits`; its defaults when None).
        clock: monotonic clock, seconds.
        runner: the checks' ``Runner`` (events on_steps, on_heartbeat, on_round, on_tick), or None.
        **bounds: single limits in place of those of ``limits`` (``State(max_jobs=2)``).

    Raises:
        TypeError: a keyword that names no limit.

    Attributes:
        received: messages taken, by kind; ``rejected``: messages refused, by reason.
        decode_seconds, decode_count: the daemon's time decoding and applying messages, and how many.
        probes_shed: probe reports the daemon's intake kept as their record alone.
    """

    def __init__(self, limits: Optional[Limits] = None, clock: Optional[Callable[[], float]] = None, runner=None,
                 **bounds):
        import time

        self.limits = replace(limits if limits is not None else Limits(), **bounds)
        self.clock = clock or time.monotonic
        self.runner = runner  # runner.Runner, or None
        self.registry = Registry(runner)
        self.schemas = SchemaStore(self.registry, self.limits)
        self.admission = Admission(self.registry, self.limits, self.schemas)
        self.rounds = Rounds(self.registry, self.limits, runner, self.reject, self.clock)
        self.records = Records(self.rounds)
        self.received: collections.Counter = collections.Counter()  # by kind
        self.rejected: collections.Counter = collections.Counter()  # by reason
        self.decode_seconds = 0.0
        self.decode_count = 0
        self.probes_shed = 0
        self._ttl_scan = -math.inf  # clock of the latest scan for ranks past rank_ttl_s

    # --- what the daemon, the snapshot and tests read ------------------------------------------

    @property
    def jobs(self) -> dict[str, JobState]:
        """label -> job (:attr:`.jobs.Registry.jobs`)."""
        return self.registry.jobs

    @property
    def labels(self) -> dict[tuple[str, str], str]:
        """identity (job id, key) -> label."""
        return self.registry.labels

    @property
    def version(self) -> int:
        """Bumped on every change; the publisher compares it."""
        return self.registry.version

    @property
    def slots(self) -> int:
        """Bumped whenever a job takes or leaves a slot (:attr:`admitted` changes)."""
        return self.registry.slots

    @property
    def jobs_evicted(self) -> int:
        """Pending jobs evicted to make room for another."""
        return self.registry.evicted

    @property
    def admission_counts(self) -> dict:
        """What admission did, for the snapshot: ``not_admitted`` (``((label, reason), ...)`` of the
        latest refused that are still held and waiting for a slot), ``refused`` (identities
        refused), ``unproven_evicted``, and the jobs held by stage (``stages``: ``((stage, n),
        ...)``: proven, unproven, pending)."""
        a = self.admission
        stages = collections.Counter(("proven" if j.proven else "unproven") if j.admitted else "pending"
                                     for j in self.jobs.values())
        waiting = tuple((label, why) for label, why in a.refused.items()
                        if label in self.jobs and not self.jobs[label].admitted)
        return {"not_admitted": waiting, "refused": a.refused_total,
                "unproven_evicted": self.registry.unproven_evicted,
                "stages": tuple((k, stages.get(k, 0)) for k in ("proven", "unproven", "pending"))}

    @property
    def closing(self):
        """Rounds closed but not reconciled yet (:attr:`.rounds.Rounds.closing`), oldest first."""
        return self.rounds.closing

    @property
    def admitted(self) -> frozenset:
        """:attr:`.jobs.Registry.admitted`: the identities of the jobs holding a slot."""
        return self.registry.admitted

    @property
    def job_keys(self) -> dict[str, str]:
        """``{job label: the CURVE public key that created it}``, for jobs made with CURVE on."""
        return self.registry.job_keys

    def known_schema(self, h: wire.Header, digest: str):
        """:meth:`.schemas.SchemaStore.known`, for ``wire.decode``."""
        return self.schemas.known(h, digest)

    def schema_sizes(self, h: wire.Header, digest: str):
        """:meth:`.schemas.SchemaStore.sizes`, for ``wire.decode``."""
        return self.schemas.sizes(h, digest)

    # --- inputs ---------------------------------------------------------------------------------

    def reject(self, reason: str, n: int = 1) -> None:
        """Count ``n`` messages rejected for ``reason``, one of :data:`REJECT_REASONS`.

        Raises:
            ValueError: an undeclared reason (a label value no one iterates).
        """
        if reason not in _REJECT_REASONS:
            raise ValueError(f"undeclared rejection reason {reason!r}")
        self.rejected[reason] += n
        self.registry.version += 1

    def overloaded(self, drops) -> None:
        """The intake dropped frames of these jobs: mark them, so the checks that judge silence know
        the aggregator missed some of what was sent. ``drops``: ``((job id, key), CURVE user id or
        None)`` pairs, the identity the frames' headers claim and their sender's key
        (:attr:`~.intake.Intake.dropped_jobs`). With CURVE on, a drop marks a job only when its
        sender is the key the job is bound to (:attr:`.jobs.JobState.peer_key`, the rule of
        :mod:`.admission`): another client claiming the job's id cannot mute its silence checks."""
        now = self.clock()
        for ident, peer_key in drops:
            job = self.registry.find(ident)
            if job is None or (peer_key is not None and job.peer_key not in (None, peer_key)):
                continue
            job.overloaded_at = now
            self.registry.version += 1

    def apply(self, msg: wire.Message, peer_key: Optional[str] = None, source: Optional[str] = None) -> None:
        """Fold one decoded message into state; a message that may not change it is counted in
        ``rejected`` by reason and leaves it as it was. ``peer_key``: the sender's CURVE public
        key, with CURVE on; a job is bound to the key that created it. ``source``: who sent it
        for the per-source quotas (:mod:`.admission`: the CURVE key, else the peer's address;
        None: no quota)."""
        h, now = msg.header, self.clock()
        job = self.admission.job_for(h, peer_key, now, source)  # its job, a new pending one for a new identity
        if isinstance(job, str):
            return self.reject(job)
        r = job.ranks.get(h.rank)
        why = self.admission.boot_conflict(r, h, now) or self.schemas.misplaced(job, r, msg)
        if why:
            if why == "boot_conflict":
                r.disputed_at = now  # two processes claim the rank: no halt believes its records for a while
            return self.reject(why)
        got = self.admission.incarnation(job, r, msg, r is None or h.boot != r.boot, now)  # restarted, or why not
        if isinstance(got, str):
            return self.reject(got)
        job, r = got
        why = self.admission.slot(job, msg, now) or self.admission.room(job, r, msg) or self.schemas.keep(job, msg)
        if why == HELD:  # a schema kept for a rank the pending job has no room for yet
            self.received["schema"] += 1
            return None
        if why:
            return self.reject(why)
        digest = msg.hash if isinstance(msg, wire.Schema) else msg.schema
        key = self.schemas.place_of(job, r, digest, h.coord)  # None: a schema the job does not hold (yet)
        if key == "":
            return self.reject("schema_limit")  # a placed copy the job has no room for
        if isinstance(msg, (wire.Steps, wire.Report)) and h.coord and key != digest:
            # a rank of a mesh: its records by its place, also under a schema not held yet (its
            # steps' norms wait in the table under the key its place will have)
            msg = msgspec.structs.replace(msg, schema=key or place(digest, h.coord))
        r = job.hear(h, (digest, h.coord, key) if key is not None else None, now)
        self.registry.version += 1
        if isinstance(msg, wire.Schema):
            self.received["schema"] += 1
            job.use_schema(r, key)
            r.host, r.local_rank = msg.host[: self.limits.max_label_len], msg.local_rank
            r.halt_on = msg.halt_on
            return None
        if key is not None:  # its full schema may have come from another rank, or while the job had no room for it
            job.use_schema(r, key)
        if isinstance(msg, wire.Heartbeat):
            self.received["heartbeat"] += 1
            r.beat(msg, now)
            self.rounds.event("on_heartbeat", job, r, msg)
            return None
        self.received["report" if isinstance(msg, wire.Report) else "steps"] += 1
        before = r.step
        why = self.records.take(job, r, msg, now)
        if r.step > before and not job.proven and self.admission.prove(job, r):
            self.records.proven(job)
            self.rounds.prove(job)  # judged from now on, its first steps first
        return self.reject(why) if why else None

    # --- time -----------------------------------------------------------------------------------

    def tick(self) -> None:
        """Release steps that waited long enough; close rounds past their grace period; give the
        checks their tick; mark ended jobs; forget ranks silent for longer than the TTL (and the
        schemas no one uses), and jobs left without ranks."""
        now = self.clock()
        scan = now - self._ttl_scan >= min(1.0, self.limits.rank_ttl_s / 10)  # a second late in 600 s is no matter
        for job in list(self.jobs.values()):
            job.refresh_columns()  # the ranks as they are now: the checks' ticks and the TTL scan read them
            if job.table is not None:
                self.records.released(job, job.table.tick(now))
            self.rounds.expire(job, now)
            if self.runner is not None:
                self.rounds.event("on_tick", job, now)
                self.registry.version += 1  # checks may have raised or resolved findings
            self._maybe_ended(job, now)
            if scan:
                order = job.in_order()
                for r in [order[i] for i in np.flatnonzero(now - job.columns().last_seen > self.limits.rank_ttl_s).tolist()]:
                    self.admission.forgetting(job, r)
                    job.forget_rank(r)
                    self.registry.version += 1
                # the schemas no rank or pending round uses go, looked over at the scan's pace (a mesh
                # job holds more schemas than ranks: each rank's placed one besides the stage's own)
                if job.admitted and len(job.schemas) > len(job.ranks):  # (a pending job keeps its ranks')
                    self.schemas.prune(job)
            if not job.ranks:
                self.registry.drop(job)
        if scan:
            self._ttl_scan = now

    def _maybe_ended(self, job: JobState, now: float) -> None:
        """Mark a job :attr:`~.jobs.JobState.ended` once every rank said goodbye as its process
        ended (:data:`~.jobs.ENDED`) ``grace_s`` ago and no round of it is left to judge; a rank
        heard again (an agent attached anew) makes it live again. Its findings stay as the checks
        left them (the truth about its end); the shipped alerts about its ranks at work resolve on
        ``gradwatch_job_ended``, where they fired on until ``rank_ttl_s`` forgot it."""
        if not job.ranks or not job.columns().closing.all():  # the common case, from the columns ticks read anyway
            if job.ended:
                job.ended = False
                self.registry.version += 1
            return
        if job.ended or job.rounds or self.rounds.reconciling(job):
            return
        if job.processes_ended() and now - max(r.heartbeat_at for r in job.ranks.values()) >= self.limits.grace_s:
            job.ended = True
            self.registry.version += 1

    # --- rounds in slices -------------------------------------------------------------------------

    def advance(self) -> bool:
        """:meth:`.rounds.Rounds.advance`: one slice of the oldest round being reconciled."""
        return self.rounds.advance()

    def finish_closing(self) -> None:
        """:meth:`.rounds.Rounds.finish_closing`: every round being reconciled, to the end."""
        self.rounds.finish_closing()

