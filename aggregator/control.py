"""The control channel: commands to the agents, their answers, where a hung rank is stuck, halts.

Agents connect a DEALER socket to the aggregator's ROUTER (:mod:`.intake`); commands go back on
the connection a rank's frames come on. This room keeps:

* **routes**: per admitted job and rank, the boot and the routing id of its latest accepted frame
  (:meth:`Control.heard`), forgotten with the rank or its boot (:meth:`Control.refresh`): a command
  goes only to a connection the rank spoke on, and only while the aggregator holds the rank;
* **the outbox** (:class:`Outbox`): commands for the intake thread, the socket's only user, to
  send (a bounded queue: when full a command is dropped and counted, as is one the socket cannot
  route or its connection's queue is full);
* **requests**: what was asked of which ranks, with a deadline; an answer (``wire.Stack`` or
  ``wire.Ack``) counts only from a rank asked, on the connection the command went to
  (:meth:`Control.answer`); others are counted and dropped. At most :data:`REQUESTS_PER_S`
  requests a second per job (:data:`REQUEST_BURST` at once), :data:`MAX_REQUESTS` open at once;
* **where a rank is stuck**: when ``training_stalled``, ``straggler`` or ``rank_silent`` raises a
  finding naming a rank (:meth:`Control.on_event`, a sink of the check runner), the training
  thread's stack is asked
  of that rank and of one healthy rank (the lowest other rank no active finding names); once both
  answered, or after :data:`FINDING_WAIT_S`, the finding is updated (an *updated* event) with
  ``details["stacks"]``: ``stuck`` and ``healthy`` (``rank``, ``frames`` outermost first,
  innermost last, each ``file``, ``line``, ``function``, and ``source`` when the agent sends
  source lines; ``flight``: torch's Flight Recorder entries when the agent read them) and
  ``differ_at``: the index of the first frame, from the outermost, where the two stacks differ
  (None when they do not), or, when the stuck rank did not answer, why that may be;
* **halts**: for a job whose every rank's schema announces the check (``halt_on``, the agents'
  ``on_critical="halt"``), a critical finding of that check sends ``halt`` to every rank of the
  job, once per finding, at step ``H`` = the job's highest latest step + :func:`margin`; the
  finding's details record it (``details["halt"]``: ``step``, ``ranks``), and the log says so. A
  finding raised while an earlier one's halt stands (:data:`COMMAND_TTL_S`) sends none: its
  details name the same step (``sent`` false), so every rank stops at one step. No halt follows
  while a rank's identity is unsettled (:data:`HALT_SETTLE_S`): ``details["halt"]["withheld"]``
  says why;
* **on demand** (the HTTP API, :mod:`.web`): :meth:`Control.stacks` (every rank's stack, or one
  rank's, grouped by identical frames), :meth:`Control.probe` and :meth:`Control.budget` (a probe
  window, or another budget, at every rank of a job, from the same start step).

Threads: the writer thread tells it what it hears (:meth:`heard`, :meth:`answer`, :meth:`refresh`,
:meth:`tick`, :meth:`on_event`); the HTTP server's threads ask (:meth:`stacks`, :meth:`probe`,
:meth:`budget`) and wait for the answers; the intake thread sends. One lock guards it all; nobody
waits holding it.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import secrets
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from gradwatch import wire

log = logging.getLogger("gradwatch.aggregator")

#: checks whose finding naming a rank makes the aggregator ask where that rank is stuck (a silent
#: rank's answer says whether its process runs at all: none comes from one stopped, or whose
#: training thread holds the GIL)
STACK_CHECKS = ("training_stalled", "straggler", "rank_silent")
#: seconds a finding's stacks are waited for before the finding is updated with what came
FINDING_WAIT_S = 5.0
#: default and longest wait of an HTTP request for its answers, seconds
WAIT_S, MAX_WAIT_S = 3.0, 10.0
#: requests a second per job (a request asks one rank or every rank), and how many at once
REQUESTS_PER_S, REQUEST_BURST = 5.0, 10
#: requests open at once, every job together
MAX_REQUESTS = 256
#: commands waiting for the intake thread; past it a command is dropped and counted
MAX_OUTBOX = 8192
#: seconds a command lives (the agent refuses it once expired): stacks and acks are waited for
#: a few seconds, a probe or budget window must start before its start step passes, a halt is
#: for the step named
COMMAND_TTL_S = {"stacks": 30.0, "probe": 60.0, "budget": 60.0, "halt": 120.0}
#: seconds of delivery the start step of a probe window or a halt leaves the ranks
DELIVERY_S = 1.0
#: findings a job keeps halted ids of (once per finding), and a job's halts in the log
HALTED_MAX = 1024
#: seconds after another process claimed one of a job's ranks (a frame of another boot rejected as
#: ``boot_conflict``), or after a rank came back alone under a new boot, during which no finding
#: halts the job: over plain TCP a frame's identity is its word, and a rank's records from a
#: disputed identity may be forged; the finding is raised as usual, its halt withheld
HALT_SETTLE_S = 30.0


def margin(step_s: float) -> int:
    """Steps between a job's highest latest step and the step a command names, so that every rank
    gets it before it gets there: ``max(2, ceil(DELIVERY_S / step_s))`` (``step_s``: the median
    step time, seconds; 2 when unknown)."""
    if not (step_s > 0 and math.isfinite(step_s)):
        return 2
    return max(2, math.ceil(DELIVERY_S / step_s))


def _unsettled(job, now: float) -> str:
    """Why a halt of ``job`` (``jobs.JobState``) is not believed at ``now``: a rank another process
    claimed, or one that came back alone under a new boot, within :data:`HALT_SETTLE_S`; "" when
    none did."""
    for r in job.ranks.values():
        if now - r.disputed_at < HALT_SETTLE_S:
            return f"another process claimed rank {r.rank} {now - r.disputed_at:.0f} s ago"
        if now - r.took_over_at < HALT_SETTLE_S:
            return f"rank {r.rank} came back under a new boot {now - r.took_over_at:.0f} s ago"
    return ""


class ControlError(Exception):
    """A control request that cannot be made: ``status`` the HTTP status that says why (404 no
    such job, 409 nothing to ask, 429 too many requests, 503 queue full)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Outbox:
    """Commands waiting for the intake thread (bounded: :data:`MAX_OUTBOX`); any thread puts, the
    intake thread takes and reports what it sent and what the socket refused.

    Attributes:
        sent_n, dropped_n: commands sent, and dropped (queue full, unroutable, the connection's
            queue full).
    """

    def __init__(self, most: int = MAX_OUTBOX):
        self._q: collections.deque = collections.deque()
        self._most = most
        self._lock = threading.Lock()
        self.sent_n = self.dropped_n = 0

    def put(self, rid: bytes, frame: bytes) -> bool:
        """Queue ``frame`` for the connection ``rid``; False (counted) when full."""
        with self._lock:
            if len(self._q) >= self._most:
                self.dropped_n += 1
                return False
            self._q.append((rid, frame))
            return True

    def take(self, most: int) -> list:
        """Intake thread: up to ``most`` ``(routing id, frame)``, oldest first."""
        if not self._q:
            return []
        with self._lock:
            n = min(most, len(self._q))
            return [self._q.popleft() for _ in range(n)]

    def sent(self, n: int) -> None:
        with self._lock:
            self.sent_n += n

    def dropped(self, n: int) -> None:
        with self._lock:
            self.dropped_n += n

    def __len__(self) -> int:
        return len(self._q)


@dataclass
class JobInfo:
    """What the control room knows of a job, refreshed by the writer (:meth:`Control.refresh`)."""

    max_step: int = -1  # the highest latest step of its ranks
    step_s: float = math.nan  # median step time over (a sample of) its ranks, seconds
    halt_on: frozenset = frozenset()  # the checks every rank's schema says may halt it
    name: str = ""  # the job id its ranks send
    unsettled: str = ""  # why no halt is believed now (HALT_SETTLE_S); "" when one may be


@dataclass
class Request:
    """One command sent to one rank or every routed rank of a job, and the answers so far."""

    id: int
    job: str
    kind: str
    asked: dict  # rank -> routing id the command went to
    deadline: float  # aggregator clock
    purpose: tuple = ()  # ("finding", check, key, stuck rank, healthy rank) or () for a caller waiting
    answers: dict = field(default_factory=dict)  # rank -> wire.Stack | wire.Ack
    done: threading.Event = field(default_factory=threading.Event)
    step: int = -1  # the step a probe or halt names

    @property
    def complete(self) -> bool:
        return len(self.answers) >= len(self.asked)


def frames_of(stack: wire.Stack) -> list[dict]:
    """A stack's frames as JSON: ``{file, line, function[, source]}``, outermost first."""
    return [dict(file=f.file, line=f.line, function=f.function, **({"source": f.source} if f.source else {}))
            for f in stack.frames]


def differ_at(a: list[dict], b: list[dict]) -> Optional[int]:
    """Index of the first frame, from the outermost, where stacks ``a`` and ``b`` differ (file,
    line or function); the shorter one's length when one continues the other; None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if (x["file"], x["line"], x["function"]) != (y["file"], y["line"], y["function"]):
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _rank_stack(rank: int, stack) -> dict:
    out: dict = {"rank": rank}
    if isinstance(stack, wire.Stack):
        out["frames"] = frames_of(stack)
        out["in_step_s"] = stack.in_step_s
        out["waiting"] = stack.waiting
        if stack.flight:
            out["flight"] = [[e.collective, e.state, e.sequence] for e in stack.flight]
        if stack.flight_error:
            out["flight_error"] = stack.flight_error
        if stack.error:
            out["error"] = stack.error
    else:
        out["frames"] = []
        out["error"] = "no answer" if stack is None else f"refused: {stack.why}"
    return out


class Control:
    """The control room (module docstring).

    Args:
        clock: the aggregator's monotonic clock, seconds.
        wall: wall clock, seconds since the epoch (commands' ``issued`` and ``expires``).
        annotate: ``(job, check, key, details)``: merge ``details`` into the active finding of
            ``check`` in ``job`` with ``key`` (rank, layer) and emit an *updated* event
            (:meth:`.runner.Runner.annotate`); None: findings are not updated.
        named: ``job -> set of ranks`` its active findings name (:meth:`.runner.Runner.named_ranks`).

    Attributes:
        outbox: what the intake thread sends.
        counts: ``Counter`` of what happened: ``requests``, ``commands`` (put in the outbox),
            ``answers`` (taken), ``answers_rejected`` (from a rank not asked, on another
            connection, or too late), ``refused`` (acks refusing a command), ``throttled``
            (requests over the job's rate), ``halts`` (findings that halted a job),
            ``halts_withheld`` (findings that would have, of a job whose ranks' identity was
            unsettled: :data:`HALT_SETTLE_S`).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 annotate: Optional[Callable] = None, named: Optional[Callable] = None):
        self.clock, self.wall = clock, wall
        self.annotate, self.named = annotate, named
        self.outbox = Outbox()
        self.counts: collections.Counter = collections.Counter()
        self._lock = threading.Lock()
        self._routes: dict[str, dict[int, tuple[str, bytes]]] = {}  # job -> rank -> (boot, routing id)
        self._jobs: dict[str, JobInfo] = {}
        self._requests: dict[int, Request] = {}
        self._tokens: dict[str, tuple[float, float]] = {}  # job -> (tokens, clock of the last refill)
        self._halted: dict[str, set] = {}  # job -> keys of the findings that halted it
        self._halting: dict[str, tuple] = {}  # job -> (step, ranks, clock until which it stands) of its halt
        self._due: list = []  # (job, check, key, details) to annotate at the next tick (the writer's)

    # --- what the writer hears ------------------------------------------------------------------

    def heard(self, job: str, rank: int, boot: str, rid: bytes) -> None:
        """Writer thread: an accepted frame of admitted job ``job``'s ``rank`` (boot ``boot``)
        came on connection ``rid``."""
        ranks = self._routes.get(job)
        if ranks is not None and ranks.get(rank) == (boot, rid):
            return  # the common case: nothing changed, no lock taken
        with self._lock:
            self._routes.setdefault(job, {})[rank] = (boot, rid)

    def refresh(self, jobs: dict, full: bool = True, now: Optional[float] = None) -> None:
        """Writer thread: ``jobs`` (label -> ``jobs.JobState``) as they are now: each admitted
        job's highest step and median step time (over at most 64 of its ranks); with ``full``
        also its ``halt_on`` (what every rank's schema allows) and, for a job that allows any,
        whether a rank's identity is unsettled (:data:`HALT_SETTLE_S`; ``now``: the clock the
        ranks' times are on, default :attr:`clock`), and the routes of ranks gone (or of another
        boot) and of jobs gone are forgotten. The daemon refreshes at every tick, in full once a
        second."""
        now = self.clock() if now is None else now
        info: dict[str, JobInfo] = {}
        for label, job in jobs.items():
            if not job.admitted:
                continue
            times = [r.step_time for r in itertools.islice(job.ranks.values(), 64)
                     if r.step_time > 0 and math.isfinite(r.step_time)]
            halt, unsettled = None, ""
            if full:
                for r in job.ranks.values():
                    h = frozenset(r.halt_on)
                    halt = h if halt is None else halt & h
                    if not halt:
                        break
                if halt:
                    unsettled = _unsettled(job, now)
            else:
                old = self._jobs.get(label)
                halt, unsettled = (old.halt_on, old.unsettled) if old is not None else (frozenset(), "")
            info[label] = JobInfo(job.max_step, statistics.median(times) if times else math.nan,
                                  halt or frozenset(), job.name or label, unsettled)
        with self._lock:
            self._jobs = info
            if not full:
                return
            for label in list(self._routes):
                job = jobs.get(label)
                if job is None or not job.admitted:
                    del self._routes[label]
                    self._tokens.pop(label, None)
                    self._halted.pop(label, None)
                    self._halting.pop(label, None)
                    continue
                routes = self._routes[label]
                for rank in [k for k, (boot, _) in routes.items() if (r := job.ranks.get(k)) is None or r.boot != boot]:
                    del routes[rank]

    def answer(self, msg, rid: Optional[bytes], label: Optional[str]) -> bool:
        """Writer thread: a ``wire.Stack`` or ``wire.Ack`` from the job labelled ``label`` (None:
        no job of that identity) on connection ``rid``; False (counted) unless it answers a
        request open for that rank, and came on the connection the command went to."""
        with self._lock:
            req = self._requests.get(msg.command)
            rank = msg.header.rank
            # a stack answers only a stacks command; an ack any (refusing a stacks command)
            fits = isinstance(msg, wire.Ack) or req is not None and req.kind == "stacks"
            ok = (req is not None and fits and label == req.job and rid is not None and req.asked.get(rank) == rid
                  and rank not in req.answers)
            if not ok:
                self.counts["answers_rejected"] += 1
                return False
            self.counts["answers"] += 1
            req.answers[rank] = msg
            if isinstance(msg, wire.Ack) and not msg.accepted:
                self.counts["refused"] += 1
                log.info("gradwatch aggregator: rank %d of job %r refused %s: %s", rank, req.job, req.kind, msg.why)
            if req.complete:
                req.done.set()
        return True

    def tick(self) -> None:
        """Writer thread: requests complete or past their deadline are closed; a finding's
        stacks update the finding."""
        now = self.clock()
        closed = []
        with self._lock:
            for k, req in list(self._requests.items()):
                if req.purpose:  # a finding's: closed here once answered, or at its deadline
                    if req.complete or now >= req.deadline:
                        del self._requests[k]
                        closed.append(req)
                elif now >= req.deadline:
                    req.done.set()  # a caller waiting closes its own (_finish); a halt's nobody waits for
                    if now >= req.deadline + MAX_WAIT_S:
                        del self._requests[k]
        for req in closed:
            self._update_finding(req)
        due, self._due = self._due, []
        for job, check, key, details in due:
            if self.annotate is not None:
                self.annotate(job, check, key, details)

    # --- findings -------------------------------------------------------------------------------

    def on_event(self, e) -> None:
        """Writer thread, a sink of the check runner (``runner.Event``): a raised finding of a
        :data:`STACK_CHECKS` check naming a rank asks for stacks; a raised critical finding of a
        check in a job's ``halt_on`` halts the job."""
        if e.event != "raised":
            return
        try:
            if e.check in STACK_CHECKS and e.rank is not None:
                self._ask_stacks(e)
            if e.severity == "critical":
                self._maybe_halt(e)
        except ControlError as err:
            log.info("gradwatch aggregator: no %s for %s in job %r: %s",
                     "stacks" if e.check in STACK_CHECKS else "halt", e.check, e.job, err)

    def _ask_stacks(self, e) -> None:
        stuck = int(e.rank)
        named = self.named(e.job) if self.named is not None else set()
        with self._lock:
            routes = self._routes.get(e.job, {})
            others = sorted(k for k in routes if k != stuck and k not in named)
            healthy = others[0] if others else None
        ranks = [stuck] + ([healthy] if healthy is not None else [])
        self._request(e.job, wire.StacksArgs(source=True), ranks, FINDING_WAIT_S,
                      purpose=("finding", e.check, (e.rank, e.layer), stuck, healthy), strict=False)

    def _update_finding(self, req: Request) -> None:
        _, check, key, stuck, healthy = req.purpose
        a = req.answers.get(stuck)
        stacks: dict = {"stuck": _rank_stack(stuck, a)}
        if healthy is not None:
            stacks["healthy"] = _rank_stack(healthy, req.answers.get(healthy))
        if not isinstance(a, wire.Stack):
            why = ("its training thread holds the GIL, or the process is stopped" if a is None
                   else f"it refused: {a.why}")
            stacks["differ_at"] = f"no answer from rank {stuck} within {FINDING_WAIT_S:g} s: {why}"
        elif healthy is not None and isinstance(req.answers.get(healthy), wire.Stack):
            stacks["differ_at"] = differ_at(stacks["stuck"]["frames"], stacks["healthy"]["frames"])
        else:
            stacks["differ_at"] = None
        top = stacks["stuck"]["frames"][-1] if stacks["stuck"]["frames"] else None
        log.warning("gradwatch aggregator: %s in job %r: rank %d %s", check, req.job, stuck,
                    f"is at {top['file']}:{top['line']} {top['function']}" if top else stacks["differ_at"])
        if self.annotate is not None:
            self.annotate(req.job, check, key, {"stacks": stacks})

    def _maybe_halt(self, e) -> None:
        now = self.clock()
        with self._lock:
            info = self._jobs.get(e.job)
            if info is None or e.check not in info.halt_on:
                return
            if info.unsettled:
                self.counts["halts_withheld"] += 1
                log.warning("gradwatch aggregator: not halting job %r on %s: %s (a halt follows only ranks whose "
                            "identity is settled for %.0f s; CURVE keys make it certain)", e.job, e.check,
                            info.unsettled, HALT_SETTLE_S)
                self._due.append((e.job, e.check, (e.rank, e.layer), {"halt": {"withheld": info.unsettled}}))
                return
            done = self._halted.setdefault(e.job, set())
            key = (e.check, e.rank, e.layer, e.step)
            if key in done:
                return
            if len(done) >= HALTED_MAX:
                done.clear()
            done.add(key)
            under_way = self._halting.get(e.job)
            if under_way is not None and now < under_way[2]:
                # another finding halted the job a moment ago: the ranks stop at that step, once
                step, ranks = under_way[0], under_way[1]
                req = None
            else:
                step = info.max_step + margin(info.step_s)
        if under_way is None or now >= under_way[2]:
            req = self._request(e.job, wire.HaltArgs(step, e.check, e.summary[:512]), None, MAX_WAIT_S, rated=False)
            ranks = sorted(req.asked)
            with self._lock:
                self._halting[e.job] = (step, ranks, now + COMMAND_TTL_S["halt"])
            self.counts["halts"] += 1
            log.warning("gradwatch aggregator: halting job %r at step %d on %s: %s (%d ranks asked)", e.job, step,
                        e.check, e.summary, len(ranks))
        # recorded at the next tick: the runner is still raising the finding now
        self._due.append((e.job, e.check, (e.rank, e.layer), {"halt": {"step": step, "ranks": ranks,
                                                                       **({"sent": False} if req is None else {})}}))

    # --- requests -------------------------------------------------------------------------------

    def _request(self, job: str, args, ranks, wait_s: float, purpose: tuple = (), strict: bool = True,
                 rated: bool = True) -> Request:
        """Send one command (``args``) to ``ranks`` of ``job`` (None: every routed rank, the
        command naming rank -1; else each rank its own, naming it and its boot) and open its
        request, waited for ``wait_s`` seconds.

        Raises:
            ControlError: no such job or rank connected (404), the job's rate spent (429; not for
                a request that is not ``rated``: a halt), too many requests open or the outbox
                full (503). With ``strict`` false a rank not connected is asked nothing (it stays
                unanswered) instead.
        """
        kind = args.__struct_config__.tag
        now, wall = self.clock(), self.wall()
        with self._lock:
            routes = self._routes.get(job)
            if not routes:
                raise ControlError(404, f"no rank of job {job!r} is connected to this aggregator")
            if ranks is None:
                targets = dict(routes)
            else:
                missing = [k for k in ranks if k not in routes]
                if missing and strict:
                    raise ControlError(404, f"rank {missing[0]} of job {job!r} is not connected to this aggregator")
                targets = {k: routes[k] for k in ranks if k in routes}
            tokens, at = self._tokens.get(job, (float(REQUEST_BURST), now))
            tokens = min(float(REQUEST_BURST), tokens + (now - at) * REQUESTS_PER_S)
            if rated and tokens < 1:
                self.counts["throttled"] += 1
                raise ControlError(429, f"job {job!r} had {REQUESTS_PER_S:g} control requests a second already")
            if len(self._requests) >= MAX_REQUESTS:
                raise ControlError(503, f"{MAX_REQUESTS} control requests are open already")
            self._tokens[job] = (max(tokens - 1, 0.0), now)
            cid = secrets.randbits(63)
            name = self._jobs[job].name if job in self._jobs else job
            expires = wall + COMMAND_TTL_S[kind]
            req = Request(cid, job, kind, {}, now + wait_s, purpose)
            every = wire.encode(wire.Command(cid, name, -1, "", wall, expires, args)) if ranks is None else b""
            for rank, (boot, rid) in targets.items():
                frame = every or wire.encode(wire.Command(cid, name, rank, boot, wall, expires, args))
                if self.outbox.put(rid, frame):
                    req.asked[rank] = rid
                    self.counts["commands"] += 1
            if targets and not req.asked:
                raise ControlError(503, "the aggregator's command queue is full")
            for k in ranks or ():  # a rank not connected is asked nothing, and counts as not answering
                req.asked.setdefault(k, None)
            self._requests[cid] = req
            self.counts["requests"] += 1
            req.step = getattr(args, "step", getattr(args, "start", -1))
        return req

    def _finish(self, req: Request) -> dict:
        """Close a caller's request: its answers as ``{rank: message}`` and the ranks that gave none."""
        with self._lock:
            self._requests.pop(req.id, None)
            answers = dict(req.answers)
        return {"answers": answers, "no_answer": sorted(k for k in req.asked if k not in answers)}

    def start_step(self, job: str) -> int:
        """The step a command to every rank of ``job`` names: its highest latest step +
        :func:`margin`.

        Raises:
            ControlError: 404 when the job is not known (admitted) here, 503 when it has just
                arrived (its steps are taken at the writer's next tick)."""
        with self._lock:
            info, routed = self._jobs.get(job), job in self._routes
        if info is None:
            if routed:  # heard, and its steps not taken yet (the writer's next tick)
                raise ControlError(503, f"job {job!r} has just arrived: try again in a second")
            raise ControlError(404, f"no job {job!r} reports to this aggregator")
        return max(info.max_step, 0) + margin(info.step_s)

    # --- on demand (HTTP threads) ---------------------------------------------------------------

    def stacks(self, job: str, rank: Optional[int] = None, wait_s: float = WAIT_S, source: bool = False) -> dict:
        """Every connected rank's stack of ``job`` (or ``rank``'s), waited for ``wait_s`` seconds
        at most (clipped to 0..:data:`MAX_WAIT_S`): ``{"job_id", "groups": [{"ranks", "frames",
        ...}], "no_answer": [ranks], "refused": {rank: why}}``, the groups by identical frame lists
        (file, line, function), largest first, each with the ranks' ``in_step_s`` and
        ``waiting``, and ``flight`` where the ranks sent Flight Recorder entries.

        Raises:
            ControlError: see :meth:`_request`.
        """
        wait_s = _wait(wait_s)
        req = self._request(job, wire.StacksArgs(source=source), None if rank is None else [rank], wait_s)
        req.done.wait(wait_s)
        got = self._finish(req)
        groups: dict[tuple, dict] = {}
        refused = {}
        for k, m in sorted(got["answers"].items()):
            if isinstance(m, wire.Ack):
                refused[str(k)] = m.why
                continue
            frames = frames_of(m)
            key = tuple((f["file"], f["line"], f["function"]) for f in frames)
            g = groups.setdefault(key, {"ranks": [], "frames": frames, "in_step_s": {}, "waiting": {}})
            g["ranks"].append(k)
            g["in_step_s"][str(k)] = m.in_step_s
            g["waiting"][str(k)] = m.waiting
            if m.error:
                g.setdefault("error", {})[str(k)] = m.error
            if m.flight:
                g.setdefault("flight", {})[str(k)] = [[e.collective, e.state, e.sequence] for e in m.flight]
        out = sorted(groups.values(), key=lambda g: (-len(g["ranks"]), g["ranks"][0]))
        return {"job_id": job, "groups": out, "no_answer": got["no_answer"], "refused": refused}

    def probe(self, job: str, steps: int, layers: tuple = (), wait_s: float = WAIT_S) -> dict:
        """Make every connected rank of ``job`` probe ``steps`` steps from :meth:`start_step`
        (``layers``: fnmatch patterns of module paths, none: every layer); waits ``wait_s`` at
        most for the acks: ``{"job_id", "start", "steps", "acks": {rank: first step covered},
        "refused": {rank: why}, "no_answer": [ranks]}``.

        Raises:
            ControlError: see :meth:`_request` and :meth:`start_step`; ``ValueError`` for
                ``steps`` or ``layers`` out of the wire's bounds (:class:`gradwatch.wire.ProbeArgs`).
        """
        args = _checked(wire.ProbeArgs, start=self.start_step(job), steps=steps, layers=tuple(layers))
        return self._acked(job, args, wait_s, start=args.start, steps=args.steps, layers=list(args.layers))

    def budget(self, job: str, budget: float, for_s: float, wait_s: float = WAIT_S) -> dict:
        """Give every connected rank of ``job`` the probe budget ``budget`` for ``for_s`` seconds;
        the answer as :meth:`probe`'s (``acks``: the step each took it at).

        Raises:
            as :meth:`probe`'s (bounds of :class:`gradwatch.wire.BudgetArgs`)."""
        args = _checked(wire.BudgetArgs, budget=budget, for_s=for_s)
        if job not in self._jobs:
            raise ControlError(404, f"no job {job!r} reports to this aggregator")
        return self._acked(job, args, wait_s, budget=args.budget, for_s=args.for_s)

    def _acked(self, job: str, args, wait_s: float, **said) -> dict:
        wait_s = _wait(wait_s)
        req = self._request(job, args, None, wait_s)
        req.done.wait(wait_s)
        got = self._finish(req)
        acks = {str(k): m.step for k, m in sorted(got["answers"].items()) if m.accepted}
        refused = {str(k): m.why for k, m in sorted(got["answers"].items()) if not m.accepted}
        return {"job_id": job, **said, "acks": acks, "refused": refused, "no_answer": got["no_answer"]}

    def view(self) -> tuple:
        """``((what, count), ...)`` of :attr:`counts` and the outbox's, for the exporter."""
        with self._lock:
            c = dict(self.counts)
            c["sent"], c["dropped"] = self.outbox.sent_n, self.outbox.dropped_n
        return tuple(sorted(c.items()))


def _wait(wait_s: float) -> float:
    """``wait_s`` within 0..:data:`MAX_WAIT_S` (:data:`WAIT_S` when not a finite number)."""
    return min(max(wait_s, 0.0), MAX_WAIT_S) if math.isfinite(wait_s) else WAIT_S


def _checked(cls, **kw):
    """``cls(**kw)`` validated as the wire validates it (bounds, types); ``ValueError`` naming
    what is out of bounds."""
    import msgspec

    try:
        return msgspec.convert(kw, cls)
    except msgspec.ValidationError as e:
        raise ValueError(str(e)) from None
