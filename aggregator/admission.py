"""Admission: which jobs, ranks and boots a message may change, and when a job starts over.

No foreign or malformed bytes reset, hide or flood a job:

* **Identity.** A job is its id *and* the ``key`` its ranks share (``wire.Header.key``: a digest of
  torchrun's run id, master address and port and world size, or a configured key), so two jobs
  under one id (torchrun's default ``none``) stay two jobs (:func:`.jobs.identity`). Labels stay
  ``job_id``: the first live job under an id is labelled with the id, a later one with ``id~``
  and the first 4 (8, 16 on a clash) hex chars of its key, unless every rank of the job holding
  the id said goodbye as its process ended (:data:`.jobs.ENDED`; with CURVE, from the same key): a
  relaunch takes the id over; ``State.jobs`` is keyed by that label. With CURVE on, a job is bound
  to the client key that created it; other keys' messages are rejected (``wrong_key``).
* **One boot per live rank.** A message for a rank under another boot id than the one it speaks
  under is rejected (``boot_conflict``) while that agent is alive: heard within
  ``boot_takeover_s`` and without a goodbye. A real restart comes after the old process died
  (silent) or closed its agent (goodbye); a forged frame for a live rank changes nothing.
* **Restart by majority.** A job's state starts over only when at least half of its world's
  ranks vote for it from new boot ids (a report resuming at an earlier step, or a frame of
  another world size; votes agree on the world and expire after ``restart_grace_s``; ranks past
  the job's world have no vote), or when one of its ranks votes and every other rank has been
  silent for ``restart_grace_s``. A lone frame is rejected (``world_mismatch``,
  ``restart_unconfirmed``), and so is a goodbye from a boot the rank does not speak under
  (``foreign_goodbye``). A report or heartbeat whose step runs ahead of the rank's latest (or
  its peers', if ahead) by more than ``max(max_step_jump, 10 x the steps the rank's observed
  rate explains)`` is rejected (``step_jump``). Boots a restart retired are rejected
  (``retired_boot``) for ``restart_grace_s`` only: a dead incarnation falls silent within
  seconds, so boots still speaking after that had their restart forged, and are heard.
* **Slots.** A job takes one of ``max_jobs`` slots only once it sent a schema and a report using
  it; until then it is *pending*, one of at most ``max_pending_jobs``, evicted least recently
  heard first, those without a schema before those with, so invented job ids cannot squat slots
  and a flood of them without schemas cannot push a starting job out; a pending job holds at most
  ``max_pending_ranks`` ranks (``pending_ranks``): the schemas of ranks it has no room for are
  kept for them to use once the job has its slot (:mod:`.schemas`); its step table holds at most
  ``steps.PENDING_CELLS`` cells.
* **Proof.** A job holding a slot is *proven* once ``proof_rank_share`` of its world's ranks (at
  least one) have each advanced their step in ``proof_steps`` messages (each a later step than
  the rank's before: one coalesced batch of many steps counts once, so no single frame proves a
  job), under its one world size and a schema it holds (:meth:`Admission.prove`); with
  ``proof_steps`` 0 every job is proven as it comes. Until then it is quiet: no series, no
  finding, its checks' events held (:mod:`.rounds`). Proven jobs outrank the others: a job that
  needs a slot when none is free evicts the unproven job whose proof got least far (its ranks'
  messages that advanced a step), the least recently heard among equals: a job resending one step
  however often gets no further, a real one starting beside it does. When every slot holds a
  proven job it is refused (``too_many_jobs``), and a proven job leaves its slot only when its
  ranks have been silent for ``rank_ttl_s``. A frame under a live job's id and another key (a
  lookalike) makes a job of its own, unproven and quiet like any other.
* **Sources.** Each job remembers its *source*, the sender of the frame that made it: the CURVE
  key with CURVE on, else the peer's address. A source holds at most ``max_jobs_per_source``
  slots (proven jobs and unproven ones: one sender cannot take every slot; past it, with all of
  them proven, its new job is refused), ``max_unproven_per_source`` unproven jobs with a slot and
  ``max_pending_per_source`` pending ones: past either, a new one of its own evicts its own (as above; a pending one without a schema first, the least recently
  heard), never another source's, so one sender's invented jobs churn among themselves while its
  real jobs (a host's jobs, or every job behind one NAT address, share a source) still get in.
  The counts are read from the jobs held, so at most as many sources are tracked as jobs are held.
* **Not admitted.** A job refused a slot (``too_many_jobs``) is counted once per identity
  (:attr:`Admission.refused_total`; the latest :data:`REFUSED_SHOWN` as ``{label: reason}``,
  :attr:`Admission.refused`), never judged, and logged once with the setting that would admit it
  (at most :data:`LOG_BURST` lines a minute).

:class:`Admission` gives one verdict per rule, in the order :meth:`.state.State.apply` asks them:
a reason (one of :data:`.state.REJECT_REASONS`) when the message may not change the state, None
(or the job and rank it may change) when it may.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import math
from typing import Optional, Union

from gradwatch import wire

from .jobs import JobState, RankState, Registry, identity
from .limits import Limits
from .schemas import SchemaStore

log = logging.getLogger("gradwatch.aggregator")

#: refused identities shown by label (``gradwatch_job_not_admitted``), the latest
REFUSED_SHOWN = 16
#: refused identities remembered so that each is counted and logged once
REFUSED_KEPT = 1024
#: most lines a minute the refusals log (a flood of invented ids is counted, not logged each)
LOG_BURST = 16

#: :meth:`Admission.room`'s verdict for a schema a pending job keeps for a rank it has no room for
#: yet: counted as received, nothing else changes
HELD = "held"


def steps_of(msg) -> tuple[int, int]:
    """``(first, last)`` step a message speaks of: a batch's first and last record, a report's or
    heartbeat's step (-1, -1 for a schema)."""
    if isinstance(msg, wire.Steps):
        return int(msg.step[0]), int(msg.step[-1])
    step = msg.step if isinstance(msg, (wire.Report, wire.Heartbeat)) else -1
    return step, step


class Admission:
    """The admission rules of the module docstring, over the jobs of ``registry``.

    Args:
        registry: the jobs.
        limits: ``max_world``, ``max_jobs``, ``max_pending_jobs``, ``max_pending_ranks``,
            ``max_step_jump``, ``restart_grace_s``, ``boot_takeover_s``.
        schemas: the schema store (a pending job's schemas of ranks it has no room for are kept).

    Attributes:
        refused: ``{job label or id: reason}`` of the latest :data:`REFUSED_SHOWN` identities
            refused (module docstring: not admitted), oldest first.
        refused_total: identities refused, each counted once while remembered (the latest
            :data:`REFUSED_KEPT`).
    """

    def __init__(self, registry: Registry, limits: Limits, schemas: SchemaStore):
        self.registry, self.limits, self.schemas = registry, limits, schemas
        self.refused: collections.OrderedDict = collections.OrderedDict()
        self.refused_total = 0
        self._refused_ids: collections.OrderedDict = collections.OrderedDict()  # identity -> None (LRU)
        self._logged: collections.deque = collections.deque(maxlen=LOG_BURST)  # clocks of the latest lines

    def job_for(self, h: wire.Header, peer_key: Optional[str], now: float,
                source: Optional[str] = None) -> Union[JobState, str]:
        """The job a message with header ``h`` speaks for (a new pending one for a new identity),
        or why it may not: ``world_too_large``, ``wrong_key`` (CURVE on: only the key that created
        a job writes to it), ``retired_boot`` (a late message of the job's previous incarnation).
        ``source``: the sender, whose own oldest pending job a new one past
        ``max_pending_per_source`` evicts (None: not known, no quota)."""
        if h.world > self.limits.max_world:
            return "world_too_large"
        job = self.registry.of(h)
        if peer_key is not None and job is not None and job.peer_key not in (None, peer_key):
            return "wrong_key"
        if job is not None and h.boot in job.retired:
            if now - job.retired_at <= self.limits.restart_grace_s:
                return "retired_boot"
            # a dead incarnation's messages stop within seconds; boots that still speak after the
            # grace were retired by a restart that did not happen (forged): they are heard again
            job.retired = frozenset()
        if job is None:
            if source is not None:
                own = [j for j in self.registry.pending() if j.source == source]
                if len(own) >= self.limits.max_pending_per_source:  # the source's own churn
                    self.registry.evict(min(own, key=lambda j: (bool(j.schemas), j.touched)))
            job = self._new_job(h, now, peer_key)
            job.source = source
        return job

    def boot_conflict(self, r: Optional[RankState], h: wire.Header, now: float) -> Optional[str]:
        """``boot_conflict`` when another boot than the one rank ``r`` speaks under claims it while
        its agent is alive (heard within ``boot_takeover_s``, no goodbye): forged or misrouted, it
        may neither restart the job nor count as the agent's restart."""
        if r is not None and h.boot != r.boot and r.boot and not r.closing and now - r.last_seen < self.limits.boot_takeover_s:
            return "boot_conflict"
        return None

    def incarnation(self, job: JobState, r: Optional[RankState], msg, new_boot: bool,
                    now: float) -> Union[tuple[JobState, Optional[RankState]], str]:
        """The job and rank ``msg`` changes: the job started over (its rank forgotten) when the
        votes carry a restart (another world size, or a new boot resuming at an earlier step);
        or why not: ``world_mismatch``, ``restart_unconfirmed``, ``foreign_goodbye``, ``step_jump``."""
        h = msg.header
        if h.world != job.world:
            # another world size: a restarted job (elastic), or a forged or misrouted frame
            if not job.ranks:
                job.world = h.world
            elif new_boot and self._vote(job, h, now):
                job, r = self._restart(job, h, now), None
            else:
                return "world_mismatch"
        records = isinstance(msg, (wire.Steps, wire.Report))
        first, step = steps_of(msg)
        if r is not None and records:
            # the rank's step before its agent restarted (-1 when it did not)
            before = r.step if new_boot else r.boot_step
            if first <= before:
                # a restarted rank resumes from an earlier step (a checkpoint): the whole job did
                # (torchelastic restarts every rank under the same run id) once enough ranks say so.
                # Its state, and the checks' step watermarks, start over rather than ignore every
                # step up to the old one.
                if not self._vote(job, h, now):
                    return "restart_unconfirmed"
                job, r = self._restart(job, h, now), None
        if isinstance(msg, wire.Heartbeat) and msg.closing and r is not None and new_boot:
            return "foreign_goodbye"  # an agent says goodbye from the boot it spoke under
        if step >= 0 and step > self.step_limit(job, r, now):
            return "step_jump"
        return job, r

    def slot(self, job: JobState, msg, now: float) -> Optional[str]:
        """A pending job sending a step under a schema it holds takes a slot: a free one of
        ``max_jobs``, else the slot of the unproven job whose proof got least far, the least
        recently heard among equals (evicted; its own source's, past ``max_unproven_per_source``
        or ``max_jobs_per_source``); or why not: ``too_many_jobs`` (every slot holds a proven job,
        or the source's ``max_jobs_per_source`` slots do)."""
        if isinstance(msg, (wire.Steps, wire.Report)) and not job.admitted and msg.schema in job.schemas:
            unproven = [j for j in self.registry.jobs.values() if j.admitted and not j.proven]
            own = [j for j in unproven if j.source == job.source] if job.source is not None else []
            held = 0 if job.source is None else sum(
                1 for j in self.registry.jobs.values() if j.admitted and j.source == job.source)
            if held >= self.limits.max_jobs_per_source and not own:  # every slot of the source's proven
                return self._refuse((job.name, job.key), job.job, job.world, now, per_source=held)
            if len(own) >= self.limits.max_unproven_per_source or held >= self.limits.max_jobs_per_source:
                victim = min(own, key=lambda j: (j.progress, j.touched))  # its source's own
            elif self.registry.holding() >= self.limits.max_jobs:
                if not unproven:
                    return self._refuse((job.name, job.key), job.job, job.world, now)
                victim = min(unproven, key=lambda j: (j.progress, j.touched))
            else:
                victim = None
            if victim is not None:
                self.registry.evict(victim, "evicted unproven: a job needed its slot")
            job.admitted = True
            self.registry.slots += 1
            if self._refused_ids.pop((job.name, job.key), 0) is None:  # refused before: no longer shown
                for label in (job.job, job.name):
                    self.refused.pop(label, None)
        return None

    def prove(self, job: JobState, r: RankState) -> bool:
        """A message advanced rank ``r``'s step in ``job``: True when that proves the job (module
        docstring: ``proof_rank_share`` of its world's ranks with ``proof_steps`` such messages
        each; a job's ranks all speak under its one world size)."""
        if job.proven or not job.admitted:
            return False
        r.proof += 1
        if r.proof <= self.limits.proof_steps:
            job.progress += 1
        if r.proof == self.limits.proof_steps:
            job.proof_ranks += 1
        if job.proof_ranks >= max(1, math.ceil(self.limits.proof_rank_share * job.world)):
            job.proven = True
            self.registry.version += 1
            return True
        return False

    def forgetting(self, job: JobState, r: RankState) -> None:
        """Rank ``r`` of ``job`` is about to be forgotten: it no longer counts toward the job's proof."""
        if not job.proven:
            job.progress -= min(r.proof, self.limits.proof_steps)
            job.proof_ranks -= r.proof >= self.limits.proof_steps

    def _refuse(self, ident: tuple, label: str, world: int, now: float, reason: str = "too_many_jobs",
                per_source: int = 0) -> str:
        """Count the job ``ident`` (labelled ``label``) refused a slot once, show it among the
        latest refused, log it once (rate-bounded) naming what would admit it; returns
        ``reason``. ``per_source``: the slots its source holds, when that is why (else every slot
        holds a proven job)."""
        if ident in self._refused_ids:
            self._refused_ids.move_to_end(ident)
            return reason
        self._refused_ids[ident] = None
        if len(self._refused_ids) > REFUSED_KEPT:
            self._refused_ids.popitem(last=False)
        self.refused_total += 1
        label = label[: self.limits.max_label_len]
        self.refused.pop(label, None)
        self.refused[label] = reason
        if len(self.refused) > REFUSED_SHOWN:
            self.refused.popitem(last=False)
        self.registry.version += 1
        if len(self._logged) == LOG_BURST and now - self._logged[0] < 60:
            return reason
        self._logged.append(now)
        if per_source:
            log.warning("gradwatch aggregator: job %r (world %d) not admitted: its sender already holds %d slots, each "
                        "a proven job (--max-jobs-per-source %d); raise --max-jobs-per-source (many jobs behind one "
                        "address), or it is admitted once one of them ends", label, world, per_source,
                        self.limits.max_jobs_per_source)
            return reason
        log.warning("gradwatch aggregator: job %r (world %d) not admitted: every one of the %d --max-jobs slots holds "
                    "a proven job; raise --max-jobs, or it is admitted once a job's ranks are silent for --rank-ttl-s "
                    "(%g s)", label, world, self.limits.max_jobs, self.limits.rank_ttl_s)
        return reason

    def room(self, job: JobState, r: Optional[RankState], msg) -> Optional[str]:
        """A new rank of a job without a slot, past ``max_pending_ranks``: ``pending_ranks`` (its
        peers are heard again, each within a heartbeat, once the job has its slot), but its schema
        is kept (content-addressed, at most 2 x ``max_pending_ranks`` in all: a large job sends
        every schema before its first report, and resends it only every ``schema_every_s`` or
        more): :data:`HELD`, or ``schema_limit`` past the schema store's bounds. None for any
        other message."""
        limits = self.limits
        if r is not None or job.admitted or len(job.ranks) < limits.max_pending_ranks:
            return None
        if isinstance(msg, wire.Schema) and (msg.hash in job.schemas or len(job.schemas) < 2 * limits.max_pending_ranks):
            if msg.hash not in job.schemas:
                if not self.schemas.keep_schema(job, msg):
                    return "schema_limit"
                self.registry.version += 1
            return HELD
        return "pending_ranks"

    def _new_job(self, h: wire.Header, now: float, peer_key: Optional[str] = None) -> JobState:
        """A pending job for a new identity, evicting, when ``max_pending_jobs`` are held, the
        least recently heard pending job without a schema, or else the least recently heard (a
        job's first frame is its schema: frames of invented ids without one churn among
        themselves; ids sending schemas too must outpace a starting job's ranks, each heard about
        once a second); labelled as the module docstring says. (Ranks heard are no
        measure: a squatter claims as many as it likes, and keeps them with a frame a job.)"""
        jobs = self.registry.jobs
        pending = self.registry.pending()
        if len(pending) >= self.limits.max_pending_jobs:
            self.registry.evict(min(pending, key=lambda j: (bool(j.schemas), j.touched)))
        label = h.job
        old = jobs.get(label)
        if old is not None and old.peer_key in (None, peer_key) and old.processes_ended():
            # every process of the job under that id ended (not an agent switched off while its
            # training goes on): a relaunch under the same id (a new MASTER_PORT, so a new key)
            # takes the id over rather than a suffixed label; with CURVE, only under its key
            self.registry.drop(old, "job finished, its id taken by another")
        for n in (4, 8, 16):
            if label not in jobs:
                break
            label = f"{h.job}~{hashlib.blake2b(h.key.encode(), digest_size=8).hexdigest()[:n]}"
        while label in jobs:  # the same key prefix under a job id that looks like a label
            label += "~"
        return self.registry.add(identity(h), JobState(label, h.world, name=h.job, key=h.key, touched=now, peer_key=peer_key,
                                                       proven=self.limits.proof_steps == 0))

    def _vote(self, job: JobState, h: wire.Header, now: float) -> bool:
        """Record rank ``h.rank``'s vote, from a new boot, for restarting the job with world
        ``h.world``; True when the votes carry it (module docstring). Only the job's own ranks
        (below its world) vote: ranks past it are free to invent, so half a doubled world of them
        would restart a live job without claiming one live rank."""
        if h.rank >= job.world:
            return False
        job.votes[h.rank] = (h.boot, h.world, now)
        for rank, (_, _, when) in list(job.votes.items()):
            if now - when > self.limits.restart_grace_s:
                del job.votes[rank]
        agree = sum(1 for _, w, _ in job.votes.values() if w == h.world)
        if 2 * agree >= job.world:
            return True
        # the old incarnation is gone: every rank still under an old boot (not the boot it voted
        # with) has been silent for restart_grace_s
        return all(
            now - r.last_seen > self.limits.restart_grace_s
            for k, r in job.ranks.items() if k not in job.votes or job.votes[k][0] != r.boot
        )

    def step_limit(self, job: JobState, r: Optional[RankState], now: float) -> float:
        """Largest plausible step for the rank now: its latest step (or its peers' latest, if
        ahead) plus ``max(max_step_jump, 10 x its observed step rate x seconds since its latest
        report)``; before a rate is known, at most 1,000 steps/s are assumed. Unbounded before
        the job's first step (a new job, or an aggregator that restarted mid-run)."""
        if job.max_step < 0:
            return math.inf
        if r is None or r.steps == 0:
            return job.max_step + max(self.limits.max_step_jump, 1000 * (now - job.last_report_at))
        since = now - r.last_report_at
        if r.steps >= 2 and r.last_report_at > r.first_report_at:
            per_s = 10 * (r.steps - 1) / (r.last_report_at - r.first_report_at)  # 10x its rate
        else:
            per_s = 1000.0
        return max(r.step, job.max_step) + max(self.limits.max_step_jump, per_s * since)

    def _restart(self, job: JobState, h: wire.Header, now: float) -> JobState:
        """The job started over under its label: a new incarnation keeping its schemas and slot,
        the old incarnation's boots retired."""
        # the boots that spoke for the old incarnation: a rank whose agent restarted but did not
        # report since (boot_step >= 0) already speaks for the new one
        old = {r.prev_boot if r.boot_step >= 0 else r.boot for r in job.ranks.values()}
        old -= {b for b, _, _ in job.votes.values()} | {h.boot, ""}
        # bounded: a long run of restarts keeps the latest incarnations' boots only
        recent = now - job.retired_at <= self.limits.restart_grace_s and len(job.retired) < 4 * job.world + 64
        retired = job.retired | old if recent else old
        new = JobState(
            job.job, h.world, restarts=job.restarts + 1, retired=frozenset(retired), retired_at=now,
            name=job.name, key=job.key, admitted=job.admitted, touched=job.touched, peer_key=job.peer_key,
            proven=job.proven, source=job.source,
            schemas=job.schemas,  # content-addressed: the new incarnation's ranks resend the same
            schema_costs=job.schema_costs, schema_bytes=job.schema_bytes,
        )
        return self.registry.replace(job, new, "job restarted")
