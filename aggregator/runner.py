"""The check runner: runs the enabled checks on a job's events, keeps their statuses and active
findings, and turns changes of the active set into events.

The state gives the runner every check event of a job (:meth:`Runner.dispatch`); the runner gives
each check the job's read-only view (:class:`.checks.view.JobView`), isolates its failures (a check
that raises is counted in ``gradwatch_check_errors_total{check}``, logged once, and never takes
the aggregator down) and records its :class:`~.checks.Evaluation`: *raised* when a finding's key
(rank, layer) appears, *resolved* when it goes, written to the event log, counted, sent to the
sinks and exported through :meth:`Runner.view`.

Overload. A check that judges silence (``judges_silence``: a rank or a step it did not hear of)
is not given ``on_tick`` for a job while the aggregator's intake drops that job's frames, nor for
``silent_after_s`` after the latest drop (``JobState.overloaded_at``): what the aggregator missed
proves nothing about the ranks. Its status and findings stay as they were, as if it returned None.

Knock-on. A fault's effects on another check are part of that fault (one fault, one finding):
``knock_on_of`` names the checks whose finding explains a finding of this one in the same job
(``training_stalled`` of ``rank_silent``: the peers of a silent rank wait for it; ``replica_drift``
of ``grad_agreement``: the weights a desynced gradient updated differ from then on). The
:class:`Runner` folds a *new* finding of such a check while a finding of one of its causes is
active in the same job, or resolved within ``knock_on_window_s`` (wall clock): it is not raised
(no event, not among the active findings, so no ``gradwatch_check_rank_flagged`` series and no
alert names its rank), the cause's finding lists it in ``details["knock_on"]`` (an *updated*
event), and it is counted in ``gradwatch_findings_folded_total``. The cause of the same rank is
preferred, then an active one; while the cause is active a knock-on naming another rank is folded
too (that rank is the fault's victim, not a second fault), once it resolved only one naming its
rank or none (a rank hung after another came back is a fault of its own). A job-level cause (two
tensor-parallel holders tied, a desync in world 2) folds only a knock-on that names no rank either:
it does not say whose fault it is, and a knock-on naming the rank (the bit flip's drift that the
tie-break decided) carries more than it and stays raised. The cause's finding stays active, without a
*resolved* event, while a knock-on folded into it is still reported, even when its own check no
longer reports it (a desync's gradient agrees again at the next step while the replicas it left
different still differ): a cause resolved within the window is reopened (an *updated* event), and
it resolves when it is no longer reported and its last knock-on went. A knock-on going emits
nothing of its own. The folded check's status stays what its evaluation says (``finding``: the
check did find); only the finding is folded. Names are checked when the registry is loaded and
when a :class:`Runner` starts (:func:`.checks.check_knock_ons`): every name a registered check, never the
check itself nor a check that is itself a knock-on (one level: a cause is always raised).
"""

from __future__ import annotations

import collections
import json
import logging
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional

from pydantic import BaseModel

from .checks import CHECKS, Check, Evaluation, Finding, Outcome, check_knock_ons, load_all
from .checks.view import JobView

log = logging.getLogger("gradwatch.aggregator")


def _handlers(checks: dict[str, Check], method: str) -> dict[str, Check]:
    """The checks whose class overrides ``method`` (the others' is :class:`Check`'s, returning None)."""
    return {n: c for n, c in checks.items() if getattr(type(c), method) is not getattr(Check, method)}



@dataclass(frozen=True)
class Event:
    """A finding raised, updated or resolved, as written to the event log and served at
    /api/findings. *updated*: a knock-on was folded into an active finding (``details["knock_on"]``),
    or reopened one resolved within ``knock_on_window_s``, or details were added to it
    (:meth:`Runner.annotate`: where a hung rank is stuck, a halt); *raised* and *updated* go to the
    sinks."""

    event: str  # raised | updated | resolved
    time: float  # wall clock, seconds since the epoch
    check: str
    severity: str
    job: str
    step: int
    rank: Optional[int]
    layer: Optional[str]
    summary: str
    details: dict

    def to_json(self) -> str:
        return json.dumps(asdict(self), default=_json_default, allow_nan=False)


def _json_default(o: Any):
    try:
        import numpy as np

        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
    except ImportError:
        pass
    return str(o)


def json_safe(x):
    """``x`` as JSON can carry it: JSON has no NaN, so non-finite floats become strings ("nan",
    "inf"); dict keys become strings, tuples lists, numpy scalars Python numbers."""
    if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
        return str(x)
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    try:
        import numpy as np

        if isinstance(x, np.generic):
            return json_safe(x.item())
    except ImportError:
        pass
    return x


class Runner:
    """Runs the enabled checks, isolates their failures, keeps statuses and the active findings.
    While a job is overloaded it does not give ``on_tick`` to the checks that judge silence
    (``Check.judges_silence``), and it folds a check's knock-on findings into their cause's
    (``Check.knock_on_of``, ``knock_on_window_s`` on ``wall``); see the module docstring. Per job
    and cause check it keeps at most :attr:`RECENT` resolved findings for the window and lists at
    most :attr:`KNOCK_ON_MAX` knock-ons per finding (``knock_on_n`` counts them all).

    Args:
        names: checks to run (see :func:`resolve`).
        thresholds: their configuration.
        events_path: JSON-lines file to append events to ('' for none).
        sinks: callables receiving each raised and updated :class:`Event` (e.g. a Grafana
            annotation poster, the control room).
        wall: wall clock, seconds since the epoch.

    Raises:
        ValueError: a check's ``knock_on_of`` is invalid (:func:`check_knock_ons`).
    """

    #: resolved findings per (job, cause check) kept for knock_on_window_s (the newest)
    RECENT = 8
    #: knock-ons listed in one cause finding's details (the first ones; knock_on_n counts all)
    KNOCK_ON_MAX = 16
    #: ranks whose latest raised finding's time is kept, per job and check (a finding naming
    #: another rank is still counted in ``raised``): the per-rank series stay bounded whatever a
    #: job does, and the ranks a fault names first are the ones kept
    RANKS_TIMED_MAX = 64

    def __init__(self, names: list[str], thresholds: BaseModel, events_path: str = "", sinks=(), wall=time.time):
        load_all()
        check_knock_ons({n: CHECKS[n] for n in names})
        self.checks = {n: CHECKS[n](thresholds) for n in names}
        self.t = thresholds
        self.status: dict[tuple[str, str], Outcome] = {}
        self.active: dict[tuple[str, str], dict[tuple, Finding]] = {}
        self.raised = collections.Counter()  # (job, check) -> findings raised
        self.raised_at: dict[tuple[str, str, int], float] = {}  # (job, check, rank) -> wall time of its latest
        self._ranks_timed = collections.Counter()  # (job, check) -> ranks in raised_at
        self.errors = collections.Counter()  # check -> exceptions
        self.seconds = collections.Counter()  # check -> time spent
        self.events: collections.deque[Event] = collections.deque(maxlen=1000)
        self._warned: set[str] = set()
        self._wall = wall
        self._sinks = list(sinks)
        self._log = open(events_path, "a", encoding="utf-8") if events_path else None
        self._handlers: dict[str, dict[str, Check]] = {}  # event -> the checks that handle it
        self._ready: set[str] = set()  # jobs every check has a status for
        self._views: dict[str, tuple] = {}  # job label -> (its job state, the view checks get of it)
        self._silence = {n for n, c in self.checks.items() if c.judges_silence}
        # knock-ons (module docstring): check -> its enabled causes, cause -> the checks it explains
        self._causes = {n: tuple(p for p in c.knock_on_of if p in self.checks) for n, c in self.checks.items()}
        self._causes = {n: ps for n, ps in self._causes.items() if ps}
        self._explains: dict[str, tuple[str, ...]] = {}
        for n, ps in self._causes.items():
            for p in ps:
                self._explains[p] = (*self._explains.get(p, ()), n)
        self.folded = collections.Counter()  # (job, check) -> findings folded into a cause's
        self._folded: dict[tuple[str, str], dict[tuple, tuple[str, tuple]]] = {}  # (job, C) -> key -> (P, P's key)
        self._knock: dict[tuple[str, str], dict[tuple, tuple[list, int]]] = {}  # (job, P) -> key -> (knock-ons, n)
        self._held: dict[tuple[str, str], set[tuple]] = {}  # (job, P) -> keys P no longer reports, kept for knock-ons
        self._recent: dict[tuple[str, str], collections.deque] = {}  # (job, P) -> (wall time, resolved Finding)
        self._notes: dict[tuple[str, str], dict[tuple, dict]] = {}  # (job, check) -> key -> details annotated

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def dispatch(self, method: str, job, *args) -> None:
        """Give ``job``'s event ``method`` (``on_steps``, ``on_heartbeat``, ``on_round``,
        ``on_tick``) with ``args`` to the checks that handle it, each with the job's read-only
        view, and record their evaluations (module docstring). ``job``: the aggregator's
        ``jobs.JobState`` (any object with ``job`` and ``overloaded_at`` will do)."""
        cached = self._views.get(job.job)
        if cached is None or cached[0] is not job:  # a new job, or a new incarnation of it
            cached = self._views[job.job] = (job, JobView(job))
        view = cached[1]
        todo = self._handlers.get(method)
        if todo is None:
            todo = self._handlers[method] = _handlers(self.checks, method)
        first = job.job not in self._ready
        if first:
            todo = self.checks  # a job's first event gives every check its status, in check order
        # the intake dropped some of this job's frames lately: silence may be the aggregator's own
        muted = (bool(self._silence) and method == "on_tick"
                 and args[0] - job.overloaded_at < self.t.silent_after_s)  # args: (now,)
        # a check without this handler has nothing to say (``Check``'s returns None), so once it
        # has a status for the job it is not called (per released step, most checks are not)
        for name, check in todo.items():
            if muted and name in self._silence:
                ev = None  # as if it had nothing to say: its status and findings stay
            else:
                t0 = time.perf_counter()
                try:
                    ev = getattr(check, method)(view, *args)
                except Exception as e:
                    self.errors[name] += 1
                    if name not in self._warned:
                        self._warned.add(name)
                        log.exception("gradwatch: check %s failed (counted, later failures not logged): %r", name, e)
                    ev = None
                self.seconds[name] += time.perf_counter() - t0
            if ev is None and (job.job, name) not in self.status:
                ev = Evaluation.no_data()  # every check has a status from a job's first event: fixed series
            if isinstance(ev, list):  # one per judged step, in order (on_steps)
                for e in ev:
                    self._record(job.job, check, e)
            elif ev is not None:
                self._record(job.job, check, ev)
        if first:
            self._ready.add(job.job)

    def _record(self, job: str, check: Check, ev: Evaluation) -> None:
        k = (job, check.name)
        self.status[k] = ev.outcome  # a folded finding's check still says it found (module docstring)
        before = self.active.get(k, {})
        # a check that can no longer judge (no_data) stands behind none of its earlier findings
        now = {f.key: self._noted(k, f) for f in ev.findings} if ev.outcome != Outcome.NO_DATA else {}
        if check.name not in self._causes and check.name not in self._explains:
            for key, f in now.items():
                if key not in before:
                    self._raise(k, check, f)
            for key, f in before.items():
                if key not in now:
                    self._emit("resolved", check, f)
            self.active[k] = now
            return
        causes = self._causes.get(check.name, ())
        folded = self._folded.get(k, {})
        held = self._held.get(k, set())
        active: dict[tuple, Finding] = {}
        still: dict[tuple, tuple[str, tuple]] = {}  # the knock-ons this check still reports -> their cause
        for key, f in now.items():
            if key in before:
                held.discard(key)  # reported again by its own check
                active[key] = self._with_knock(k, key, f)
            elif key in folded:
                still[key] = folded[key]
            elif causes and (cause := self._cause(job, causes, f)) is not None:
                still[key] = cause
                self._fold(job, f, cause)
            else:
                active[key] = f
                self._raise(k, check, f)
        for key, f in before.items():
            if key in now:
                continue
            if self._explained(job, check.name, key):  # a knock-on still reported: the fault lasts
                held.add(key)
                active[key] = f
            else:
                held.discard(key)
                self._resolve(job, check, f)
        self.active[k] = active
        if held:
            self._held[k] = held
        else:
            self._held.pop(k, None)
        if causes:
            if still:
                self._folded[k] = still
            else:
                self._folded.pop(k, None)
            for p, pkey in set(folded.values()) - set(still.values()):  # its last knock-on may have gone
                pk = (job, p)
                if pkey in self._held.get(pk, ()) and not self._explained(job, p, pkey):
                    self._held[pk].discard(pkey)
                    self._resolve(job, self.checks[p], self.active[pk].pop(pkey))

    def annotate(self, job: str, check: str, key: tuple, details: dict) -> bool:
        """Add ``details`` to the active finding of ``check`` in ``job`` whose key (rank, layer)
        is ``key``, for as long as it stays active (each evaluation of the check keeps them), and
        emit an *updated* event. False when no such finding is active (resolved meanwhile)."""
        k = (job, check)
        f = self.active.get(k, {}).get(key)
        if f is None or check not in self.checks:
            return False
        self._notes.setdefault(k, {}).setdefault(key, {}).update(details)
        f = self.active[k][key] = self._noted(k, f)
        self._emit("updated", self.checks[check], f)
        return True

    def _noted(self, k: tuple[str, str], f: Finding) -> Finding:
        """``f`` with the details :meth:`annotate` added to its key's finding."""
        notes = self._notes.get(k, {}).get(f.key) if self._notes else None
        return replace(f, details={**f.details, **notes}) if notes else f

    def _raise(self, k: tuple[str, str], check: Check, f: Finding) -> None:
        """Count ``f`` raised, keep when for its rank (one of the first :attr:`RANKS_TIMED_MAX`
        ranks of the job and check named), and emit it."""
        self.raised[k] += 1
        if f.rank is not None:
            rk = (*k, int(f.rank))
            if rk in self.raised_at or self._ranks_timed[k] < self.RANKS_TIMED_MAX:
                self._ranks_timed[k] += rk not in self.raised_at
                self.raised_at[rk] = self._wall()
        self._emit("raised", check, f)

    def _cause(self, job: str, causes: tuple[str, ...], f: Finding) -> Optional[tuple[str, tuple]]:
        """The finding of a cause check that explains ``f``: (check, key) of an active one, or of
        one resolved within knock_on_window_s naming ``f``'s rank (or ``f`` names none); the same
        rank first, then an active one. A job-level cause (a tie of two tensor-parallel holders, a
        desync in world 2) only for an ``f`` that names no rank either: it does not say whose fault
        it is, and a finding that names the rank (the bit flip's drift) must stay raised, not be
        folded under it."""
        best, best_score = None, None
        for p in causes:
            active = self.active.get((job, p), {})
            for key, g in active.items():
                if g.rank is None and f.rank is not None:
                    continue  # a job-level finding says no rank's fault: it claims no rank's finding as its effect
                score = (g.rank != f.rank, 0)
                if best_score is None or score < best_score:
                    best, best_score = (p, key), score
            recent = self._recent.get((job, p))
            if recent and self.t.knock_on_window_s > 0:
                now = self._wall()
                while recent and now - recent[0][0] > self.t.knock_on_window_s:
                    recent.popleft()  # oldest first: past the window
                for _, g in recent:
                    score = (g.rank != f.rank, 1)
                    # a resolved fault explains a later finding of its own rank or of none, never
                    # another rank's: that one is a fault of its own (a rank back from silence, another
                    # hung); a job-level one only a finding of none
                    if f.rank is not None and g.rank != f.rank:
                        continue
                    if g.key not in active and (best_score is None or score < best_score):
                        best, best_score = (p, g.key), score
        return best

    def _fold(self, job: str, f: Finding, cause: tuple[str, tuple]) -> None:
        """Fold the new finding ``f`` into its cause's finding: listed there, an *updated* event."""
        p, pkey = cause
        pk = (job, p)
        self.folded[(job, f.check)] += 1
        active = self.active.setdefault(pk, {})
        if pkey not in active:  # resolved within the window: reopened while the knock-on lasts
            recent = self._recent[pk]
            i = max(i for i, (_, g) in enumerate(recent) if g.key == pkey)
            _, g = recent[i]
            del recent[i]
            active[pkey] = g
            self._held.setdefault(pk, set()).add(pkey)
            self._knock.setdefault(pk, {})[pkey] = (list(g.details.get("knock_on", [])), g.details.get("knock_on_n", 0))
        knocks, n = self._knock.setdefault(pk, {}).get(pkey, ([], 0))
        if len(knocks) < self.KNOCK_ON_MAX:
            knocks = [*knocks, {"check": f.check, "step": f.step, "rank": f.rank, "layer": f.layer, "summary": f.summary}]
        self._knock[pk][pkey] = (knocks, n + 1)
        g = active[pkey] = self._with_knock(pk, pkey, active[pkey])
        self._emit("updated", self.checks[p], g)

    def _with_knock(self, pk: tuple[str, str], key: tuple, f: Finding) -> Finding:
        """``f`` with the knock-ons folded into it in its details (``knock_on``, ``knock_on_n``)."""
        got = self._knock.get(pk, {}).get(key)
        if got is None:
            return f
        return replace(f, details={**f.details, "knock_on": got[0], "knock_on_n": got[1]})

    def _explained(self, job: str, p: str, key: tuple) -> bool:
        """Whether a knock-on folded into cause ``p``'s finding ``key`` is still reported."""
        return any((p, key) in self._folded.get((job, c), {}).values() for c in self._explains.get(p, ()))

    def _resolve(self, job: str, check: Check, f: Finding) -> None:
        self._emit("resolved", check, f)
        if check.name in self._explains:  # a cause: knock-ons within the window still fold into it
            self._knock.get((job, check.name), {}).pop(f.key, None)
            recent = self._recent.setdefault((job, check.name), collections.deque(maxlen=self.RECENT))
            recent.append((self._wall(), f))

    def _emit(self, kind: str, check: Check, f: Finding) -> None:
        if kind == "resolved" and self._notes:
            self._notes.get((f.job, f.check), {}).pop(f.key, None)
        e = Event(kind, self._wall(), f.check, check.severity, f.job, f.step, f.rank, f.layer, f.summary, json_safe(f.details))
        self.events.append(e)
        (log.warning if kind == "raised" else log.info)("gradwatch %s %s in job %r: %s", kind, f.check, f.job, f.summary)
        if self._log is not None:
            try:
                self._log.write(e.to_json() + "\n")
                self._log.flush()
            except (OSError, ValueError) as err:  # a full disk must not stop the checks
                self.errors["event_log"] += 1
                if "event_log" not in self._warned:
                    self._warned.add("event_log")
                    log.error("gradwatch: cannot append to the event log (counted, not logged again): %r", err)
        if kind != "resolved":
            for sink in self._sinks:
                try:
                    sink(e)
                except Exception as err:  # a dashboard being down must not stop the checks
                    log.debug("gradwatch: event sink failed: %r", err)

    def forget(self, job: str, why: str = "job forgotten") -> None:
        """Drop everything kept for ``job``; its active findings are resolved first, each event's
        details saying ``why`` (``details["resolved_because"]``): the event log and
        /api/findings must not show them raised forever."""
        self._ready.discard(job)
        self._views.pop(job, None)
        for name, c in self.checks.items():
            for f in list(self.active.get((job, name), {}).values()):
                self._emit("resolved", c, replace(f, details={**f.details, "resolved_because": why}))
        for name, c in self.checks.items():
            c.forget(job)
            self.status.pop((job, name), None)
            self.active.pop((job, name), None)
            self.raised.pop((job, name), None)
            self._ranks_timed.pop((job, name), None)
            self.folded.pop((job, name), None)
            for d in (self._folded, self._knock, self._held, self._recent, self._notes):
                d.pop((job, name), None)
        for rk in [rk for rk in self.raised_at if rk[0] == job]:
            del self.raised_at[rk]

    def named_ranks(self, jobs) -> dict[str, set]:
        """``{job: ranks its active findings name}`` for each of ``jobs``."""
        out: dict[str, set] = {job: set() for job in jobs}
        for (job, _), found in self.active.items():
            if job in out:
                out[job].update(f.rank for f in found.values() if isinstance(f.rank, int))
        return out

    def view(self, few: Optional[dict] = None) -> "RunnerView":
        """An immutable copy of the runner's state. ``few``: ``{job: ranks}`` for jobs whose
        per-rank values (metrics with a ``rank`` label) are copied for these ranks only (the
        exporter exports no others of a job over ``--rank-series-max`` ranks; at 16,384 ranks the
        copy of every rank's took ~4 % of the writer)."""
        values: dict[str, dict[tuple, float]] = collections.defaultdict(dict)
        jobs = {j for j, _ in self.status} | {j for j, _ in self.active}
        for name, c in self.checks.items():
            for job in jobs:
                keep = few.get(job) if few else None
                try:
                    for metric, series in c.values(job).items():
                        labels_of = c.metrics[metric][1]
                        if keep is not None and "rank" in labels_of:
                            if labels_of == ("rank",):
                                series = {(str(k),): series[(str(k),)] for k in keep if (str(k),) in series}
                            else:
                                i, ks = labels_of.index("rank"), {str(k) for k in keep}
                                series = {lv: v for lv, v in series.items() if lv[i] in ks}
                        for labels, v in series.items():
                            values[metric][(job, *labels)] = float(v)
                except Exception:
                    self.errors[name] += 1
        return RunnerView(
            status=tuple(sorted((j, c, o.value) for (j, c), o in self.status.items())),
            active=tuple(f for fs in self.active.values() for f in fs.values()),
            raised=tuple(sorted(self.raised.items())),
            raised_at=tuple(sorted(self.raised_at.items())),
            folded=tuple(sorted(self.folded.items())),
            errors=tuple(sorted(self.errors.items())),
            seconds=tuple(sorted(self.seconds.items())),
            events=tuple(self.events),
            values={k: dict(v) for k, v in values.items()},
            severity={n: c.severity for n, c in self.checks.items()},
        )


@dataclass(frozen=True)
class RunnerView:
    """Immutable copy of the runner's state for the exporter and the HTTP API."""

    status: tuple = ()
    active: tuple = ()
    raised: tuple = ()
    raised_at: tuple = ()  # ((job, check, rank), wall time of the latest finding raised naming the rank)
    folded: tuple = ()  # ((job, check), findings folded into a cause's as knock-ons)
    errors: tuple = ()
    seconds: tuple = ()
    events: tuple = ()
    values: dict = field(default_factory=dict)
    severity: dict = field(default_factory=dict)

