"""The data side of ``gradwatch top``: what an aggregator's HTTP API says, read into a small typed
model. :func:`fetch` is the only function that touches the network; the rest are pure functions
of the texts it brings back, testable without a terminal.

What it reads (the aggregator's HTTP server, ``--metrics-host``/``--metrics-port``):

- ``/metrics``: the Prometheus exposition, parsed with prometheus_client's parser. The families
  read are :data:`JOB_METRICS`, :data:`RANK_METRICS` and :data:`FINDING_METRICS`.
- ``/api/findings?active=1``: the findings active now, then ``/api/findings``: the findings'
  events (raised, updated, resolved), newest first, as far back as the aggregator's event ring
  holds them. A finding raised and resolved between two refreshes is thus still seen.

Times: the aggregator stamps findings and ``last_seen`` with its own wall clock. :func:`fetch`
reads the aggregator's clock from the HTTP ``Date`` header (whole seconds), so ages stay right when
``gradwatch top`` runs on another host whose clock is off by more than :data:`CLOCK_SLACK_S`.

Errors: :class:`FetchError` (the aggregator cannot be reached, answers with an HTTP error, or
serves something that is not a gradwatch exposition), one line naming the URL and why.
"""

from __future__ import annotations

import collections
import email.utils
import json
import fnmatch
import math
import socket
import statistics
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, replace
from http.client import HTTPException
from typing import Any, Iterable, Optional
from urllib.parse import urlsplit

from prometheus_client.parser import text_string_to_metric_families

from gradwatch.errors import GradwatchError

#: per-job families read from /metrics (full sample names)
JOB_METRICS = (
    "gradwatch_job_world_size",
    "gradwatch_job_ranks_reporting",
    "gradwatch_job_ended",
    "gradwatch_job_restarts_total",
    "gradwatch_job_probe_step",
    "gradwatch_job_rank_step",  # {agg}: jobs above --rank-series-max only
    "gradwatch_job_step_age_seconds",  # the training_stalled check's, absent when it is disabled
)
#: per-rank families read from /metrics: sample name -> :class:`Rank` field
RANK_METRICS = {
    "gradwatch_rank_step": "step",
    "gradwatch_rank_step_seconds": "step_s",
    "gradwatch_rank_grad_norm": "grad_norm",
    "gradwatch_rank_local_grad_norm": "local_grad_norm",
    "gradwatch_rank_loss": "loss",
    "gradwatch_rank_last_seen_timestamp_seconds": "last_seen",
}
#: per-finding families read from /metrics
FINDING_METRICS = (
    "gradwatch_check_rank_flagged",  # {job_id, check, rank}: 1 while an active finding names the rank
    "gradwatch_rank_finding_raised_timestamp_seconds",  # {job_id, check, rank}: its latest raise
    "gradwatch_check_findings_active",  # {job_id, check}
)
#: clock offsets between this host and the aggregator's up to this many seconds are taken as none
#: (the Date header has whole seconds); larger ones are corrected
CLOCK_SLACK_S = 2.0
NAN = math.nan


class FetchError(GradwatchError):
    """The aggregator could not be read: unreachable, an HTTP error, or not a gradwatch exposition.
    The message is one line naming the URL."""


@dataclass(frozen=True)
class Rank:
    """One rank of a job as /metrics shows it. Floats are NaN where the aggregator exports no
    series for the rank (jobs above ``--rank-detail-max`` ranks keep some series only for the ranks
    a finding names).

    Attributes:
        rank: the rank (0-based).
        step: its latest optimizer step (0-based), None when not exported.
        step_s: wall time of that step, seconds.
        grad_norm: global L2 gradient norm at that step (after all-reduce and any clipping).
        local_grad_norm: L2 norm of the rank's own gradients before all-reduce.
        loss: the loss the training script reported at that step.
        last_seen: when the aggregator last heard from the rank, seconds since the epoch (its clock).
        flagged: the checks whose active finding names the rank, sorted.
        named: ``((check, time), ...)``: when each check last raised a finding naming the rank,
            seconds since the epoch (the aggregator's clock), latest first.
    """

    rank: int
    step: Optional[int] = None
    step_s: float = NAN
    grad_norm: float = NAN
    local_grad_norm: float = NAN
    loss: float = NAN
    last_seen: float = NAN
    flagged: tuple[str, ...] = ()
    named: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class Job:
    """One job the aggregator tracks.

    Attributes:
        job_id: the job's id (the metrics' ``job_id`` label).
        world: world size its ranks report.
        reporting: ranks the aggregator hears from now.
        ended: every rank said goodbye (training finished, or the processes exited).
        restarts: times the job came back from an earlier step under the same id.
        probe_step: step of the latest reconciled probed step, None before the first.
        step_age_s: seconds since any rank last completed a step (NaN where the
            ``training_stalled`` check is disabled).
        ranks: the ranks with per-rank series, by rank (above ``--rank-series-max`` ranks: only
            those a finding names).
        steps: ``(min, max)`` latest step over the job's ranks, None when unknown.
        active: active findings of the job, by check (knock-ons folded into their cause's not
            counted).
    """

    job_id: str
    world: int = 0
    reporting: int = 0
    ended: bool = False
    restarts: int = 0
    probe_step: Optional[int] = None
    step_age_s: float = NAN
    ranks: tuple[Rank, ...] = ()
    steps: Optional[tuple[int, int]] = None
    active: tuple[tuple[str, int], ...] = ()

    @property
    def grad_norm(self) -> float:
        """The job's global gradient norm: the median over its ranks' finite ``grad_norm`` (the
        same value on every rank after all-reduce); NaN when none is finite, Inf when one is Inf
        and none finite."""
        values = [r.grad_norm for r in self.ranks]
        finite = [v for v in values if math.isfinite(v)]
        if finite:
            return statistics.median(finite)
        return math.inf if any(math.isinf(v) for v in values) else NAN


@dataclass(frozen=True)
class Finding:
    """One finding: from its raise to its resolution, as the events tell it.

    Attributes:
        check, severity, job_id, rank, layer: what it is about (rank and layer None when it
            names none).
        step: the step its latest event gives.
        summary: its latest event's summary.
        raised_at: when it was raised, seconds since the epoch (the aggregator's clock); None when
            the aggregator's event ring no longer holds its raised event.
        resolved_at: when it resolved; None while active, or when it resolved but the events
            read do not say when.
        active: whether it is active now.
    """

    check: str
    severity: str
    job_id: str
    rank: Optional[int]
    layer: Optional[str]
    step: int
    summary: str
    raised_at: Optional[float] = None
    resolved_at: Optional[float] = None
    active: bool = True

    @property
    def key(self) -> tuple:
        return (self.check, self.job_id, self.rank, self.layer)

    @property
    def last_time(self) -> Optional[float]:
        """The time of its latest known event (resolved, else raised), or None."""
        return self.resolved_at if self.resolved_at is not None else self.raised_at


@dataclass(frozen=True)
class Scrape:
    """What one :func:`fetch` brought back.

    Attributes:
        metrics: the /metrics exposition text.
        events: /api/findings' events, newest first (dicts as served).
        active: /api/findings?active=1's findings (dicts as served).
        server_time: the aggregator's wall clock when it answered, seconds since the epoch (this
            host's clock when the two agree within :data:`CLOCK_SLACK_S`).
    """

    metrics: str
    events: list
    active: list
    server_time: float


@dataclass(frozen=True)
class View:
    """Everything ``gradwatch top`` shows after one refresh.

    Attributes:
        jobs: the jobs, by id.
        findings: the active findings, then those resolved within ``recent_s``, each group
            latest first.
        now: the aggregator's wall clock at the refresh, seconds since the epoch.
    """

    jobs: tuple[Job, ...]
    findings: tuple[Finding, ...]
    now: float


# --- fetching ---------------------------------------------------------------------------------------


def base_url(url: str) -> str:
    """The aggregator's HTTP base URL from ``url`` (``http[s]://HOST[:PORT][/PATH]``; a trailing
    ``/metrics`` or ``/`` is dropped, so a copied metrics URL works too).

    Raises:
        ValueError: not an http(s) URL with a host.
    """
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"give the aggregator's HTTP address as http://HOST:PORT, got {url!r}")
    try:
        parts.port  # noqa: B018 - raises on a port that is no number or out of range
    except ValueError as e:
        raise ValueError(f"the port: {e}") from None
    return url.strip().rstrip("/").removesuffix("/metrics").rstrip("/")


def clock_offset(date_header: Optional[str], local_now: float) -> float:
    """Seconds to add to this host's clock to read the aggregator's, from an HTTP ``Date`` header
    received at ``local_now``: 0 when the header is missing or unreadable, or the clocks agree
    within :data:`CLOCK_SLACK_S`."""
    if not date_header:
        return 0.0
    try:
        server = email.utils.parsedate_to_datetime(date_header).timestamp()
    except (TypeError, ValueError, IndexError):
        return 0.0
    off = server - local_now
    return off if abs(off) > CLOCK_SLACK_S else 0.0


def _get(url: str, timeout_s: float) -> tuple[bytes, Optional[str]]:
    """The body and Date header of ``url``.

    Raises:
        FetchError: any failure, one line.
    """
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.read(), r.headers.get("Date")
    except urllib.error.HTTPError as e:
        raise FetchError(f"{url} answered {e.code} {e.reason}: is this a gradwatch aggregator's address?") from None
    except urllib.error.URLError as e:
        reason = e.reason.strerror if isinstance(e.reason, OSError) and e.reason.strerror else e.reason
        raise FetchError(f"cannot reach {url}: {reason}") from None
    except (socket.timeout, TimeoutError):
        raise FetchError(f"cannot reach {url}: no answer within {timeout_s:g} s") from None
    except (OSError, HTTPException) as e:  # reset, a closed connection, a malformed answer
        raise FetchError(f"cannot read {url}: {type(e).__name__}: {e}") from None


def _json(url: str, timeout_s: float) -> list:
    body, _ = _get(url, timeout_s)
    try:
        return json.loads(body)["findings"]
    except (ValueError, KeyError, TypeError):
        raise FetchError(f"{url} did not answer with findings: is this a gradwatch aggregator's address?") from None


def fetch(url: str, timeout_s: float = 5.0) -> Scrape:
    """Read an aggregator's /metrics, active findings and finding events.

    Args:
        url: the aggregator's HTTP address (:func:`base_url`).
        timeout_s: seconds each of the three requests may take.

    Raises:
        FetchError: the aggregator cannot be reached or read, one line naming the URL and why.
    """
    base = base_url(url)
    body, date = _get(base + "/metrics", timeout_s)
    offset = clock_offset(date, time.time())
    # active findings before the events: an active finding the (later, fresher) events do not
    # mention is one whose raised event has left the ring
    active = _json(base + "/api/findings?active=1", timeout_s)
    events = _json(base + "/api/findings", timeout_s)
    return Scrape(body.decode("utf-8", "replace"), events, active, time.time() + offset)


# --- /metrics -----------------------------------------------------------------------------------------


def samples(text: str) -> dict[str, list[tuple[dict, float]]]:
    """``{sample name: [(labels, value), ...]}`` of every ``gradwatch_`` sample in an exposition.

    Raises:
        ValueError: ``text`` is not a Prometheus text exposition, or holds no gradwatch sample.
    """
    out: dict[str, list] = collections.defaultdict(list)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("gradwatch_"):
                out[s.name].append((s.labels, s.value))
    if not out:
        raise ValueError("no gradwatch_ metrics in it")
    return dict(out)


def _int(v: float) -> Optional[int]:
    return int(v) if math.isfinite(v) else None


def jobs(text: str) -> tuple[Job, ...]:
    """The jobs an aggregator's /metrics exposition describes, by id, their ranks by rank.

    Raises:
        ValueError: ``text`` is not a gradwatch exposition (:func:`samples`).
    """
    s = samples(text)
    found: dict[str, dict[str, Any]] = {}

    def job(labels: dict) -> dict[str, Any]:
        return found.setdefault(labels["job_id"], {"job_id": labels["job_id"]})

    for name, field in (("gradwatch_job_world_size", "world"), ("gradwatch_job_ranks_reporting", "reporting"),
                        ("gradwatch_job_restarts_total", "restarts")):
        for labels, v in s.get(name, ()):
            job(labels)[field] = int(v)
    for labels, v in s.get("gradwatch_job_ended", ()):
        job(labels)["ended"] = v == 1
    for labels, v in s.get("gradwatch_job_probe_step", ()):
        job(labels)["probe_step"] = _int(v)
    for labels, v in s.get("gradwatch_job_step_age_seconds", ()):
        job(labels)["step_age_s"] = v
    over = collections.defaultdict(dict)  # job -> {agg: step} for jobs above --rank-series-max
    for labels, v in s.get("gradwatch_job_rank_step", ()):
        over[labels["job_id"]][labels["agg"]] = _int(v)
    active = collections.defaultdict(list)
    for labels, v in s.get("gradwatch_check_findings_active", ()):
        if v > 0:
            active[labels["job_id"]].append((labels["check"], int(v)))

    ranks: dict[tuple[str, int], dict[str, Any]] = {}

    def rank(labels: dict) -> dict[str, Any]:
        key = (labels["job_id"], int(labels["rank"]))
        return ranks.setdefault(key, {"rank": key[1], "flagged": [], "named": []})

    for name, field in RANK_METRICS.items():
        for labels, v in s.get(name, ()):
            rank(labels)[field] = _int(v) if field == "step" else v
    for labels, v in s.get("gradwatch_check_rank_flagged", ()):
        if v == 1:
            rank(labels)["flagged"].append(labels["check"])
    for labels, v in s.get("gradwatch_rank_finding_raised_timestamp_seconds", ()):
        rank(labels)["named"].append((labels["check"], v))

    by_job: dict[str, list[Rank]] = collections.defaultdict(list)
    for (job_id, _), r in sorted(ranks.items()):
        r = dict(r, flagged=tuple(sorted(r["flagged"])), named=tuple(sorted(r["named"], key=lambda x: -x[1])))
        by_job[job_id].append(Rank(**r))
        found.setdefault(job_id, {"job_id": job_id})
    out = []
    for job_id in sorted(found):
        rs = tuple(by_job.get(job_id, ()))
        agg = over.get(job_id)
        if agg and agg.get("min") is not None and agg.get("max") is not None:
            steps = (agg["min"], agg["max"])
        else:
            known = [r.step for r in rs if r.step is not None]
            steps = (min(known), max(known)) if known else None
        out.append(Job(**found[job_id], ranks=rs, steps=steps, active=tuple(sorted(active.get(job_id, ())))))
    return tuple(out)


# --- findings -------------------------------------------------------------------------------------


def _finding(item: dict, **kw) -> Finding:
    return Finding(
        check=str(item.get("check", "")), severity=str(item.get("severity", "")),
        job_id=str(item.get("job_id", item.get("job", ""))), rank=item.get("rank"), layer=item.get("layer"),
        step=int(item.get("step", -1)), summary=str(item.get("summary", "")), **kw,
    )


def findings(events: Iterable[dict], active: Iterable[dict], now: float, recent_s: float) -> tuple[Finding, ...]:
    """The findings to show: every active one, and those whose latest event is at most
    ``recent_s`` seconds before ``now``; active first, each group latest first.

    Args:
        events: /api/findings' events, newest first: dicts with ``event`` (raised, updated,
            resolved), ``time`` (seconds since the epoch), ``check``, ``severity``, ``job_id``,
            ``rank``, ``layer``, ``step``, ``summary``.
        active: /api/findings?active=1's findings (the same keys, ``since`` for ``time``), read
            *before* ``events``: the events, fresher, win where both speak of one finding; an
            active finding they do not mention (its raised event left the ring) is active.
        now: the aggregator's clock, seconds since the epoch.
        recent_s: how long a resolved finding stays listed, seconds.

    A finding is its ``(check, job, rank, layer)``: *raised* opens one, *updated* changes its
    summary and step (and reopens the latest one resolved, as a knock-on does within the
    aggregator's knock_on_window_s), *resolved* closes it.
    """
    episodes: list[Finding] = []
    latest: dict[tuple, int] = {}  # key -> index in episodes of its latest finding
    for e in reversed(list(events)):  # oldest first
        f = _finding(e, raised_at=e.get("time"), active=True)
        kind, k = e.get("event"), f.key
        i = latest.get(k)
        if kind == "raised" or i is None:
            if kind == "raised" and i is not None and episodes[i].active:
                episodes[i] = replace(episodes[i], active=False)  # closed unseen (its resolution left the ring)
            if kind != "raised":  # its raised event left the ring
                f = replace(f, raised_at=None)
            latest[k] = len(episodes)
            episodes.append(f)
            i = latest[k]
        else:
            episodes[i] = replace(episodes[i], step=f.step, summary=f.summary, severity=f.severity or episodes[i].severity,
                                  active=True, resolved_at=None)
        if kind == "resolved":
            episodes[i] = replace(episodes[i], active=False, resolved_at=e.get("time"))
    for a in active:
        f = _finding(a, raised_at=a.get("since"), active=True)
        if f.key not in latest:
            latest[f.key] = len(episodes)
            episodes.append(f)
    shown = [f for f in episodes if f.active or (f.last_time is not None and f.last_time >= now - recent_s)]
    return tuple(sorted(shown, key=lambda f: (not f.active, -(f.last_time if f.last_time is not None else -math.inf))))


def view(scrape: Scrape, recent_s: float, job: str = "") -> View:
    """The :class:`View` of one :func:`fetch`: jobs still training first (the most recently
    stepping first), then ended ones, each group by id; with ``job``, only the jobs whose id
    matches it (a shell pattern: ``llama-*``), and only their findings.

    Raises:
        FetchError: its /metrics text is not a gradwatch exposition.
    """
    try:
        js = jobs(scrape.metrics)
    except (ValueError, KeyError) as e:  # KeyError: a gradwatch_ series without the labels it has here
        raise FetchError(f"/metrics is not a gradwatch aggregator's: {e}") from None
    found = findings(scrape.events, scrape.active, scrape.server_time, recent_s)
    if job:
        found = tuple(f for f in found if fnmatch.fnmatchcase(f.job_id, job))
    return View(arrange(js, job), found, scrape.server_time)


def arrange(js: Iterable[Job], job: str = "") -> tuple[Job, ...]:
    """``js`` in the order the view lists them: jobs still training first, the most recently
    stepping first, then ended ones, ties by id; with ``job``, only those whose id matches that
    shell pattern."""
    picked = [j for j in js if not job or fnmatch.fnmatchcase(j.job_id, job)]
    return tuple(sorted(picked, key=lambda j: (j.ended, j.step_age_s if math.isfinite(j.step_age_s) else math.inf, j.job_id)))


# --- what a rank's status says ----------------------------------------------------------------------


def rank_status(rank: Rank, job: Job, now: float, silent_after_s: float, recent_s: float) -> str:
    """A rank's status in a word or two:

    - the checks whose active finding names the rank (``explosion``, ``rank_silent, straggler``);
    - else ``finished`` once the job ended (every rank said goodbye);
    - else ``silent`` when the aggregator has not heard from it for more than ``silent_after_s``
      (a rank that said goodbye too, until the job shows ended: /metrics has no goodbye per rank);
    - else ``ok``.

    Followed by ``(was CHECK, Ns ago)`` when a finding that no longer stands named the rank at
    most ``recent_s`` seconds before ``now`` (the aggregator's clock).
    """
    if rank.flagged:
        word = ", ".join(rank.flagged)
    elif job.ended:
        word = "finished"
    elif math.isfinite(rank.last_seen) and now - rank.last_seen > silent_after_s:
        word = "silent"
    else:
        word = "ok"
    was = [(c, t) for c, t in rank.named if c not in rank.flagged and now - t <= recent_s]
    if was:
        check, t = was[0]
        word += f" (was {check}, {age(now - t)} ago)"
    return word


def rank_rows(job: Job, now: float, silent_after_s: float, recent_s: float, most: int) -> tuple[list[tuple[Rank, str]], int]:
    """The ranks of ``job`` to list, each with its :func:`rank_status`, and how many are left out:
    every rank by rank when there are at most ``most``; else the ranks whose status is other than
    a plain ``ok`` or ``finished`` first, then by rank, ``most`` in all."""
    rows = [(r, rank_status(r, job, now, silent_after_s, recent_s)) for r in sorted(job.ranks, key=lambda r: r.rank)]
    if len(rows) <= most:
        return rows, 0
    rows.sort(key=lambda x: (x[1] in ("ok", "finished"), x[0].rank))
    return rows[:most], len(rows) - most


def age(seconds: float) -> str:
    """``seconds`` in a few characters: ``0.4s``, ``12s``, ``3m05s``, ``2h04m``, ``-`` when NaN."""
    if not math.isfinite(seconds):
        return "-"
    seconds = max(0.0, seconds)
    if seconds < 10:
        return f"{seconds:.1f}s"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class NormHistory:
    """The global gradient norm of each job at the steps the refreshes saw (/metrics holds only
    the latest step's): one point per refresh whose step is past the last one's.

    Args:
        size: points kept per job.
    """

    def __init__(self, size: int = 240):
        self.size = size
        self._points: dict[str, collections.deque] = {}

    def add(self, js: Iterable[Job]) -> None:
        """Record each job's latest step and norm; a job no longer listed is forgotten, one whose
        step went back (restarted from a checkpoint) starts over."""
        seen = set()
        for j in js:
            seen.add(j.job_id)
            if j.steps is None or j.steps[1] < 0:  # -1: no step reported yet
                continue
            step = j.steps[1]
            pts = self._points.setdefault(j.job_id, collections.deque(maxlen=self.size))
            if pts and step < pts[-1][0]:
                pts.clear()
            if not pts or step > pts[-1][0]:
                pts.append((step, j.grad_norm))
        for gone in set(self._points) - seen:
            del self._points[gone]

    def points(self, job_id: str) -> list[tuple[int, float]]:
        """``[(step, global gradient norm), ...]`` of ``job_id``, oldest first."""
        return list(self._points.get(job_id, ()))

    def sparkline(self, job_id: str) -> list[float]:
        """log10 of the finite, positive norms of ``job_id``, oldest first: norms span orders of
        magnitude, and a blow-up would flatten every other point on a linear scale."""
        return [math.log10(v) for _, v in self.points(job_id) if math.isfinite(v) and v > 0]
