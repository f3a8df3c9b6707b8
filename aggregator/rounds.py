"""Probed-step rounds: a job's open rounds, closing them, and reconciling them in slices.

A probed step's *round* collects one report per rank (:meth:`Rounds.add`); it is complete when
every rank of the world has reported, or closed incomplete ``grace_s`` after its first report
(:meth:`Rounds.expire`), when every rank missing from it has gone past the step
(:meth:`Rounds.passed`), or when more than ``max_pending`` wait. Its open rounds hold at most
``max_pending_bytes`` of report arrays; beyond it the oldest closes incomplete, so memory is
bounded per job. A closed round is reconciled (:mod:`.reconcile`): at once, or, with at least
``round_slice_ranks`` reports, in slices the writer runs between batches of frames
(:meth:`Rounds.advance`). While a round of a job is in slices, the job's checks' events wait
(:meth:`Rounds.event`) and run after it in the order they came: the checks see what they would have
seen had the round been reconciled at once. A reconciled round goes to the job within its series
allowance (:mod:`.series`) and to the checks.

A job not yet proven (:mod:`.admission`) is not judged: its released steps and reconciled rounds
are held, in order (at most :data:`.jobs.HELD_EVENTS`, the first ones), and given to the checks
when it is proven (:meth:`Rounds.prove`), so a fault in its first steps is still found; its ticks
and heartbeats go nowhere (they judge the job as it is when they come).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from gradwatch import wire

from .jobs import HELD_EVENTS, JobState, RankState, Registry
from .limits import Limits
from .reconcile import RoundResult, reconcile, reconcile_in_slices
from .series import allowance, cap_series, series_of

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


#: most rounds :attr:`Rounds.closing` holds; past it the oldest is reconciled to the end at once
MAX_CLOSING = 4


@dataclass(eq=False)
class Closing:
    """A closed round being reconciled: ``work`` (:func:`.reconcile.reconcile_in_slices`, None
    once done) and its ``result`` (None until done, or when its reconciliation failed)."""

    job: JobState
    work: Any = None
    result: Optional[RoundResult] = None
    nbytes: int = 0  # its reports' array bytes, in the job's pending_bytes until it is done


def nbytes(m: wire.Report) -> int:
    """Bytes of a probe report's arrays, every one :data:`gradwatch.wire.PROBE_ARRAYS` declares."""
    return sum(a.nbytes for a in (getattr(m, k) for k in wire.PROBE_ARRAYS) if a is not None)


class Rounds:
    """Every job's probed-step rounds (module docstring). The writer thread's.

    Args:
        registry: the jobs (a round of a job restarted or dropped since is dropped unfinished).
        limits: ``grace_s``, ``max_pending``, ``max_pending_bytes``, ``round_slice_ranks``,
            ``group_depth``, the series bounds.
        runner: the checks' runner (events ``on_round`` and those that wait behind a round), or None.
        reject: counts a failure of the aggregator's own (``reject("internal")``): a round whose
            reconciliation raised, a check's result that failed to apply.
        clock: the state's monotonic clock, seconds (a tick that waited behind a round runs at
            the clock of its turn).

    Attributes:
        closing: rounds closed but not reconciled yet (:class:`Closing`), oldest first.
    """

    def __init__(self, registry: Registry, limits: Limits, runner, reject: Callable[[str], None],
                 clock: Callable[[], float]):
        self.registry, self.limits, self.runner, self.reject, self.clock = registry, limits, runner, reject, clock
        self.closing: collections.deque = collections.deque()

    def add(self, job: JobState, r: RankState, m: wire.Report, now: float) -> Optional[str]:
        """A probe report of rank ``r``: held in its step's round, which closes once complete (or
        the oldest when too many rounds or bytes wait). ``unknown_schema`` when the job does not
        hold the report's schema (nothing held), else None."""
        r.probes += 1
        if m.schema not in job.schemas:
            return "unknown_schema"
        rnd = job.rounds.get(m.step)
        if rnd is None:
            rnd = job.rounds[m.step] = Round(m.step, now)
        size = nbytes(m)
        old = rnd.reports.get(r.rank)
        if old is not None:
            size -= nbytes(old)
        rnd.reports[r.rank] = m
        rnd.nbytes += size
        job.pending_bytes += size
        if len(rnd.reports) == job.world:
            self.close(job, rnd, complete=True)
        elif len(job.rounds) > self.limits.max_pending:
            self.close(job, job.rounds[min(job.rounds)], complete=False)
        while job.pending_bytes > self.limits.max_pending_bytes and job.rounds:  # memory bounded per job
            self.close(job, job.rounds[min(job.rounds)], complete=False)
        return None

    def passed(self, job: JobState, rank: int, upto: int) -> None:
        """The rank sent a record of step ``upto`` or later: the open rounds up to it without its
        report will never get it; one that waits for no other rank closes now (incomplete)."""
        for rnd in [x for x in job.rounds.values() if x.step <= upto and rank not in x.reports]:
            rnd.passed.add(rank)
            if len(rnd.reports) + len(rnd.passed) >= job.world:
                self.close(job, rnd, complete=False)

    def expire(self, job: JobState, now: float) -> None:
        """Close the job's rounds open for ``grace_s`` or longer (incomplete), oldest first."""
        for rnd in sorted(job.rounds.values(), key=lambda x: x.step):
            if now - rnd.opened >= self.limits.grace_s:
                self.close(job, rnd, complete=False)

    def reconciling(self, job: JobState) -> bool:
        """A round of ``job`` is in :attr:`closing`."""
        return any(c.job is job for c in self.closing)

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

    def close(self, job: JobState, rnd: Round, complete: bool) -> None:
        del job.rounds[rnd.step]
        if complete:
            job.rounds_complete += 1
        elif self._unscheduled(job, rnd):
            job.rounds_partial += 1
        else:
            job.rounds_incomplete += 1
        args = (job.world, job.schemas, rnd.step, rnd.reports, complete, job.layouts)
        if self.limits.round_slice_ranks and len(rnd.reports) >= self.limits.round_slice_ranks:
            # its reports stay in the job's pending_bytes until it is done: memory bounded per job;
            # its layers are merged for export here too, a slice of its own (a scrape would wait)
            item = Closing(job, reconcile_in_slices(*args, self.limits.group_depth), nbytes=rnd.nbytes)
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

    def event(self, method: str, job: JobState, *args) -> None:
        """A checks' event of the job, now or, while a round of it is reconciled in slices, after it
        (ticks then run once, at the clock of their turn: they judge the state as it is then)."""
        if self.runner is None:
            return
        if job.deferred is None:
            self._dispatch(method, job, args)
        elif method != "on_tick" or not job.deferred or job.deferred[-1] != ("on_tick", None):
            job.deferred.append((method, None if method == "on_tick" else args))

    def _dispatch(self, method: str, job: JobState, args: tuple) -> None:
        """Give the checks the event, once the job is proven; until then, hold a step or round event
        (the first :data:`.jobs.HELD_EVENTS`) and drop the others (module docstring)."""
        if job.proven:
            self.runner.dispatch(method, job, *args)
        elif method in ("on_steps", "on_round"):
            if job.held is None:
                job.held = collections.deque()
            if len(job.held) < HELD_EVENTS:
                job.held.append((method, args))
            else:
                job.held_dropped += 1

    def prove(self, job: JobState) -> None:
        """The job was just proven: the checks judge the events held for it, in order."""
        held, job.held = job.held, None
        if self.runner is None or not held:
            return
        for method, args in held:
            try:
                self.runner.dispatch(method, job, *args)
            except Exception:  # a bug of ours: the events after it still run
                self.reject("internal")

    def advance(self) -> bool:
        """Run one slice of the oldest round in :attr:`closing`; once its reconciliation is done,
        its result goes to the job and the checks, and so do the job's events that waited for it.
        A round of a job restarted or dropped since is dropped unfinished. Returns whether rounds
        are left. Raises what the reconciliation raised (that round is then skipped)."""
        if not self.closing:
            return False
        item = self.closing[0]
        if self.registry.jobs.get(item.job.job) is not item.job:  # its checks forgot the job: nobody waits
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
        if self.registry.jobs.get(job.job) is not job:  # restarted or dropped meanwhile: its checks forgot it
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
                    job.refresh_columns()
                self._dispatch(method, job, args if args is not None else (self.clock(),))
        job.deferred = None

    def _finish(self, job: JobState, result: RoundResult) -> None:
        # a straggling older round must not replace a newer result on the dashboards
        if job.last_round is None or result.step >= job.last_round.step:
            # first come, first served: the series other jobs export keep theirs (a newcomer's
            # schema cannot push a running job off the scrape), within max_series_total
            job.last_round, job.series_dropped = cap_series(result, allowance(self.registry.jobs.values(), job, self.limits))
            job.exported_series = series_of(job.last_round)
        self.registry.version += 1
        if self.runner is not None:
            self._dispatch("on_round", job, (result,))
