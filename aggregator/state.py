"""Aggregator state per job, rank and probed step. One writer: the receive loop's thread.

Every decoded message goes through :meth:`State.apply`; time passes through :meth:`State.tick`.
Nothing else mutates state. Scrapes never read it directly: the writer publishes an immutable
:class:`~.reconcile.Snapshot` (see :meth:`State.snapshot`).

A probed step's *round* collects one report per rank; it is complete when every rank of the world
has reported, or closed incomplete ``round_grace_s`` after its first report (or when more than
``max_pending_rounds`` wait). Either way it is reconciled (:mod:`.reconcile`).
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import Callable, Optional

from gradwatch import wire

from .reconcile import RoundResult, reconcile
from .shards import ShardNorms, mesh_of

@dataclass
class RankState:
    rank: int
    boot: str = ""
    host: str = ""
    local_rank: int = 0
    schema: str = ""
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
    closing: bool = False  # the agent said goodbye: the rank finished, it is not silent
    in_step_s: float = 0.0  # from the latest heartbeat
    waiting: bool = False  # from the latest heartbeat: waiting on peers in all-reduce
    heartbeat_at: float = 0.0  # aggregator clock of the latest heartbeat
    last_report_at: float = 0.0  # aggregator clock of the latest report
    # the agent's own counters restart with it; these carry earlier boots' totals so the exported
    # counters never decrease
    drops_base: int = 0
    errors_base: int = 0
    boot_step: int = -1  # the rank's latest step under its previous boot (-1: none)


@dataclass
class Round:
    step: int
    opened: float
    reports: dict[int, wire.Report] = field(default_factory=dict)


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
    restarts: int = 0  # times the job came back from an earlier step (a checkpoint) under its id
    retired: frozenset = frozenset()  # boot ids of the previous incarnation: late messages dropped
    shards: ShardNorms = field(default_factory=ShardNorms)  # sharded ranks' reports awaiting their group


class State:
    """All jobs the aggregator knows. Not thread-safe by design: one writer.

    Args:
        grace_s: seconds a round waits for missing ranks.
        max_pending: rounds held per job.
        rank_ttl_s: seconds after which a silent rank is forgotten.
        clock: monotonic clock, seconds.
        on_round: called with each reconciled :class:`RoundResult` (the checks hook in here).
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
    ):
        import time

        self.max_jobs = max_jobs  # the PULL socket takes any peer's job id: state stays bounded
        self.max_world = max_world
        self.grace_s = grace_s
        self.max_pending = max_pending
        self.rank_ttl_s = rank_ttl_s
        self.clock = clock or time.monotonic
        self.runner = runner  # checks.Runner, or None
        self.jobs: dict[str, JobState] = {}
        self.job_keys: dict[str, str] = {}  # job -> CURVE public key that created it
        self.received: collections.Counter = collections.Counter()  # by kind
        self.rejected: collections.Counter = collections.Counter()  # by reason
        self.decode_seconds = 0.0
        self.decode_count = 0
        self.version = 0  # bumped on every change; the publisher compares it

    # --- inputs ---------------------------------------------------------------------------------

    def reject(self, reason: str) -> None:
        self.rejected[reason] += 1
        self.version += 1

    def known_schema(self, h: wire.Header, digest: str):
        job = self.jobs.get(h.job)
        return job.schemas.get(digest) if job else None

    def schema_sizes(self, h: wire.Header, digest: str):
        job = self.jobs.get(h.job)
        s = job.schemas.get(digest) if job else None
        return (len(s.params), len(s.slots)) if s else (None, None)

    def apply(self, msg: wire.Message, peer_key: Optional[str] = None) -> None:
        """Fold one decoded message into state. ``peer_key``: the sender's CURVE public key, with
        CURVE on; a job is bound to the key that created it, others' messages are rejected
        (``wrong_key``)."""
        h = msg.header
        now = self.clock()
        job = self.jobs.get(h.job)
        if peer_key is not None and job is not None and self.job_keys.get(h.job, peer_key) != peer_key:
            self.reject("wrong_key")
            return
        if job is not None and h.boot in job.retired:
            self.reject("retired_boot")  # a late message of the job's previous incarnation
            return
        if h.world > self.max_world:
            self.reject("world_too_large")
            return
        if job is None:
            if len(self.jobs) >= self.max_jobs:
                self.reject("too_many_jobs")
                return
            job = self.jobs[h.job] = JobState(h.job, h.world)
            self.job_keys = {j: k for j, k in self.job_keys.items() if j in self.jobs}  # forgotten jobs unbound
            if peer_key is not None:
                self.job_keys[h.job] = peer_key
        if h.world != job.world:
            # the job restarted with another world size: start over rather than mix worlds
            job = self._restart(job, h)
        r = job.ranks.get(h.rank)
        if r is not None and isinstance(msg, wire.Report):
            # the rank's step before its agent restarted (-1 when it did not)
            before = r.step if (r.boot and h.boot != r.boot) else r.boot_step
        if r is not None and isinstance(msg, wire.Report) and msg.step <= before:
            # a restarted rank resumes from an earlier step (a checkpoint): the whole job did
            # (torchelastic restarts every rank under the same run id). Start its state, and the
            # checks' step watermarks, over rather than ignore everything up to the old step.
            job = self._restart(job, h)
            r = None
        if r is None:
            r = job.ranks[h.rank] = RankState(h.rank)
        if h.boot != r.boot:
            if r.boot:  # the agent restarted: its sequence and counters start over
                r.restarts += 1
                r.boot_step = r.step
                r.drops_base += r.agent_drops
                r.errors_base += r.agent_errors
                r.agent_drops = r.agent_errors = 0
                r.last_seq = -1
            else:  # first contact (or the aggregator restarted): what came before is not a loss
                r.last_seq = h.seq - 1
            r.boot = h.boot
        if h.seq > r.last_seq + 1:
            r.lost += h.seq - r.last_seq - 1
        r.last_seq = max(r.last_seq, h.seq)
        r.received += 1
        r.last_seen = now
        self.version += 1

        if isinstance(msg, wire.Schema):
            self.received["schema"] += 1
            job.schemas[msg.hash] = msg
            r.schema, r.host, r.local_rank = msg.hash, msg.host, msg.local_rank
        elif isinstance(msg, wire.Heartbeat):
            self.received["heartbeat"] += 1
            r.agent_drops, r.agent_errors = msg.drops, msg.errors
            r.closing, r.in_step_s, r.waiting, r.heartbeat_at = msg.closing, msg.in_step_s, msg.waiting, now
            if self.runner is not None:
                self.runner.dispatch("on_heartbeat", job, r, msg)
        else:
            self.received["report"] += 1
            if msg.grad_sq is None:
                self._report(job, r, msg, now)
            else:  # sharded: applied once the shard group's global norm is known (.shards)
                for rank, rep in job.shards.add(h.rank, mesh_of(job, h.rank), msg):
                    if rank in job.ranks:
                        self._report(job, job.ranks[rank], rep, now)

    def _restart(self, job: JobState, h: wire.Header) -> JobState:
        new = JobState(
            job.job, h.world, restarts=job.restarts + 1,
            retired=job.retired | {r.boot for r in job.ranks.values() if r.boot != h.boot},
        )
        self.jobs[job.job] = new
        if self.runner is not None:
            self.runner.forget(job.job)
        self.version += 1
        return new

    def _report(self, job: JobState, r: RankState, m: wire.Report, now: float) -> None:
        r.boot_step = -1
        r.step = max(r.step, m.step)
        r.step_time, r.grad_norm, r.grad_nonfinite = m.step_time, m.grad_norm, m.grad_nonfinite
        r.local_grad_norm, r.compute_time, r.loss, r.loss_scale = m.local_grad_norm, m.compute_time, m.loss, m.loss_scale
        r.skipped_steps += m.skipped
        r.agent_drops = max(r.agent_drops, m.drops)
        r.steps += 1
        # a NaN norm with no non-finite parameter means "no gradients this step", not a fault
        if m.grad_nonfinite or math.isinf(m.grad_norm):
            r.nonfinite_steps += 1
        r.last_report_at = now
        if self.runner is not None:
            self.runner.dispatch("on_report", job, r, m)
        if not m.probe:
            return
        r.probes += 1
        if m.schema not in job.schemas:
            self.rejected["unknown_schema"] += 1
            return
        rnd = job.rounds.get(m.step)
        if rnd is None:
            rnd = job.rounds[m.step] = Round(m.step, now)
        rnd.reports[r.rank] = m
        if len(rnd.reports) == job.world:
            self._close(job, rnd, complete=True)
        elif len(job.rounds) > self.max_pending:
            self._close(job, job.rounds[min(job.rounds)], complete=False)

    def tick(self) -> None:
        """Close rounds past their grace period; forget ranks silent for longer than the TTL."""
        now = self.clock()
        for job in list(self.jobs.values()):
            for rnd in sorted(job.rounds.values(), key=lambda x: x.step):
                if now - rnd.opened >= self.grace_s:
                    self._close(job, rnd, complete=False)
            if self.runner is not None:
                self.runner.dispatch("on_tick", job, now)
                self.version += 1  # checks may have raised or resolved findings
            for rank, r in list(job.ranks.items()):
                if now - r.last_seen > self.rank_ttl_s:
                    del job.ranks[rank]
                    self.version += 1
            if len(job.schemas) > len(job.ranks):  # keep the schemas a rank or a pending round uses
                used = {r.schema for r in job.ranks.values()}
                used.update(rep.schema for rnd in job.rounds.values() for rep in rnd.reports.values())
                job.schemas = {k: v for k, v in job.schemas.items() if k in used}
            if not job.ranks:
                del self.jobs[job.job]
                if self.runner is not None:
                    self.runner.forget(job.job)
                self.version += 1

    def _close(self, job: JobState, rnd: Round, complete: bool) -> None:
        del job.rounds[rnd.step]
        if complete:
            job.rounds_complete += 1
        else:
            job.rounds_incomplete += 1
        result = reconcile(job.world, job.schemas, rnd.step, rnd.reports, complete)
        # a straggling older round must not replace a newer result on the dashboards
        if job.last_round is None or result.step >= job.last_round.step:
            job.last_round = result
        self.version += 1
        if self.runner is not None:
            self.runner.dispatch("on_round", job, result)
